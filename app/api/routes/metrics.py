"""`GET /metrics`: the process' Prometheus collectors in text format.

Two gauges are read from the database at scrape time, each within a short
timeout: the feed fence lag and the consumer groups' sessions and lag. A
scrape always answers; a gauge the database could not give is NaN (fence lag)
or left as it was (consumer groups), with a warning in the log.
Refuses counting requests (`app.api.middleware.telemetry`).
"""

from __future__ import annotations

import asyncio

import structlog
from fastapi import APIRouter, Response

from app.api.deps import ServicesDep
from app.api.problems import JSONText
from app.metrics import CONTENT_TYPE
from app.services import Services
from app.store.engine.db import now_us
from app.store.engine.dialect import fence_lag_seconds

router = APIRouter(tags=["service"], default_response_class=JSONText)
log = structlog.get_logger("turnlog.api")
SCRAPE_DB_TIMEOUT = 2.0  # seconds; Prometheus' default scrape timeout is 10


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


async def _consumer_gauges(svc: Services) -> None:
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
