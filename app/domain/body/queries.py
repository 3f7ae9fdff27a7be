"""Query parameters of the read endpoints: page sizes, status, long-poll wait, `group_by`.

Owns what a query may ask and how an absent or too large value is read:
a page size absent → the endpoint's default, above its maximum → the
maximum ("at most"), below 1 → 422; the session `status` filter; the feed's
`wait` (clamped to `MAX_WAIT` seconds); the `group_by` keys of the
speculative-decoding analytics (`GROUP_BY_VALUES`, the one list the API
documents and the store maps to view columns). Label filters are
`labels.py`'s. The store receives the parsed values. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from app.domain.errors import InvalidRequest
from app.domain.wire.validate import describe

GROUP_BY_VALUES = ("weight_version", "model", "run_id", "rollout_id", "hour", "day")
SESSION_STATUSES = ("open", "closed")
MAX_WAIT = 30.0


@dataclass(frozen=True)
class PageSize:
    """An endpoint's page size rule."""

    default: int
    maximum: int

    def parse(self, limit: int | None) -> int:
        """Absent → the default; above the maximum → the maximum ("at most")."""
        if limit is None:
            return self.default
        if limit < 1:
            raise InvalidRequest(f"limit must be between 1 and {self.maximum}", field="limit",
                                 expected=f"integer in [1, {self.maximum}]", actual=limit)
        return min(limit, self.maximum)

    def parse_text(self, text: str | None) -> int:
        """`parse` of a page size as typed (a web page's query): ASCII digits, else 422
        naming `limit` — where an API route's typed parameter is the framework's."""
        if text is None or not text.strip():
            return self.default
        if not text.strip().isascii() or not text.strip().lstrip("+-").isdigit():
            raise InvalidRequest("limit must be a whole number", field="limit",
                                 expected=f"integer in [1, {self.maximum}]",
                                 actual=describe(text))
        return self.parse(int(text))


EVENTS_PAGE = PageSize(default=1000, maximum=100_000)  # GET /v1/sessions/{id}/events
SESSIONS_PAGE = PageSize(default=100, maximum=1000)  # GET /v1/sessions
FEED_PAGE = PageSize(default=100, maximum=1000)  # GET /v1/events
ACKS_PAGE = PageSize(default=100, maximum=1000)  # GET /v1/consumers/{group}/acks


def parse_status(status: str | None) -> str | None:
    """The session list's `status` filter: absent (every session), open or closed."""
    if status not in (None, *SESSION_STATUSES):
        raise InvalidRequest("status must be open or closed", field="status",
                             expected='"open" | "closed"', actual=describe(status))
    return status


def parse_wait(wait: float | None, maximum: float = MAX_WAIT) -> float | None:
    """A feed's long-poll seconds, clamped to `maximum` (∞ too: "at most"); absent = do
    not wait; negative or NaN → 422. The one parser of `wait` for every feed route."""
    if wait is not None and not wait >= 0:  # NaN fails this too
        raise InvalidRequest(f"wait must be between 0 and {maximum:g} seconds", field="wait",
                             expected=f"number in [0, {maximum:g}]", actual=describe(wait))
    return None if wait is None else min(wait, maximum)


def parse_group_by(value: str | None) -> str:
    """One of `GROUP_BY_VALUES` (required)."""
    if value not in GROUP_BY_VALUES:
        raise InvalidRequest(f"group_by must be one of {', '.join(GROUP_BY_VALUES)}",
                             field="group_by", expected=" | ".join(GROUP_BY_VALUES),
                             actual=describe(value))
    assert value is not None
    return value


def repeated_parameter(pairs: Iterable[tuple[str, str]]) -> InvalidRequest | None:
    """The refusal of the first query parameter given more than once, or None. No
    route of the API takes a list in its query: of `step=1&step=2` the framework
    kept the last and answered for another question than the one asked."""
    seen: dict[str, str] = {}
    for key, value in pairs:
        if key in seen:
            return InvalidRequest(f"query parameter {key[:40]!r} is given more than once",
                                  field=key[:40], expected="each parameter at most once",
                                  actual=f"{seen[key][:40]!r} and {value[:40]!r}")
        seen[key] = value
    return None
