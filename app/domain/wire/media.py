"""A body's media type, as a `Content-Type` header names it.

Owns reading the header: the media type lower-cased, its parameters dropped.
Which types a route reads is the route's (JSON everywhere; MessagePack too for
turns, `msgpackio.MEDIA_TYPES`). Pure: no I/O.
"""

from __future__ import annotations

JSON = "application/json"


def media_type_of(header: str | None) -> str | None:
    """A Content-Type header's media type, lower-cased, parameters dropped (None: blank)."""
    if header is None or not header.strip():
        return None
    return header.split(";", 1)[0].strip().lower()
