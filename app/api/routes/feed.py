"""`/v1/events`: the global feed in commit order, behind the visibility fence."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from app.api.deps import Blank, OptLimit, OptStr, ServicesDep, server_closing
from app.api.problems import JSONText
from app.domain.body.queries import FEED_PAGE, parse_wait

router = APIRouter(prefix="/v1", tags=["feed"], default_response_class=JSONText)


@router.get("/events")
async def feed(
    request: Request,
    svc: ServicesDep,
    after: OptStr = None,
    limit: OptLimit = None,
    wait: Annotated[float | None, Blank, Query(
        description="long-poll seconds (clamped to 30)")] = None,
) -> JSONText:
    # A long poll in progress when the server shuts down is answered at once (its page
    # as it stands) rather than holding the shutdown for the rest of its wait.
    return JSONText(await svc.reader.feed(after, FEED_PAGE.parse(limit), parse_wait(wait),
                                          server_closing(request)))
