"""The minimum pace every request body keeps: byte n within `grace + n / min_rate`
seconds of waiting for the body (`TURNLOG_UPLOAD_GRACE_S`, `TURNLOG_MIN_UPLOAD_RATE`).

Without it a client trickling a byte every 25 s into a declared length (each
byte inside the body timeout) held its connection, and a place under the
concurrency limit, for as long as it liked. `turnlog serve` keeps the pace for
every body (its middleware, the bare hot route, an upload slot's holder) and the
recording gateway for its callers' bodies; all of them ask this rule when the
next byte is due and say the same words when it is late.

Owns the formula and the refusal's wording. Refuses the clock and the reads:
the caller measures the waiting (from the first read, or only the time spent
waiting for the caller, as the gateway counts it) and raises the error type of
its own layer (`error`). Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

from app.domain.errors import DomainError

E = TypeVar("E", bound=DomainError)


@dataclass(frozen=True)
class MinPace:
    """`min_rate` bytes/s after `grace` seconds; a rate of 0 sets no minimum."""

    min_rate: int = 0
    grace: float = 10.0

    def __bool__(self) -> bool:
        return self.min_rate > 0

    def due(self, seen: int) -> float:
        """Seconds of waiting by which byte `seen + 1` must have arrived (∞ without a
        minimum)."""
        return self.grace + (seen + 1) / self.min_rate if self.min_rate else math.inf

    def too_slow(self, seen: int, waited: float, error: type[E]) -> E:
        """`error` (a 408 of the caller's layer) for a body `seen` bytes into `waited`
        seconds of waiting when its next byte was due."""
        return error(f"request body arrives slower than {self.min_rate} bytes/s",
                     field="body",
                     expected=f"at least {self.min_rate} bytes/s after {self.grace:g} s "
                              "(TURNLOG_MIN_UPLOAD_RATE, TURNLOG_UPLOAD_GRACE_S)",
                     actual=f"{seen} bytes in {waited:.1f} s")
