"""Checked bytes: the first step of every request body.

Owns strict JSON (`jsonio`: no NaN, bounded depth, exact equality), MessagePack
(`msgpackio`), the shared field checks every parser uses (`validate`), the R3
codec (`r3`: base64 int32 on the wire, narrowed bytes at rest), which URL
query parameters carry credentials (`url_tokens`) and how many values a body
decodes into, counted before decoding (`width`).
Refuses meaning: no module here knows what a session, a turn or a sample is;
it imports nothing of the domain but `app.domain.errors`.
"""
