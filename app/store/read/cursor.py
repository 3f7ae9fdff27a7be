"""Opaque cursors for the feed and the session list.

A feed cursor is the pair (transaction id, position) of the last event read
(the transaction id is 0 on SQLite, whose rowid order is commit order); a
list cursor is the last session's row id. Both travel as URL-safe base64 so
clients treat them as opaque strings.
"""

from __future__ import annotations

import base64
import binascii

from app.domain.errors import InvalidRequest

START = (0, 0)


def encode(*parts: int) -> str:
    text = "v1:" + ":".join(str(p) for p in parts)
    return base64.urlsafe_b64encode(text.encode("ascii")).decode("ascii").rstrip("=")


def decode(cursor: str | None, arity: int, field: str = "after") -> tuple[int, ...]:
    if cursor is None or cursor == "":
        return (0,) * arity
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        text = base64.urlsafe_b64decode(padded.encode("ascii")).decode("ascii")
        tag, *parts = text.split(":")
        values = tuple(int(p) for p in parts)
        if tag != "v1" or len(values) != arity or any(not 0 <= v < 2**63 for v in values):
            raise ValueError(text)
    except (ValueError, UnicodeError, binascii.Error):
        raise not_issued(cursor, field) from None
    return values


def not_issued(cursor: str, field: str = "after") -> InvalidRequest:
    """The refusal of a cursor this server did not issue: malformed, or well formed but
    naming no event of this store (another store's, a restored backup's, made up)."""
    return InvalidRequest("cursor is not one this server issued", field=field,
                          expected="a `next` value from a previous page",
                          actual=cursor[:80])
