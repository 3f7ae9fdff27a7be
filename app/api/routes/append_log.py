"""The one log line and the counters of every append, created, repeated or refused.

Both routes that answer `POST /v1/sessions/{session_id}/turns` — the bare hot
path (`hotpath.AppendRoute`) and the documented FastAPI route
(`sessions.append_turn`) — report here, so the line's fields are written once.
Owns no rule: it observes what the store answered.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from app.domain.errors import DomainError
from app.domain.wire.validate import describe
from app.metrics import ApiMetrics
from app.store.append.writes import Written

log = structlog.get_logger("turnlog.api")


def _event_id(body: Any) -> Any:
    """The event id of a refused body, shortened: it may be anything, of any size."""
    return describe(body.get("event_id")) if isinstance(body, dict) else None


def turn_appended(metrics: ApiMetrics, session_id: str, body: Any, written: Written,
                  started: float) -> None:
    result = "created" if written.created else "repeat"
    metrics.turns.labels(result).inc()
    metrics.r3_bytes.inc(written.r3_bytes)
    log.info("turn appended", session_id=session_id, event_id=body["event_id"],
             seq=written.body["seq"], result=result, r3_bytes=written.r3_bytes,
             duration_ms=round((time.perf_counter() - started) * 1000, 3))


def turn_rejected(metrics: ApiMetrics, session_id: str, body: Any, error: DomainError,
                  started: float) -> None:
    metrics.turns_rejected.labels(error.slug).inc()
    log.warning("turn rejected", session_id=describe(session_id), event_id=_event_id(body),
                problem=f"urn:turnlog:{error.slug}", status=error.http_status,
                field=error.field, duration_ms=round((time.perf_counter() - started) * 1000, 3))
