"""`/v1/sessions/{sid}/close`, rewards recorded after it, and the samples of closed
sessions: JSON, the miles samples wire (safetensors) and R3 tensors or slices of
them as `.npy`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query
from fastapi.responses import Response, StreamingResponse

from app.api.deps import BodyDep, ServicesDep, accepts
from app.api.problems import JSONText
from app.api.routes.docs import CLOSE_BODY, REWARD_BODY
from app.domain.errors import InvalidRequest
from app.domain.projection.samples_wire import MEDIA_TYPE as SAFETENSORS

router = APIRouter(prefix="/v1/sessions", tags=["samples"], default_response_class=JSONText)
FORMATS = ("json", "safetensors")


def reply_format(fmt: str | None, accept: str | None) -> str:
    """An explicit `format` wins; else `Accept: application/x-safetensors`; else JSON."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise InvalidRequest("format must be json or safetensors", field="format",
                                 expected='"json" | "safetensors"', actual=fmt[:80])
        return fmt
    return "safetensors" if accepts(accept, frozenset({SAFETENSORS})) else "json"


@router.post("/{session_id}/close", openapi_extra=CLOSE_BODY)
async def close_session(session_id: str, svc: ServicesDep, body: BodyDep) -> JSONText:
    if await svc.writer.close_session(session_id, body):
        svc.reader.notify()
    return JSONText(await svc.samples.samples(session_id, arrays=False))


@router.post("/{session_id}/rewards", status_code=201, openapi_extra=REWARD_BODY)
async def record_reward(session_id: str, svc: ServicesDep, body: BodyDep) -> JSONText:
    """Record a reward of a closed session (the samples show the latest one);
    201 new, 200 an identical repeat of its event_id."""
    written = await svc.writer.record_reward(session_id, body)
    if written.created:
        # Feed readers, and claims of groups waiting for rewarded sessions, wake.
        svc.reader.notify()
    return JSONText(written.body, status_code=201 if written.created else 200)


@router.get("/{session_id}/samples",
            responses={200: {"content": {"application/json": {}, SAFETENSORS: {}}}})
async def get_samples(
    session_id: str,
    svc: ServicesDep,
    arrays: bool = True,
    fmt: Annotated[str | None, Query(alias="format", description="json | safetensors")] = None,
    accept: Annotated[str | None, Header()] = None,
) -> Response:
    if reply_format(fmt or None, accept) == "json":
        return JSONText(await svc.samples.samples(session_id, arrays=arrays))
    if not arrays:
        raise InvalidRequest("the safetensors reply always carries the arrays",
                             field="arrays", expected="true with format=safetensors",
                             actual=False)
    layout, patches = await svc.samples.wire(session_id)
    return StreamingResponse(
        svc.samples.stream_wire(layout, patches),
        media_type=SAFETENSORS,
        headers={"Content-Length": str(layout.content_length)},
    )


@router.get("/{session_id}/samples/{index}/r3",
            responses={200: {"content": {"application/x-npy": {}}}})
async def get_sample_r3(
    session_id: str,
    svc: ServicesDep,
    index: Annotated[int, Path(ge=0)],
    rows: Annotated[str | None, Query(description="a:b, either may be left out")] = None,
    layers: Annotated[str | None, Query(description="c:d, either may be left out")] = None,
) -> StreamingResponse:
    if rows or layers:
        plan, layer_bounds, parts = await svc.samples.r3_slice(session_id, index, rows, layers)
        return StreamingResponse(
            svc.samples.stream_slice(plan, layer_bounds, parts),
            media_type="application/x-npy",
            headers={"Content-Length": str(svc.samples.slice_length(plan, layer_bounds))},
        )
    plan = await svc.samples.r3_plan(session_id, index)
    patches = await svc.samples.read_patches(session_id, plan)
    return StreamingResponse(
        svc.samples.stream(plan, patches),
        media_type="application/x-npy",
        headers={"Content-Length": str(svc.samples.content_length(plan))},
    )
