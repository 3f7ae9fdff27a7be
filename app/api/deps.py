"""Dependencies shared by the routers: the store services and the request body.

Owns which wire a body is read as (its Content-Type: JSON everywhere,
MessagePack too for turns; anything else is 415) and reading it into one
buffer. The decoding rules themselves are the domain's (`jsonio`, `msgpackio`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BeforeValidator

from app.api.http_errors import UnsupportedMediaType
from app.domain import jsonio, msgpackio
from app.services import Services

JSON = "application/json"


def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


def media_type(request: Request) -> str | None:
    """The body's media type, lower-cased, parameters dropped; None when not sent."""
    header = request.headers.get("content-type")
    if header is None or not header.strip():
        return None
    return header.split(";", 1)[0].strip().lower()


def _unsupported(found: str, accepted: tuple[str, ...]) -> UnsupportedMediaType:
    return UnsupportedMediaType(f"this route does not read {found} bodies",
                                field="content-type", expected=" | ".join(accepted),
                                actual=found[:80])


async def read_body(request: Request) -> bytes | bytearray:
    """The whole body in one buffer, without keeping a second copy.

    With a Content-Length the chunks are written straight into a buffer of that
    size (Starlette's `request.body()` keeps the chunk list and their join, and
    caches the result on the request for its lifetime). The size limit was
    enforced before any of this by the `BodyLimit` middleware (and the token by
    `BearerAuth`); the buffer is allocated only once the first bytes arrive.
    """
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        return await request.body()
    buf = bytearray()
    view = memoryview(buf)
    filled = 0
    async for chunk in request.stream():
        if not buf and chunk:
            view.release()
            buf = bytearray(int(declared))
            view = memoryview(buf)
        end = filled + len(chunk)
        if end > len(buf):
            # More than declared (the HTTP server should not let it through): grow.
            view.release()
            buf.extend(bytes(end - len(buf)))
            view = memoryview(buf)
        view[filled:end] = chunk
        filled = end
    view.release()
    if filled < len(buf):
        del buf[filled:]
    return buf


async def json_body(request: Request) -> Any:
    """The request body parsed strictly (we validate it in the domain, not with models).

    JSON only: no Content-Type or `application/json` (any parameters); else 415.
    """
    kind = media_type(request)
    if kind is not None and kind != JSON:
        raise _unsupported(kind, (JSON,))
    raw = await read_body(request)
    if not raw or raw.isspace():  # (`strip()` would copy a 100 MB body)
        return {}
    return await _decode(request, jsonio.loads, raw)


async def _decode(request: Request, decode: Callable[[Any], Any], raw: bytes | bytearray) -> Any:
    """A large body is decoded on a worker thread, so it never stalls the event loop."""
    uploads: Uploads | None = getattr(request.app.state, "uploads", None)
    if uploads is not None and len(raw) > uploads.threshold:
        return await run_in_threadpool(decode, raw)
    return decode(raw)


async def turn_body(request: Request) -> Any:
    """A turn body: JSON as `json_body`, or MessagePack (docs/ingest.md); else 415."""
    kind = media_type(request)
    if kind in msgpackio.MEDIA_TYPES:
        raw = await read_body(request)
        return await _decode(request, msgpackio.loads, raw)
    if kind is not None and kind != JSON:
        raise _unsupported(kind, (JSON, *sorted(msgpackio.MEDIA_TYPES)))
    return await json_body(request)


def wants_msgpack(request: Request) -> bool:
    """`Accept` names a MessagePack type (with a non-zero q) — else the answer is JSON."""
    return accepts(request.headers.get("accept"), msgpackio.MEDIA_TYPES)


def accepts(accept: str | None, kinds: frozenset[str]) -> bool:
    """`accept` (an Accept header) names one of `kinds` with a non-zero q."""
    for item in (accept or "").split(","):
        kind, *params = item.split(";")
        if kind.strip().lower() not in kinds:
            continue
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False


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


# `?status=&after=&limit=` (the contract's own template) means "not given".
Blank = BeforeValidator(_blank_is_absent)
OptStr = Annotated[str | None, Blank, Query()]
OptLimit = Annotated[int | None, Blank, Query(description="page size (clamped to the maximum)")]
