"""Dependencies shared by the routers: the store services and the request body.

Owns which wire a body is read as (its Content-Type: JSON everywhere,
MessagePack too for turns; anything else is 415) and reading it into one
buffer. The decoding rules themselves are the domain's (`jsonio`, `msgpackio`, `r3text`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BeforeValidator

from app.allocator import unfilled_bytearray
from app.api.http_errors import Overloaded, RequestTimeout
from app.asgi_extensions import SERVER_CLOSING
from app.domain.body.pace import MinPace
from app.domain.errors import UnsupportedMediaType
from app.domain.wire import jsonio, msgpackio, r3text
from app.domain.wire.media import JSON, media_type_of
from app.domain.wire.width import MAX_VALUES
from app.services import Services

T = TypeVar("T")


def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


def media_type(request: Request) -> str | None:
    """The body's media type, lower-cased, parameters dropped; None when not sent."""
    return media_type_of(request.headers.get("content-type"))


def _unsupported(found: str, accepted: tuple[str, ...]) -> UnsupportedMediaType:
    return UnsupportedMediaType(f"this route does not read {found} bodies",
                                field="content-type", expected=" | ".join(accepted),
                                actual=found[:80])


class BodyBuffer:
    """A body written chunk by chunk into one buffer of its declared size.

    The buffer is allocated only once the first bytes arrive (so a refused or
    abandoned request never costs its declared size), not zeroed (`result` cuts
    it to what was written); without a declared size the chunks are appended to
    a growing buffer.
    """

    def __init__(self, declared: int | None) -> None:
        self.declared = declared
        self.buf = bytearray()
        self.view = memoryview(self.buf)
        self.filled = 0

    def add(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self.declared is None:
            self.view.release()
            self.buf += chunk
            self.view = memoryview(self.buf)
            self.filled = len(self.buf)
            return
        if not self.buf:
            self.view.release()
            self.buf = unfilled_bytearray(self.declared)
            self.view = memoryview(self.buf)
        end = self.filled + len(chunk)
        if end > len(self.buf):
            # More than declared (the HTTP server should not let it through): grow.
            self.view.release()
            self.buf.extend(bytes(end - len(self.buf)))
            self.view = memoryview(self.buf)
        self.view[self.filled:end] = chunk
        self.filled = end

    def window(self) -> memoryview:
        """Where the next bytes go, to the declared size (allocated now if not yet): for
        a reader that writes into the buffer itself, then calls `advance`."""
        assert self.declared is not None
        if not self.buf:
            self.view.release()
            self.buf = unfilled_bytearray(self.declared)
            self.view = memoryview(self.buf)
        return self.view[self.filled:]

    def advance(self, size: int) -> None:
        self.filled += size

    def result(self) -> bytearray:
        self.view.release()
        if self.filled < len(self.buf):
            del self.buf[self.filled:]
        return self.buf


def declared_length(value: str | bytes | None) -> int | None:
    """A `Content-Length` header's value, or None when absent or not a number."""
    return int(value) if value is not None and value.isdigit() else None


async def read_body(request: Request) -> bytes | bytearray:
    """The whole body in one buffer, without keeping a second copy.

    With a Content-Length the chunks are written straight into a buffer of that
    size (Starlette's `request.body()` keeps the chunk list, their join, and
    caches the result on the request for its lifetime). The size limit was
    enforced before any of this by the `BodyLimit` middleware (and the token by
    `BearerAuth`).
    """
    declared = declared_length(request.headers.get("content-length"))
    buffer = BodyBuffer(declared)
    async for chunk in _chunks(request):
        buffer.add(chunk)
    return buffer.result()


async def _chunks(request: Request) -> AsyncIterator[bytes]:
    """The body's chunks; a large body (it holds an upload slot) at a minimum pace."""
    uploads: Uploads | None = getattr(request.app.state, "uploads", None)
    stream = request.stream()
    if uploads is None or not uploads.is_large(request):
        async for chunk in stream:
            yield chunk
        return
    async for chunk in paced(stream, uploads):
        yield chunk


async def paced(stream: AsyncIterator[bytes], uploads: Uploads) -> AsyncIterator[bytes]:
    """`stream` at the minimum pace of an upload-slot holder (`Pace`)."""
    if not uploads.pace:
        async for chunk in stream:
            yield chunk
        return
    pace = Pace(uploads)
    while True:
        try:
            chunk = await pace.read(anext(stream))
        except StopAsyncIteration:
            return
        pace.seen += len(chunk)
        yield chunk


class Pace:
    """The minimum pace of a body (an upload-slot holder's here; the hot route's and,
    through `BodyLimit`, every body's too).

    Byte n must arrive within `grace + n / min_rate` seconds of the first read
    (`MinPace`), else 408: a client that declares 50 MB and trickles 64 bytes every
    20 s (each read inside the body timeout) no longer keeps a slot for minutes.
    Each read is bounded by a timeout scope (`read`), not `wait_for`: no task per
    chunk (a 3 MB body arrives in ~50 reads); a caller that owns the read loop
    keeps one scope and moves its `deadline` instead.
    """

    def __init__(self, uploads: Uploads) -> None:
        self.loop = asyncio.get_running_loop()
        self.pace = uploads.pace
        self.start, self.seen = self.loop.time(), 0  # `seen`: bytes read so far

    def deadline(self) -> float:
        """When byte `seen + 1` is due (loop time)."""
        return self.start + self.pace.due(self.seen)

    async def read(self, pending: Awaitable[T]) -> T:
        """`pending` (the next read), if it completes in time for byte `seen + 1`."""
        try:
            async with asyncio.timeout_at(self.deadline()):
                return await pending
        except TimeoutError:
            raise self.too_slow() from None

    def too_slow(self) -> RequestTimeout:
        return self.pace.too_slow(self.seen, self.loop.time() - self.start, RequestTimeout)


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


async def _decode(request: Request, decode: Callable[[Any, int], Any],
                  raw: bytes | bytearray) -> Any:
    uploads: Uploads | None = getattr(request.app.state, "uploads", None)
    return await decode_large_off_loop(decode, raw, uploads)


async def decode_large_off_loop(decode: Callable[[Any, int], Any], raw: bytes | bytearray,
                                uploads: Uploads | None, offload: bool | None = None) -> Any:
    """A large body is decoded on a worker thread (`offload`, else above
    `TURNLOG_LARGE_BODY_BYTES`), so it never stalls the event loop for long; either
    wire refuses a body of more than `TURNLOG_MAX_BODY_VALUES` values (413)."""
    max_values = MAX_VALUES if uploads is None else uploads.max_values
    if offload is None:
        offload = uploads is not None and len(raw) > uploads.threshold
    if offload:
        return await run_in_threadpool(decode, raw, max_values)
    return decode(raw, max_values)


def turn_decoder(kind: str | None) -> Callable[[Any, int], Any]:
    """How a turn body of media type `kind` is decoded: MessagePack (plain or with the
    R3 bin narrowed) or JSON; else 415."""
    if kind in msgpackio.MEDIA_TYPES:
        return msgpackio.loads
    if kind == msgpackio.NARROW_MEDIA_TYPE:
        return msgpackio.loads_narrow
    if kind is not None and kind != JSON:
        raise _unsupported(kind, (JSON, *sorted(msgpackio.MEDIA_TYPES),
                                  msgpackio.NARROW_MEDIA_TYPE))
    return r3text.loads_turn  # jsonio.loads, the R3 text decoded from the bytes


async def decode_turn(decode: Callable[[Any, int], Any], raw: bytes | bytearray,
                      uploads: Uploads | None, offload: bool = False) -> Any:
    """A turn body decoded once (on a worker thread if `offload`: `Uploads.offloads`);
    an empty (or all-blank) JSON body reads as `{}`."""
    if blank_json(decode, raw):
        return {}
    return await decode_large_off_loop(decode, raw, uploads, offload)


def blank_json(decode: Callable[[Any, int], Any], raw: bytes | bytearray) -> bool:
    """An empty or all-blank JSON turn body, which reads as `{}` (`strip()` would copy)."""
    return decode is r3text.loads_turn and (not raw or raw.isspace())


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
    validated; the cap bounds that. "Large" is judged by the declared
    `Content-Length`; a chunked body (no length) counts as large, and a large
    body must keep arriving at `min_rate` (`_chunks`). A turn body above `offload`
    bytes, or above the threshold besides its R3 payload (`offloads`), is
    processed on worker threads, so small requests keep their latency; the
    rest on the event loop, where a few-MB turn's work costs less than the
    thread hand-offs (docs/ingest.md).
    """

    def __init__(self, threshold: int, slots: int, max_values: int = MAX_VALUES,
                 min_rate: int = 0, grace: float = 10.0,
                 offload: int | None = None, wait: float = 30.0) -> None:
        self.threshold = threshold
        # How long a large body waits for a slot before it is a 503 (`Overloaded`): the
        # slots may be held by slow uploads that keep the minimum pace for minutes.
        self.wait = wait
        # Bodies above this are decoded (and turns validated and encoded) on worker
        # threads; the rest on the event loop (None: the large-body threshold).
        self.offload = threshold if offload is None else offload
        self.max_values = max_values  # what a body may decode into (`app.domain.wire.width`)
        self.pace = MinPace(min_rate, grace)  # a slot holder's body keeps it
        self.slots = slots
        self._slots = asyncio.Semaphore(slots)

    def is_large(self, request: Request) -> bool:
        """Declared above the threshold, or of unknown length (chunked): such a body
        may be as large as the body limit, so it takes a slot before it is read."""
        return self.is_large_body(declared_length(request.headers.get("content-length")),
                                  "transfer-encoding" in request.headers)

    def is_large_body(self, declared: int | None, chunked: bool) -> bool:
        if declared is None:
            return chunked
        return declared > self.threshold

    def offloads(self, raw: bytes | bytearray, decode: Callable[[Any, int], Any],
                 found: msgpackio.Layout | None = None) -> bool:
        """Whether a turn body is worked on a worker thread: above `offload` bytes, or
        above the large-body threshold once its R3 payload (one value, cheap to
        decode) is set aside — a body of many small values costs the loop as much
        as a small body of the same many values, never more. `found`: a MessagePack
        body's layout, if read already."""
        if len(raw) > self.offload:
            return True
        if len(raw) <= self.threshold:
            return False
        payload = (found or msgpackio.layout(raw)).r3 if decode in msgpackio.DECODERS else \
            r3text.text_span(raw) if decode is r3text.loads_turn else 0
        return len(raw) - payload > self.threshold

    @asynccontextmanager
    async def slot(self, request: Request) -> AsyncIterator[bool]:
        """Hold an upload slot while a large body is handled; yields whether it is large."""
        async with self.slot_for(declared_length(request.headers.get("content-length")),
                                 "transfer-encoding" in request.headers) as large:
            yield large

    @asynccontextmanager
    async def slot_for(self, declared: int | None, chunked: bool = False
                       ) -> AsyncIterator[bool]:
        """`slot`, judged by a declared Content-Length (None: not declared) and
        whether the body is chunked."""
        if not self.is_large_body(declared, chunked):
            yield False
            return
        try:
            async with asyncio.timeout(self.wait):
                await self._slots.acquire()
        except TimeoutError:
            raise Overloaded(
                f"no upload slot came free within {self.wait:g} s: the "
                f"{self.slots} slots for bodies above {self.threshold} bytes are taken; "
                "retry shortly", field="body",
                expected=f"a free upload slot within {self.wait:g} s "
                         "(TURNLOG_MAX_LARGE_UPLOADS, TURNLOG_BODY_TIMEOUT_S)",
                actual=f"{declared} bytes" if declared is not None else "chunked") from None
        try:
            yield True
        finally:
            self._slots.release()


ServicesDep = Annotated[Services, Depends(services)]
BodyDep = Annotated[Any, Depends(json_body)]


def _blank_is_absent(value: Any) -> Any:
    return None if value == "" else value


# `?status=&after=&limit=` (the contract's own template) means "not given".
Blank = BeforeValidator(_blank_is_absent)
OptStr = Annotated[str | None, Blank, Query()]
OptLimit = Annotated[int | None, Blank, Query(description="page size (clamped to the maximum)")]


def server_closing(request: Request) -> asyncio.Event | None:
    """The server's shutdown signal (`SERVER_CLOSING`) for a long poll: set once a
    graceful shutdown begins; None from a server that offers none (a test's
    in-process transport)."""
    closing: asyncio.Event | None = request.scope.get("extensions", {}).get(SERVER_CLOSING)
    return closing
