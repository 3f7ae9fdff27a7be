"""A write's deadline: the `X-Turnlog-Timeout` request header.

A client that gives up on a write after some seconds says so in this header;
the store then never commits that write later than that many seconds after
the request arrived (it is rolled back and answered 503 `deadline-exceeded`).
Without it, a write that waited on a lock another process held (a SQLite file
locked for a backup, say) is carried out whenever the lock goes, long after
its client has moved on, and may overtake writes that other clients made in
the meantime (docs/api.md §0.4).

Owns the header's name, what its value may be, which requests it applies
to (opens, closes, rewards: `keeps_deadline`), and how long the recording
gateway may wait on the store for a close or reward it is told to answer
within (`store_wait`); the store keeps the clock. Pure: no I/O.
"""

from __future__ import annotations

import math
import re

from app.domain.errors import InvalidRequest

TIMEOUT_HEADER = "X-Turnlog-Timeout"
# As an ASGI server gives header names: lower case bytes.
TIMEOUT_HEADER_KEY = TIMEOUT_HEADER.lower().encode("ascii")
# The requests whose writes keep a deadline: opens, closes, rewards. A turn's append
# needs none (a repeat of it is answered as one, so one carried out late is harmless).
_KEEPS_DEADLINE = re.compile(r"/v1/sessions(/[^/]+/(close|rewards))?")
# A day: longer than any client waits for one write, short enough to be a typo's bound.
MAX_TIMEOUT_S = 86400.0
_EXPECTED = f"seconds, a decimal number > 0 and at most {MAX_TIMEOUT_S:g}"
# The recording gateway waits on the store for this share of a close's or reward's
# timeout at most, then spools it: the rest leaves time to spool (one fsync) and answer.
STORE_WAIT_SHARE = 0.6


def store_wait(timeout: float | None, store_timeout: float) -> float:
    """How long the gateway waits on the store for a close or reward sent with
    `X-Turnlog-Timeout: timeout` (None: not sent) before it spools it instead."""
    return store_timeout if timeout is None else min(store_timeout,
                                                     timeout * STORE_WAIT_SHARE)


def keeps_deadline(path: str) -> bool:
    """Whether a request to `path` reads `X-Turnlog-Timeout` (other routes ignore it)."""
    return _KEEPS_DEADLINE.fullmatch(path) is not None


def parse_timeout(values: list[str]) -> float:
    """The header's seconds, from its one value (InvalidRequest, 400, for anything but
    one decimal number in (0, MAX_TIMEOUT_S]: no `inf`, `nan`, exponent or sign, nor
    a second value, which a proxy may also have joined with a comma)."""
    if len(values) != 1:
        raise InvalidRequest(f"{TIMEOUT_HEADER} must be given once", field=TIMEOUT_HEADER,
                             expected=f"one value: {_EXPECTED}",
                             actual=f"{len(values)} values", status=400)
    value = values[0].strip(" \t")  # HTTP's optional whitespace, nothing else
    digits = value.replace(".", "", 1)
    seconds = float(value) if digits.isdigit() and digits.isascii() else math.nan
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise InvalidRequest(f"{TIMEOUT_HEADER} must be {_EXPECTED}", field=TIMEOUT_HEADER,
                             expected=_EXPECTED, actual=value[:80], status=400)
    return seconds
