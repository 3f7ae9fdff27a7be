"""`POST /v1/retention/r3`: free the stored R3 of sessions a consumer group acknowledged.

Thin: the body is parsed by `app/domain/handoff/retention.py`, the freeing is
`app/store/ops/retention.py`; this router answers `{"sessions", "bytes",
"acked_before"}` (the instant used, in UTC: a time without a zone is UTC) (and
`held_by`, {group: sessions}, when other groups still hold some) and
counts what was freed on `/metrics`. Write scope (a POST).
"""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import BodyDep, ServicesDep
from app.api.problems import JSONText
from app.domain.handoff.retention import parse_r3_retention
from app.domain.projection.rows import iso_us

router = APIRouter(prefix="/v1/retention", tags=["retention"], default_response_class=JSONText)

R3_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"type": "object", "additionalProperties": False,
               "required": ["consumer", "acked_before"],
               "properties": {"consumer": {"type": "string",
                                           "pattern": "^[A-Za-z0-9._:-]{1,64}$"},
                              "acked_before": {"type": "string", "format": "date-time"},
                              "dry_run": {"type": "boolean", "default": False}}},
    "example": {"consumer": "trainer", "acked_before": "2026-12-01T12:00:00Z",
                "dry_run": True}}}}}


@router.post("/r3", openapi_extra=R3_BODY)
async def retain_r3(svc: ServicesDep, body: BodyDep) -> JSONText:
    request = parse_r3_retention(body)
    result = await svc.retention.prune(request)
    if not request.dry_run and result.sessions:
        svc.metrics.r3_pruned_bytes.inc(result.bytes)
        svc.metrics.r3_pruned_sessions.inc(result.sessions)
        svc.reader.notify()
    # The instant used, in UTC: a time sent without a zone was read as UTC, and says so.
    reply: dict[str, object] = {"sessions": result.sessions, "bytes": result.bytes,
                                "acked_before": iso_us(request.acked_before_us)}
    if result.held_by:  # kept for groups that still have to acknowledge them
        reply["held_by"] = result.held_by
    return JSONText(reply)
