"""R3 retention requests: which consumer group, acknowledged before when, dry run or not.

Pure parsing; the store decides which sessions qualify and frees them.
A time without a zone is UTC; `acked_before` is exclusive.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from app.domain.body.session import describe
from app.domain.errors import InvalidRequest
from app.domain.handoff.consumers import known_group


@dataclass(frozen=True)
class R3Retention:
    consumer: str
    acked_before_us: int
    dry_run: bool


def parse_time_us(value: Any, field: str) -> int:
    """An ISO-8601 time (zone optional, UTC when absent) as microseconds since the epoch."""
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{field} must be an ISO-8601 time", field=field,
                             expected="ISO-8601 UTC time, e.g. 2026-12-01T12:00:00Z",
                             actual=describe(value))
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidRequest(f"{field} is not an ISO-8601 time", field=field,
                             expected="ISO-8601 UTC time, e.g. 2026-12-01T12:00:00Z",
                             actual=value[:80]) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    try:
        moment.astimezone(UTC)  # 9999-12-31T23:00-05:00 is past any time a reply can say
    except OverflowError:
        raise InvalidRequest(f"{field} is out of range", field=field,
                             expected="a time from 0001-01-01 to 9999-12-31 in UTC",
                             actual=value[:80]) from None
    delta = moment - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def parse_r3_retention(raw: Any) -> R3Retention:
    if not isinstance(raw, dict):
        raise InvalidRequest("the body must be a JSON object", field="body",
                             expected="object", actual=describe(raw))
    unknown = sorted(set(raw) - {"consumer", "acked_before", "dry_run"})
    if unknown:
        raise InvalidRequest(f"unknown field {unknown[0]!r}", field=unknown[0],
                             expected="consumer, acked_before, dry_run", actual=unknown[0])
    consumer = raw.get("consumer")
    if not isinstance(consumer, str):
        raise InvalidRequest("consumer must be a consumer group name", field="consumer",
                             expected="[A-Za-z0-9._:-]{1,64}", actual=describe(consumer))
    known_group(consumer)
    dry_run = raw.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise InvalidRequest("dry_run must be true or false", field="dry_run",
                             expected="boolean", actual=describe(dry_run))
    return R3Retention(consumer, parse_time_us(raw.get("acked_before"), "acked_before"),
                       dry_run)
