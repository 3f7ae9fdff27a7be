"""Dependencies shared by the routers: the store services and the raw JSON body."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Query, Request
from pydantic import BeforeValidator

from app.domain import jsonio
from app.metrics import ApiMetrics
from app.settings import Settings
from app.store.analytics import Analytics
from app.store.db import Database
from app.store.gates import Gates
from app.store.history import History
from app.store.loader import StateCache
from app.store.reads import Reader
from app.store.samples import SampleReader
from app.store.writes import Writer


@dataclass
class Services:
    settings: Settings
    db: Database
    cache: StateCache
    writer: Writer
    reader: Reader
    samples: SampleReader
    analytics: Analytics
    history: History
    gates: Gates
    metrics: ApiMetrics = field(default_factory=ApiMetrics)


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


# `?status=&after=&limit=` (the contract's own template) means "not given".
Blank = BeforeValidator(_blank_is_absent)
OptStr = Annotated[str | None, Blank, Query()]
OptLimit = Annotated[int | None, Blank, Query(description="page size (clamped to the maximum)")]
