"""Hand-off: consumer groups and retention, apart from the turn pipeline.

Owns which closed sessions a consumer group is offered and acknowledges
(`consumers`) and which stored R3 may be freed (`retention`).
Refuses to be part of an append: may import the pipeline, which never imports it.
"""
