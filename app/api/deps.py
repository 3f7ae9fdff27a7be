"""Dependencies shared by the routers: the store services and the raw JSON body."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Query, Request
from pydantic import BeforeValidator

from app.domain import jsonio
from app.services import Services


def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


async def json_body(request: Request) -> Any:
    """The request body parsed strictly (we validate it in the domain, not with models)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    return jsonio.loads(raw)


ServicesDep = Annotated[Services, Depends(services)]
BodyDep = Annotated[Any, Depends(json_body)]


def _blank_is_absent(value: Any) -> Any:
    return None if value == "" else value


# `?status=&after=&limit=` means "not given" (docs/api.md §0.1).
Blank = BeforeValidator(_blank_is_absent)
OptStr = Annotated[str | None, Blank, Query()]
OptLimit = Annotated[int | None, Blank, Query(description="page size (clamped to the maximum)")]
