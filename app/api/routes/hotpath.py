"""`POST /v1/sessions/{session_id}/turns` as a bare ASGI route: the append's hot path.

Every turn of a fleet comes through here, so the route skips what it does not
need: no FastAPI request or response objects, no dependency solving, no
exit stack. The body is received from the ASGI `receive` straight into one
buffer of its declared size and decoded once (`app.api.deps`); a large body of a
session whose state is cached is decoded and validated in one step — on a
worker thread when `Uploads.offloads` says so, else on the loop
(`Writer.append_parsed` takes it from there); the reply is two ASGI messages.
Everything that applies to every route still applies: it sits in the same
router behind the same middleware (metrics, header
bounds, loopback, authorization, body size and time limits), and an error
raised here propagates to the same exception handlers (problem+json, 503 with
Retry-After, 499 for a client gone). The FastAPI route of the same path
(`app.api.routes.sessions.append_turn`) stays registered for the OpenAPI document
and for other methods (405); this route answers the POSTs first.

Refuses: any rule of its own (validation, idempotency and the append are the
domain's and the store's: `services.writer.append_turn`, which the gateway
calls in-process too).
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Callable
from typing import Any

from fastapi.concurrency import run_in_threadpool
from starlette._utils import get_route_path
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match, NoMatchFound
from starlette.types import Receive, Scope, Send

from app.api.deps import (
    BodyBuffer,
    Pace,
    Uploads,
    blank_json,
    declared_length,
    decode_turn,
    turn_decoder,
)
from app.api.middleware.limits import body_silent
from app.api.middleware.serving import DirectBody
from app.api.routes.append_log import turn_appended, turn_rejected
from app.asgi_extensions import DIRECT_BODY
from app.domain.body.session import SessionDefinition
from app.domain.body.turn import TurnBody
from app.domain.errors import DomainError
from app.domain.log.events import PreparedTurn
from app.domain.wire import jsonio, msgpackio
from app.domain.wire.media import media_type_of
from app.services import Services
from app.store.append.writes import parse_prepared

PATH = "/v1/sessions/{session_id}/turns"
# Starlette's `{name}` parameter: one path segment.
_PATTERN = re.compile(r"/v1/sessions/([^/]+)/turns")
_JSON_HEADER = (b"content-type", b"application/json")


async def receive_body(receive: Receive, declared: int | None,
                       uploads: Uploads | None = None, direct: DirectBody | None = None,
                       idle: float | None = None) -> bytearray:
    """The whole body from ASGI messages, into one buffer (`BodyBuffer`); with
    `uploads` at the minimum pace every body keeps (`Pace`):
    one timeout scope for the body, its deadline moved as bytes arrive (not a
    scope per read: a 3 MB turn arrives in ~14–50). With `direct` (the server's
    `DirectBody`) and a declared length, the rest after the first message is read
    straight into the buffer, `idle` seconds without a byte a 408 as the body
    limit's read timeout has it."""
    buffer = BodyBuffer(declared)
    if uploads is None or not uploads.pace:
        return await _receive_into(buffer, receive, direct=direct, idle=idle)
    pace = Pace(uploads)
    try:
        async with asyncio.timeout_at(pace.deadline()) as scope:
            return await _receive_into(buffer, receive, pace, scope, direct, idle)
    except TimeoutError:
        raise pace.too_slow() from None


async def _receive_into(buffer: BodyBuffer, receive: Receive, pace: Pace | None = None,
                        scope: asyncio.Timeout | None = None, direct: DirectBody | None = None,
                        idle: float | None = None) -> bytearray:
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            buffer.add(chunk)
            if not message.get("more_body", False):
                return buffer.result()
            if pace is not None and scope is not None:
                pace.seen += len(chunk)
                scope.reschedule(pace.deadline())
            if direct is not None and buffer.declared is not None \
                    and await _read_rest(direct, buffer, pace, scope, idle):
                return buffer.result()
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()


async def _read_rest(direct: DirectBody, buffer: BodyBuffer, pace: Pace | None,
                     outer: asyncio.Timeout | None, idle: float | None) -> bool:
    """`DirectBody.read_rest` within the bounds the ASGI reads have: a byte at least
    every `idle` seconds (else 408, as `BodyLimit` says it) and, for an upload-slot
    holder, the minimum pace (`pace`, whose `outer` scope moves with it)."""
    assert buffer.declared is not None
    loop = asyncio.get_running_loop()

    def due() -> float | None:
        deadlines = [loop.time() + idle] if idle is not None else []
        if pace is not None:
            deadlines.append(pace.deadline())
        return min(deadlines, default=None)

    scope = asyncio.timeout_at(due())

    def progress(size: int) -> None:
        # From the reader's callback: a scope that has fired (its task not yet told)
        # keeps its verdict; rescheduling it would raise in the connection's callback.
        if pace is not None:
            pace.seen += size
            if outer is not None and not outer.expired():
                outer.reschedule(pace.deadline())
        if not scope.expired():
            scope.reschedule(due())

    try:
        async with scope:
            return await direct.read_rest(buffer, buffer.declared, progress)
    except TimeoutError:
        if pace is not None and loop.time() >= pace.deadline():
            raise pace.too_slow() from None
        raise body_silent(idle or 0.0, buffer.filled) from None


def _decode_and_parse(
    decode: Callable[[Any, int], Any], raw: bytearray, max_values: int,
    definition: SessionDefinition,
) -> tuple[Any, tuple[TurnBody, PreparedTurn] | DomainError]:
    """The decoded body (as `decode_turn`) and the turn it validates into with its
    encoding prepared (`parse_prepared`), or the validation's refusal (the body is
    logged with it). A decoding fault raises."""
    value = {} if blank_json(decode, raw) else decode(raw, max_values)
    try:
        return value, parse_prepared(value, definition)
    except DomainError as exc:
        return value, exc


class AppendRoute(BaseRoute):
    """Matches `POST /v1/sessions/{session_id}/turns` only; everything else falls through."""

    path = PATH  # the route template the metrics label requests with
    path_format = PATH

    def __init__(self, services: Services, uploads: Uploads) -> None:
        self.services = services
        self.uploads = uploads
        # The body limit's read timeout (`BodyLimit`), kept by a body read directly too.
        self.body_timeout = services.settings.limits.body_timeout_s

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http" or scope["method"] != "POST":
            return Match.NONE, {}
        found = _PATTERN.fullmatch(get_route_path(scope))
        if found is None:
            return Match.NONE, {}
        params = {**scope.get("path_params", {}), "session_id": found[1]}
        return Match.FULL, {"path_params": params, "route": self, "endpoint": self.handle}

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        raise NoMatchFound(name, path_params)  # never a target of `url_for`

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        svc = self.services
        session_id = scope["path_params"]["session_id"]
        content_type = content_length = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-type" and content_type is None:
                content_type = value.decode("latin-1")
            elif name == b"content-length" and content_length is None:
                content_length = value
            elif name == b"transfer-encoding":
                chunked = True
        declared = declared_length(content_length)
        started, body = time.perf_counter(), None
        try:
            # A large turn waits for one of a few upload slots; a very large one is
            # then decoded, validated and encoded on worker threads (app.api.deps.Uploads).
            async with self.uploads.slot_for(declared, chunked) as large:
                decode = turn_decoder(media_type_of(content_type))
                raw = await receive_body(
                    receive, declared, self.uploads,
                    scope.get("extensions", {}).get(DIRECT_BODY), self.body_timeout)
                if large and decode in msgpackio.DECODERS and len(raw) <= self.uploads.offload:
                    # One typed pass serves the offload decision and the decode (a
                    # body above the offload size goes to a thread, which reads it).
                    found = msgpackio.layout(raw)
                    offload = self.uploads.offloads(raw, decode, found)
                    decode = functools.partial(decode, found=found)
                else:
                    offload = large and self.uploads.offloads(raw, decode)
                definition = svc.writer.cached_definition(session_id) if large else None
                if definition is None:
                    body = await decode_turn(decode, raw, self.uploads, offload)
                    del raw  # only the decoded body's views (an R3 bin in place) keep it now
                    written = await svc.writer.append_turn(session_id, body, offload=offload)
                else:
                    # The session is known: decoding and validating are one step (one
                    # worker-thread trip when offloaded: each costs the loop ~0.1 ms),
                    # the faults found in the same order.
                    args = (decode, raw, self.uploads.max_values, definition)
                    body, parsed = (await run_in_threadpool(_decode_and_parse, *args)
                                    if offload else _decode_and_parse(*args))
                    del raw, args
                    if isinstance(parsed, DomainError):
                        raise parsed
                    turn, prepared = parsed
                    written = await svc.writer.append_parsed(session_id, definition, turn,
                                                             offload, prepared)
        except DomainError as exc:
            turn_rejected(svc.metrics, session_id, body, exc, started)
            raise
        turn_appended(svc.metrics, session_id, body, written, started)
        if written.created:
            svc.reader.notify()
        reply = jsonio.dumps_bytes(written.body)
        await send({"type": "http.response.start", "status": 201 if written.created else 200,
                    "headers": [(b"content-length", str(len(reply)).encode()), _JSON_HEADER]})
        await send({"type": "http.response.body", "body": reply})
