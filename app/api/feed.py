"""`/v1/events`: the global feed in commit order, behind the visibility fence."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.api.deps import ServicesDep
from app.api.problems import JSONText

router = APIRouter(prefix="/v1", tags=["feed"])


@router.get("/events")
async def feed(
    svc: ServicesDep,
    after: str | None = None,
    limit: Annotated[int | None, Query()] = None,
    wait: Annotated[float | None, Query()] = None,
) -> JSONText:
    return JSONText(await svc.reader.feed(after, limit, wait))
