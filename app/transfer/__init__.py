"""Moving sessions in and out of turnlog in bulk: dump import and sample exports.

Batch jobs, not request handlers: they run the store services directly
(`app.services`), never through the web layer.
"""
