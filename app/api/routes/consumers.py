"""`/v1/consumers`: consumer groups that hand closed sessions to trainers exactly once.

Thin: bodies are parsed and judged by `app/domain/handoff/consumers.py`, locks and
persistence are `app/store/handoff/consumers.py`; this router maps them to status
codes (201 for what was created, 200 for a repeat).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from app.api.deps import Blank, BodyDep, OptLimit, OptStr, ServicesDep, server_closing
from app.api.problems import JSONText
from app.domain.body.queries import ACKS_PAGE
from app.domain.handoff.consumers import parse_step_filter

router = APIRouter(prefix="/v1/consumers", tags=["consumers"], default_response_class=JSONText)

# null as absent: every session of the claim (the server takes both).
_SESSIONS = {"type": ["array", "null"], "items": {"type": "string"}}


def _body(schema: dict[str, Any], example: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": False, "content": {"application/json": {
        "schema": {"type": "object", "additionalProperties": False, **schema},
        "example": example}}}}


GROUP_BODY = _body({"properties": {"labels": {"type": "object"},
                                   "from": {"enum": ["beginning", "now"]},
                                   "require_reward": {"type": "boolean"}}},
                   {"labels": {"run_id": "run7"}, "from": "beginning"})
CLAIM_BODY = _body({"required": ["claim_id"], "properties": {
    "claim_id": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
    "limit": {"type": "integer", "minimum": 1, "maximum": 1000},
    "lease_seconds": {"type": "integer", "minimum": 1, "maximum": 86400},
    "wait": {"type": "number", "minimum": 0, "maximum": 30}}},
    {"claim_id": "trainer0-step12", "limit": 32, "lease_seconds": 600, "wait": 5})
ACK_BODY = _body({"properties": {"sessions": _SESSIONS,
                                 "step": {"type": ["integer", "null"], "minimum": 0}}},
                 {"step": 12})
RELEASE_BODY = _body({"properties": {"sessions": _SESSIONS}}, {})


@router.get("")
async def list_groups(svc: ServicesDep) -> JSONText:
    return JSONText({"groups": await svc.consumers.list_groups()})


@router.put("/{group}", status_code=201, openapi_extra=GROUP_BODY)
async def put_group(group: str, svc: ServicesDep, body: BodyDep) -> JSONText:
    doc, created = await svc.consumers.put_group(group, body)
    return JSONText(doc, status_code=201 if created else 200)


@router.get("/{group}")
async def get_group(group: str, svc: ServicesDep) -> JSONText:
    return JSONText(await svc.consumers.group(group))


@router.post("/{group}/claims", status_code=201, openapi_extra=CLAIM_BODY)
async def claim(request: Request, group: str, svc: ServicesDep, body: BodyDep) -> JSONText:
    # A claim waiting at shutdown is answered at once, as the feed's long poll is.
    claimed = await svc.consumers.claim(group, body, server_closing(request))
    return JSONText(claimed.body, status_code=201 if claimed.created else 200)


@router.post("/{group}/claims/{claim_id}/ack", openapi_extra=ACK_BODY)
async def ack(group: str, claim_id: str, svc: ServicesDep, body: BodyDep) -> JSONText:
    return JSONText(await svc.consumers.ack(group, claim_id, body))


@router.post("/{group}/claims/{claim_id}/release", openapi_extra=RELEASE_BODY)
async def release(group: str, claim_id: str, svc: ServicesDep, body: BodyDep) -> JSONText:
    return JSONText(await svc.consumers.release(group, claim_id, body))


@router.get("/{group}/acks")
async def acks(
    group: str,
    svc: ServicesDep,
    # Range-checked by the store: pydantic's bounds would also run on a blank (None).
    step: Annotated[int | None, Blank, Query(description="training step >= 0")] = None,
    after: OptStr = None,
    limit: OptLimit = None,
) -> JSONText:
    return JSONText(await svc.consumers.acks(group, parse_step_filter(step), after,
                                             ACKS_PAGE.parse(limit)))
