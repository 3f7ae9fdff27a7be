"""A body's media type, as a `Content-Type` header names it.

Owns reading the header: the media type lower-cased, its parameters dropped;
and refusing a body with a content coding (`coded_body`).
Which types a route reads is the route's (JSON everywhere; MessagePack too for
turns, `msgpackio.MEDIA_TYPES`). Pure: no I/O.
"""

from __future__ import annotations

from app.domain.errors import UnsupportedMediaType

JSON = "application/json"


def media_type_of(header: str | None) -> str | None:
    """A Content-Type header's media type, lower-cased, parameters dropped (None: blank)."""
    if header is None or not header.strip():
        return None
    return header.split(";", 1)[0].strip().lower()


def coded_body(headers: dict[bytes, bytes]) -> UnsupportedMediaType | None:
    """The 415 for a request body with a content coding (`gzip`, …), else None.

    Bodies are read as sent: a compressed one would be judged as its bytes, and a
    plain one labelled compressed stored as if it were not (RFC 9110 §8.4.1). The
    store's routes and the gateway's own (close, rewards) refuse it alike.
    """
    coding = headers.get(b"content-encoding", b"").strip().lower()
    declared = headers.get(b"content-length")
    if coding in (b"", b"identity") or (
            b"transfer-encoding" not in headers and (declared or b"0").strip() == b"0"):
        return None
    return UnsupportedMediaType(
        "request bodies are read as sent: no content coding is decoded",
        field="content-encoding", expected="no Content-Encoding (or identity)",
        actual=coding.decode("latin-1")[:80])
