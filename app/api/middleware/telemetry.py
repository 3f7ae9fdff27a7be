"""`GET /metrics`, per-route request metrics, and the one log line per append.

Requests are counted by route template (`/v1/sessions/{session_id}/turns`),
never by raw path, so the label set stays bounded; an unmatched path counts
as `<unmatched>`. The feed fence lag is read from the database at scrape
time. Owns no rule: it only observes what the handlers and the store did.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from fastapi import APIRouter, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.deps import ServicesDep
from app.domain.errors import DomainError
from app.domain.wire.validate import describe
from app.metrics import CONTENT_TYPE, ApiMetrics
from app.store.append.writes import Written
from app.store.engine.db import now_us
from app.store.engine.dialect import fence_lag_seconds

router = APIRouter(tags=["service"])
log = structlog.get_logger("turnlog.api")
UNMATCHED = "<unmatched>"
SCRAPE_DB_TIMEOUT = 2.0  # seconds; Prometheus' default scrape timeout is 10


class RequestMetrics:
    """Pure ASGI middleware: count and time every HTTP request by route template."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception escaping the app becomes a 500 further out

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            method = scope["method"]
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - started)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE: {}}}})
async def metrics(svc: ServicesDep) -> Response:
    """Prometheus text format."""
    try:
        async with asyncio.timeout(SCRAPE_DB_TIMEOUT), svc.db.read() as conn:
            lag = await fence_lag_seconds(conn, now_us())
    except Exception as exc:  # a scrape must answer, and quickly, even when the database does not
        log.warning("fence lag unavailable", error=repr(exc))
        lag = float("nan")
    svc.metrics.fence_lag.set(lag)
    await _consumer_gauges(svc)
    return Response(svc.metrics.render(), media_type=CONTENT_TYPE)


async def _consumer_gauges(svc: Any) -> None:
    try:
        async with asyncio.timeout(SCRAPE_DB_TIMEOUT):
            groups = await svc.consumers.gauges()
    except Exception as exc:  # as above: the scrape answers without them
        log.warning("consumer gauges unavailable", error=repr(exc))
        return
    for doc, lag in groups:
        for state in ("acked", "leased", "available"):
            svc.metrics.consumer_sessions.labels(doc["group"], state).set(doc[state])
        svc.metrics.consumer_lag.labels(doc["group"]).set(lag)


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
