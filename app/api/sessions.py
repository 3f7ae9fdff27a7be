"""`/v1/sessions`: open, append turns, read trees, events and resume state."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from app.api.deps import Blank, BodyDep, OptLimit, OptStr, ServicesDep, turn_body, wants_msgpack
from app.api.docs import OPEN_BODY, TURN_BODY
from app.api.problems import JSONText
from app.api.telemetry import turn_appended, turn_rejected
from app.domain import msgpackio
from app.domain.errors import DomainError

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
LIST_PARAMS = frozenset({"status", "after", "limit"})


def label_filters(request: Request, known: frozenset[str]) -> dict[str, str]:
    return {k: v for k, v in request.query_params.items() if k not in known}


@router.post("", status_code=201, openapi_extra=OPEN_BODY)
async def open_session(svc: ServicesDep, body: BodyDep) -> JSONText:
    spec, created = await svc.writer.open_session(body)
    summary = await svc.reader.summary(spec.session_id)
    svc.reader.notify()
    return JSONText(summary, status_code=201 if created else 200)


@router.get("")
async def list_sessions(
    request: Request,
    svc: ServicesDep,
    status: OptStr = None,
    after: OptStr = None,
    limit: OptLimit = None,
) -> JSONText:
    page = await svc.reader.list_sessions(status, after, limit,
                                          label_filters(request, LIST_PARAMS))
    return JSONText(page)


@router.get("/{session_id}")
async def get_session(session_id: str, svc: ServicesDep) -> JSONText:
    return JSONText(await svc.reader.session(session_id))


@router.post("/{session_id}/turns", status_code=201, openapi_extra=TURN_BODY)
async def append_turn(session_id: str, svc: ServicesDep, request: Request) -> JSONText:
    """Append one turn. The body is JSON, or MessagePack (`application/msgpack`,
    `application/vnd.msgpack`, `application/x-msgpack`) with `routed_experts` as a bin
    of raw little-endian int32 (docs/ingest.md); any other content type is 415."""
    started, body = time.perf_counter(), None
    try:
        body = await turn_body(request)
        written = await svc.writer.append_turn(session_id, body)
    except DomainError as exc:
        turn_rejected(svc.metrics, session_id, body, exc, started)
        raise
    turn_appended(svc.metrics, session_id, body, written, started)
    if written.created:
        svc.reader.notify()
    return JSONText(written.body, status_code=201 if written.created else 200)


@router.get("/{session_id}/events",
            responses={200: {"content": {"application/json": {}, msgpackio.MEDIA_TYPE: {}}}})
async def session_events(
    session_id: str,
    svc: ServicesDep,
    request: Request,
    after: Annotated[int | None, Blank, Query(ge=0, lt=2**63)] = None,
    limit: OptLimit = None,
    include_r3: bool = True,
) -> Response:
    """`Accept: application/msgpack` answers the same page as MessagePack, R3 as bin."""
    if wants_msgpack(request):
        page = await svc.reader.session_events(session_id, after, limit, include_r3,
                                               r3_raw=True)
        try:
            return Response(msgpackio.dumps(page), media_type=msgpackio.MEDIA_TYPE)
        except UnicodeEncodeError:
            pass  # a JSON-appended lone surrogate has no UTF-8 form: answer JSON, as allowed
    return JSONText(await svc.reader.session_events(session_id, after, limit, include_r3))


@router.get("/{session_id}/state")
async def session_state(
    session_id: str, svc: ServicesDep, leaf: Annotated[int | None, Query(ge=0, lt=2**31)] = None
) -> JSONText:
    return JSONText(await svc.reader.state(session_id, leaf))
