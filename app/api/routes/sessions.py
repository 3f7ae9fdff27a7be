"""`/v1/sessions`: open, append turns, read trees, events and resume state."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from pydantic import Field

from app.api.deps import (
    Blank,
    BodyDep,
    OptLimit,
    OptStr,
    ServicesDep,
    Uploads,
    decode_turn,
    media_type,
    read_body,
    turn_decoder,
    wants_msgpack,
)
from app.api.problems import JSONText
from app.api.routes.append_log import turn_appended, turn_rejected
from app.api.routes.docs import OPEN_BODY, TURN_BODY
from app.domain.body.labels import LabelFilters, parse_query_label_filters
from app.domain.body.queries import EVENTS_PAGE, SESSIONS_PAGE, parse_status
from app.domain.errors import DomainError
from app.domain.wire import msgpackio
from app.store.read.reader import EventsPage

# The bounds sit on the integer, not on the optional: a blank `?after=` becomes None
# first (`Blank`) and a bound on `int | None` cannot apply to None (that was a 500).
Position = Annotated[int, Field(ge=0, lt=2**63)]
Seq = Annotated[int, Field(ge=0, lt=2**31)]
router = APIRouter(prefix="/v1/sessions", tags=["sessions"], default_response_class=JSONText)
LIST_PARAMS = frozenset({"status", "after", "limit"})
JSON = "application/json"
EVENTS_BATCH = 32  # events rendered per worker-thread call (and the largest unstreamed page)


def label_filters(request: Request, known: frozenset[str]) -> LabelFilters:
    """Every query parameter but the endpoint's own is a label filter (none twice)."""
    return parse_query_label_filters(request.query_params.multi_items(), known)


@router.post("", status_code=201, openapi_extra=OPEN_BODY)
async def open_session(svc: ServicesDep, body: BodyDep) -> JSONText:
    opened = await svc.writer.open(body)
    summary = opened.summary
    if summary is None:  # a repeat: the session as stored (it may have moved on)
        summary = await svc.reader.summary(opened.definition.session_id)
    svc.reader.notify()
    return JSONText(summary, status_code=201 if opened.created else 200)


@router.get("")
async def list_sessions(
    request: Request,
    svc: ServicesDep,
    status: OptStr = None,
    after: OptStr = None,
    limit: OptLimit = None,
) -> JSONText:
    page = await svc.reader.list_sessions(parse_status(status), after,
                                          SESSIONS_PAGE.parse(limit),
                                          label_filters(request, LIST_PARAMS))
    return JSONText(page)


@router.get("/{session_id}")
async def get_session(session_id: str, svc: ServicesDep) -> JSONText:
    return JSONText(await svc.reader.session(session_id))


@router.post("/{session_id}/turns", status_code=201, openapi_extra=TURN_BODY)
async def append_turn(session_id: str, svc: ServicesDep, request: Request) -> JSONText:
    """Append one turn. The body is JSON, or MessagePack (`application/msgpack`,
    `application/vnd.msgpack`, `application/x-msgpack`) with `routed_experts` as a bin
    of raw little-endian int32, or turnlog's narrowed MessagePack
    (`application/vnd.turnlog.narrow-r3+msgpack`: the bin a width byte and the values
    at that width; docs/ingest.md); any other content type is 415."""
    # `turnlog serve` answers these POSTs on the bare route `app.api.routes.hotpath.AppendRoute`
    # (same steps, no FastAPI objects); this one documents the route and serves an app
    # built without it.
    started, body = time.perf_counter(), None
    uploads: Uploads = request.app.state.uploads
    try:
        # A large turn waits for one of a few upload slots; a very large one is then
        # decoded, validated and encoded on worker threads (app.api.deps.Uploads).
        async with uploads.slot(request):
            decode = turn_decoder(media_type(request))  # 415 before the body is read
            raw = await read_body(request)
            offload = uploads.is_large(request) and uploads.offloads(raw, decode)
            body = await decode_turn(decode, raw, uploads, offload)
            del raw  # only the decoded body's views (an R3 bin in place) keep it now
            written = await svc.writer.append_turn(session_id, body, offload=offload)
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
    after: Annotated[Position | None, Blank, Query()] = None,
    limit: OptLimit = None,
    include_r3: bool = True,
) -> Response:
    """`Accept: application/msgpack` answers the same page as MessagePack, R3 as bin."""
    if wants_msgpack(request):
        events = await svc.reader.session_events(session_id, after, EVENTS_PAGE.parse(limit),
                                                 include_r3, r3_raw=True)
        try:
            return Response(await run_in_threadpool(msgpackio.dumps, events),
                            media_type=msgpackio.MEDIA_TYPE)
        except (UnicodeEncodeError, OverflowError):
            # A JSON-appended lone surrogate has no UTF-8 form, an integer beyond 64 bits
            # (a record's or a reward's) no MessagePack form: answer JSON, as allowed.
            pass
    page = await svc.reader.session_events_page(
        session_id, after, EVENTS_PAGE.parse(limit), include_r3)
    if len(page) <= EVENTS_BATCH:
        body = await run_in_threadpool(page.encoded, 0, len(page))
        return Response(b"[" + body + b"]", media_type=JSON)
    return StreamingResponse(_stream(page), media_type=JSON)


async def _stream(page: EventsPage) -> AsyncIterator[bytes]:
    """The page as a JSON array, rendered a batch at a time on a worker thread: the
    event loop stays free and memory holds one batch, not the whole reply."""
    yield b"["
    for start in range(0, len(page), EVENTS_BATCH):
        chunk = await run_in_threadpool(page.encoded, start, start + EVENTS_BATCH)
        yield (b"," + chunk) if start else chunk
    yield b"]"


@router.get("/{session_id}/state")
async def session_state(
    session_id: str, svc: ServicesDep, leaf: Annotated[Seq | None, Blank, Query()] = None
) -> JSONText:
    return JSONText(await svc.reader.state(session_id, leaf))
