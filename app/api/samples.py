"""`/v1/sessions/{sid}/close` and the samples of closed sessions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import StreamingResponse

from app.api.deps import BodyDep, ServicesDep
from app.api.docs import CLOSE_BODY
from app.api.problems import JSONText

router = APIRouter(prefix="/v1/sessions", tags=["samples"])


@router.post("/{session_id}/close", openapi_extra=CLOSE_BODY)
async def close_session(session_id: str, svc: ServicesDep, body: BodyDep) -> JSONText:
    if await svc.writer.close_session(session_id, body):
        svc.reader.notify()
    return JSONText(await svc.samples.samples(session_id, arrays=False))


@router.get("/{session_id}/samples")
async def get_samples(session_id: str, svc: ServicesDep, arrays: bool = True) -> JSONText:
    return JSONText(await svc.samples.samples(session_id, arrays=arrays))


@router.get("/{session_id}/samples/{index}/r3",
            responses={200: {"content": {"application/x-npy": {}}}})
async def get_sample_r3(
    session_id: str, svc: ServicesDep, index: Annotated[int, Path(ge=0)]
) -> StreamingResponse:
    plan = await svc.samples.r3_plan(session_id, index)
    patches = await svc.samples.read_patches(session_id, plan)
    return StreamingResponse(
        svc.samples.stream(plan, patches),
        media_type="application/x-npy",
        headers={"Content-Length": str(svc.samples.content_length(plan))},
    )
