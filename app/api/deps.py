"""Dependencies shared by the routers: the store services and the raw JSON body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BeforeValidator

from app.domain import jsonio
from app.services import Services


def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


async def json_body(request: Request) -> Any:
    """The request body parsed strictly (we validate it in the domain, not with models).

    A large body is decoded on a worker thread, so it never stalls the event loop.
    """
    raw = await request.body()
    if not raw.strip():
        return {}
    uploads: Uploads | None = getattr(request.app.state, "uploads", None)
    if uploads is not None and len(raw) > uploads.threshold:
        return await run_in_threadpool(jsonio.loads, raw)
    return jsonio.loads(raw)


class Uploads:
    """Large request bodies: at most `slots` at a time are read and processed.

    Each large body costs memory several times its size while it is decoded and
    validated; the cap bounds that, and its processing goes to worker threads
    so small requests keep their latency. "Large" is judged by the declared
    `Content-Length` (a chunked body is judged once read, by `json_body`).
    """

    def __init__(self, threshold: int, slots: int) -> None:
        self.threshold = threshold
        self._slots = asyncio.Semaphore(slots)

    def is_large(self, request: Request) -> bool:
        declared = request.headers.get("content-length", "")
        return declared.isdigit() and int(declared) > self.threshold

    @asynccontextmanager
    async def slot(self, request: Request) -> AsyncIterator[bool]:
        """Hold an upload slot while a large body is handled; yields whether it is large."""
        if not self.is_large(request):
            yield False
            return
        async with self._slots:
            yield True


ServicesDep = Annotated[Services, Depends(services)]
BodyDep = Annotated[Any, Depends(json_body)]


def _blank_is_absent(value: Any) -> Any:
    return None if value == "" else value


# `?status=&after=&limit=` means "not given" (docs/api.md §0.1).
Blank = BeforeValidator(_blank_is_absent)
OptStr = Annotated[str | None, Blank, Query()]
OptLimit = Annotated[int | None, Blank, Query(description="page size (clamped to the maximum)")]
