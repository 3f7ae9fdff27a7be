"""The recording gateway's HTTP side: a bare ASGI reverse proxy in front of SGLang.

Every request is forwarded to the upstream as it came: method, raw path,
query, headers less the hop-by-hop ones and `Host` (the upstream's), plus
`X-Forwarded-For`, through one pooled aiohttp client, whose C parser reads a
4 MB reply for a fifth of httpx's CPU on the one event loop every session
shares (no decompression, no cookies, no default headers: the bytes are the
caller's and the upstream's). Passthrough requests are streamed both ways
(the request body up as it arrives, the reply back chunk by chunk, so a
100 MB reply never sits in memory). A turn that may be recorded has its
request body buffered (it must be parsed) and its reply buffered too, since
it goes back only once the turn is durable (app.gateway.recorder). The
gateway's own routes live under `/turnlog/`: health, readiness, metrics, what
it holds of a session, and the store's close and reward routes
(`/turnlog/v1/sessions/{sid}/close`, `…/rewards`), which it carries out in the
session's order behind its spooled turns (`Recorder.carry_out`).
Upstream unreachable or timed out → 502 problem+json `upstream-unavailable`.

Refuses: the rules of what is recorded (app.domain.body.gateway) and storage
(app.gateway.recorder, through app.services).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import socket
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote

import aiohttp
import anyio.to_thread
import brotli
import httpx
import structlog
import zstandard
from aiohttp.abc import AbstractStreamWriter
from yarl import URL

from app.access import (
    Forbidden,
    TokenTable,
    Unauthorized,
    allowed_names,
    authorize,
    bearer_token,
    challenge,
    foreign_origin,
    foreign_request,
    header_map,
    host_name,
    is_loopback,
    token_in_url,
)
from app.allocator import unfilled_bytearray
from app.asgi_extensions import CUT_CONNECTION
from app.domain.body.deadline import TIMEOUT_HEADER_KEY, parse_timeout
from app.domain.body.gateway import (
    CALLER_GONE,
    DEFAULT_RECORD_PATHS,
    LABELS_HEADER,
    NO_SESSION,
    NOT_TITO,
    OWN_PREFIX,
    REJECTED,
    UPSTREAM_UNAVAILABLE,
    Candidate,
    GatewayDefaults,
    Refused,
    Unrecorded,
    build_record,
    classify_reply_head,
    classify_request,
    end_to_end,
    names_session,
    open_body,
    parse_labels_header,
    parse_reply,
    turn_body,
    unrelayable_header,
)
from app.domain.body.pace import MinPace
from app.domain.body.session import validate_session_id
from app.domain.errors import (
    DomainError,
    InvalidRequest,
    TooLarge,
    UnknownSession,
    UnsupportedMediaType,
)
from app.domain.wire import jsonio
from app.domain.wire.media import JSON, coded_body, media_type_of
from app.gateway.errors import (
    CallerStalled,
    MethodNotAllowed,
    NotFound,
    SpoolFull,
    UpstreamUnavailable,
)
from app.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from app.gateway.recorder import REPEAT, SPOOL_FULL, SPOOLED, WRITTEN, Recorder
from app.gateway.spool import CLOSE, REWARD, Reservation, Spool, turn_file_bound
from app.services import Services, build_services
from app.settings import Settings
from app.settle import settle
from app.websocket import refuse_websocket

log = structlog.get_logger("turnlog.gateway")

PROBLEM = b"application/problem+json"
OWN_ROUTES = frozenset({"/turnlog/healthz", "/turnlog/readyz", "/turnlog/metrics"})
# `/turnlog/sessions/{sid}`: what the gateway holds of a session (its spooled turns).
OWN_SESSIONS = "/turnlog/sessions/"
# `POST /turnlog/v1/sessions/{sid}/close` and `…/rewards`: the store's close and reward,
# carried out in order behind the session's spooled turns (`Recorder.carry_out`).
OWN_WRITES = re.compile(r"/turnlog/v1/sessions/([^/]+)/(close|rewards)")
OWN_WRITE_KINDS = {"close": CLOSE, "rewards": REWARD}
STATUS_OF = {WRITTEN: 201, REPEAT: 200, SPOOLED: 202}
# A reply with one of these has no body (RFC 9110 §6.4.1): its Content-Length, if the
# upstream sent one, describes another reply, and uvicorn would wait for those bytes.
NO_BODY = frozenset({204, 304})
NO_CONTENT_LENGTH = frozenset({b"content-length"})
# A recorded path's request body this large is parsed on a worker thread, beside the
# upstream call (a 40k-token prompt takes ~2 ms to parse and validate).
PARSE_ASIDE_BYTES = 64 << 10
# A recorded reply's buffer is allocated by its declared length up to this; past it, it
# grows as the bytes arrive (a declared length is a claim, not bytes).
PREALLOCATE = 64 << 20
# Seconds a connection to the upstream is kept idle for the next request: below the
# 5 s after which uvicorn (SGLang's HTTP server) closes an idle one. A connection the
# upstream closes as the gateway takes it for a request fails that request (the
# closing not yet read); closed here first, it is not taken.
UPSTREAM_IDLE_S = 4.0
# Request headers never sent on: hop-by-hop ones, Host (aiohttp sets the upstream's), and
# Expect. A caller's `100-continue` is answered here (uvicorn sends the 100 when the body
# is first read); sent on, it made aiohttp hold the body back until the upstream's own
# 100, which an upstream need not send: the request then waited for ever, past
# --upstream-timeout (a tester's finding, with curl's uploads over 1 KB). Without it the
# upstream gets the body at once, as from any client that does not ask.
DROP_REQUEST = frozenset({b"host", b"expect"})


@dataclass(frozen=True)
class GatewayConfig:
    upstream: str
    database_url: str
    record_paths: tuple[str, ...] = DEFAULT_RECORD_PATHS
    session_header: str = "X-SMG-Routing-Key"
    upstream_timeout: float = 600.0
    store_timeout: float = 10.0
    defaults: GatewayDefaults = field(default_factory=GatewayDefaults)
    idle_close_seconds: float | None = None
    spool_dir: Path = Path("turnlog-spool")
    spool_max_bytes: int = 1 << 30
    max_connections: int = 1000
    # The address it listens on: on a loopback one only loopback Host names (and
    # TURNLOG_ALLOWED_HOSTS) are answered (`Gateway._refusal`). None: not checked.
    bind_host: str | None = None


class TurnNotKept(Exception):
    """A turn whose reply had begun could be neither stored nor spooled: raised to end
    the request unanswered where the server offers no cut (`CUT_CONNECTION`)."""


class ClientGone(Exception):
    """The caller went away while its request body was coming in."""


class Gateway:
    """The ASGI app: `uvicorn.run(Gateway(config, settings))`."""

    def __init__(self, config: GatewayConfig, settings: Settings,
                 spool: Spool | None = None) -> None:
        self.config = config
        self.spool = spool  # opened by the caller (the CLI reports a spool in use) or at start
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.record_paths = frozenset(config.record_paths)
        # What an auto-open adds to a spooled turn's file beyond the request and reply.
        self.default_labels_bytes = len(jsonio.dumps_bytes(config.defaults.labels))
        self.session_header = config.session_header.lower().encode("latin-1")
        # A turn (request and reply) above the store's body limit could never be stored.
        self.max_turn_bytes = settings.limits.max_body_bytes
        self.body_pace = BodyPace(settings.limits.body_timeout_s, MinPace(
            settings.limits.min_upload_rate, settings.limits.upload_grace_s))
        self.upstream = httpx.URL(config.upstream)
        # How answers and logs name it: without credentials in the URL (a 502 showed
        # `user:pass@` to any caller: a tester's finding).
        self.shown = str(self.upstream.copy_with(userinfo=b""))
        self.base_path = self.upstream.raw_path.split(b"?", 1)[0].rstrip(b"/")
        self.origin = f"{self.upstream.scheme}://{self.upstream.netloc.decode('ascii')}"
        self.client: aiohttp.ClientSession | None = None
        self.fresh_client: aiohttp.ClientSession | None = None
        self.services: Services | None = None
        self.recorder: Recorder | None = None
        self.tokens = TokenTable(settings.access.api_tokens)
        # A browser on this machine must not reach the gateway under another name (DNS
        # rebinding: a page's own host name resolved to 127.0.0.1 recorded turns with its
        # labels and read the upstream's routes) nor write from another origin (a page
        # closed sessions with an untyped body): the store's no-token guard, applied to
        # every request when the gateway listens on loopback (a tester's findings).
        bind = config.bind_host
        self.allowed = allowed_names((bind or "", *settings.access.allowed_hosts))
        self.on_loopback = bind is not None and is_loopback(host_name(bind))
        self._warming: asyncio.Task[None] | None = None

    # -- lifespan --------------------------------------------------------------------

    async def startup(self) -> None:
        self.client = self._upstream_session(aiohttp.TCPConnector(
            limit=self.config.max_connections, keepalive_timeout=UPSTREAM_IDLE_S))
        # A request sent again after a reset goes on a new connection: the other idle
        # ones to the upstream may be as stale as the one that was reset (an upstream
        # that closed them all after the same idle time).
        self.fresh_client = self._upstream_session(aiohttp.TCPConnector(
            limit=self.config.max_connections, force_close=True))
        self.services = build_services(self.settings)
        spool = self.spool
        if spool is None:
            spool = Spool(self.config.spool_dir, self.config.spool_max_bytes)
        self.recorder = Recorder(self.services, spool, self.metrics,
                                 store_timeout=self.config.store_timeout,
                                 idle_close_seconds=self.config.idle_close_seconds)
        self.recorder.start()
        await settle()  # imports the worker-thread path; freezes what exists (app.settle)
        # The store's connections, before the first turns (each would pay its connect).
        self._warming = asyncio.create_task(self.services.db.warm())
        log.info("gateway ready", upstream=self.shown,
                 record_paths=list(self.config.record_paths), spooled_turns=spool.turns,
                 spooled_writes=len(spool))

    def _upstream_session(self, connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.upstream_timeout,
                                          sock_read=self.config.upstream_timeout),
            # Byte-transparent: the reply's bytes as sent, no cookie kept from one
            # caller for the next, no header the caller did not send.
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            read_bufsize=1 << 18,
            # A reply head a direct client would read (aiohttp's defaults, 8 KB lines and
            # 128 headers, would turn a verbose upstream into a 502).
            max_line_size=1 << 16, max_field_size=1 << 16, max_headers=1024,
            request_class=_AsSent)

    async def shutdown(self) -> None:
        if self._warming is not None:
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # logged by warm
                await self._warming
        if self.recorder is not None:
            await self.recorder.stop()
            self.recorder.spool.close()
        for client in (self.client, self.fresh_client):
            if client is not None:
                await client.close()
        if self.services is not None:
            await self.services.db.dispose()

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("gateway failed to start")
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- ASGI --------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "websocket":
            await refuse_websocket(scope, receive, send, "the gateway does not proxy WebSocket "
                                   "connections; send plain HTTP requests")
            return
        if scope["type"] != "http":
            return
        # Routes are told by the path as sent (not percent-decoded), the form the
        # upstream gets: `/v1/chat%2Fcompletions` is not the recorded path.
        path = _raw_path(scope).decode("latin-1")
        refusal = self._refusal(scope, path)
        if refusal is not None:
            await _problem(send, refusal)
            return
        try:
            if path.startswith(OWN_PREFIX):
                await self._own(scope, receive, send)
            elif scope["method"] == "POST" and path in self.record_paths:
                await self._recorded_path(scope, receive, send)
            elif path in self.record_paths:
                # Only a POST is a turn: any other method is forwarded untouched and
                # counted as every other unrecorded request to a recorded path is.
                named = names_session(_header(scope, self.session_header))
                self.metrics.unrecorded.labels(NOT_TITO if named else NO_SESSION).inc()
                await self._passthrough(scope, receive, send)
            else:
                await self._passthrough(scope, receive, send)
        except ClientGone:
            log.debug("caller disconnected", path=path)
        except InvalidRequest as exc:  # raised before anything was sent
            await _problem(send, exc)

    def _refusal(self, scope: dict[str, Any], path: str) -> DomainError | None:
        """A request a browser page could have sent against the caller's will: on a
        loopback bind, a foreign `Host` or `Origin` (every route; the own writes refuse
        a body typed other than JSON besides). Elsewhere (a bind every name may reach)
        a foreign `Origin` on an own write without tokens."""
        own_write = path.startswith(OWN_PREFIX) and scope["method"] not in ("GET", "HEAD")
        headers = header_map(scope.get("headers") or [])
        if self.on_loopback:
            return foreign_request(headers, self.allowed)
        if own_write and not self.tokens:
            return foreign_origin(headers, self.allowed)
        return None

    # -- own routes ----------------------------------------------------------------------

    async def _own(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = _raw_path(scope).decode("latin-1")
        write = OWN_WRITES.fullmatch(path)
        if write is not None:
            try:
                await self._own_write(scope, receive, send, unquote(write[1]),
                                      OWN_WRITE_KINDS[write[2]])
            except (Unauthorized, Forbidden) as exc:
                await _problem(send, exc, (b"www-authenticate", challenge(exc).encode()))
            except DomainError as exc:
                await _problem(send, exc)
            return
        rest = path[len(OWN_SESSIONS):] if path.startswith(OWN_SESSIONS) else ""
        session_route = bool(rest) and "/" not in rest
        if (path in OWN_ROUTES or session_route) and scope["method"] not in ("GET", "HEAD"):
            await _not_allowed(send, MethodNotAllowed(
                f"{path} answers GET (and HEAD) only", field="method",
                expected="GET or HEAD", actual=scope["method"]), b"GET, HEAD")
        elif path == "/turnlog/healthz":
            await _send(send, 200, b"application/json", b'{"status":"ok"}')
        elif path == "/turnlog/readyz":
            assert self.recorder is not None
            ready, detail = await self.recorder.ready()
            spool = self.recorder.spool
            body = jsonio.dumps_bytes({"status": "ready" if ready else "unavailable",
                                       "detail": detail, "spooled_turns": spool.turns,
                                       "spooled_writes": len(spool)})
            await _send(send, 200 if ready else 503, b"application/json", body)
        elif path == "/turnlog/metrics":
            await _send(send, 200, CONTENT_TYPE.encode(), self.metrics.render())
        elif session_route:
            # Whether a client may close the session now without overtaking a spooled
            # turn of it (the miles hook asks before its close: docs/gateway.md).
            assert self.recorder is not None
            try:  # the id as the store takes it: no other id can have a spooled turn
                session_id = validate_session_id(unquote(rest))
            except DomainError as exc:
                await _problem(send, exc)
                return
            body = jsonio.dumps_bytes({
                "session_id": session_id,
                "spooled_turns": self.recorder.spool.count_turns(session_id),
                "spooled_writes": self.recorder.spool.count_writes(session_id)})
            await _send(send, 200, b"application/json", body)
        else:
            await _problem(send, NotFound(
                f"no gateway route {path} (its routes: /turnlog/healthz, /turnlog/readyz, "
                "/turnlog/metrics, /turnlog/sessions/{session_id}, "
                "/turnlog/v1/sessions/{session_id}/close and /rewards)"))

    async def _own_write(self, scope: dict[str, Any], receive: Any, send: Any,
                         session_id: str, kind: str) -> None:
        """A close or a reward for the store, carried out behind the session's spooled
        turns: 201 written, 200 an identical repeat, 202 spooled; a refusal as the
        store's own (problem+json), nothing spooled (`Recorder.carry_out`). Needs a
        write token when the store has tokens (`TURNLOG_API_TOKENS`), as the store's
        route does. With `X-Turnlog-Timeout` the store is waited on for part of it
        only (then the write is spooled), unless the spool is full."""
        if scope["method"] != "POST":
            await _not_allowed(send, MethodNotAllowed(
                f"{_raw_path(scope).decode('latin-1')} answers POST only", field="method",
                expected="POST", actual=scope["method"]), b"POST")
            return
        # A token in the URL is refused, as the store refuses it (logs, proxies keep URLs).
        refusal = token_in_url(scope.get("query_string") or b"")
        if refusal is not None:
            raise refusal
        if self.tokens:
            authorize(self.tokens, "POST", bearer_token(scope["headers"]))
        if not names_session(session_id):
            raise UnknownSession(f"no session {session_id!r}: not a session id",
                                 field="session_id", expected="a session id (docs/api.md §1)",
                                 actual=session_id[:80])
        coded = coded_body(dict(scope["headers"]))
        if coded is not None:
            raise coded
        kind_of_body = media_type_of(_header(scope, b"content-type"))
        if kind_of_body not in (None, JSON):
            raise UnsupportedMediaType(f"this route does not read {kind_of_body} bodies",
                                       field="content-type", expected=JSON,
                                       actual=kind_of_body[:80])
        limit = self.settings.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:  # refused before it is read
            raise TooLarge(f"the body is larger than {limit} bytes", field="body",
                           expected=f"at most {limit} bytes", actual=f"{declared} bytes")
        read = b"" if declared == 0 else await _gather(
            _stream_body(receive, self.body_pace), limit)
        if isinstance(read, tuple):
            raise TooLarge(f"the body is larger than {limit} bytes", field="body",
                           expected=f"at most {limit} bytes", actual="larger")
        max_values = self.settings.limits.max_body_values
        body = {} if not read.strip() else jsonio.loads(read, max_values) \
            if len(read) < PARSE_ASIDE_BYTES else \
            await anyio.to_thread.run_sync(jsonio.loads, read, max_values)
        timeout = [value.decode("latin-1") for name, value in scope["headers"]
                   if name == TIMEOUT_HEADER_KEY]
        assert self.recorder is not None
        outcome = await self.recorder.carry_out(kind, session_id, body,
                                                parse_timeout(timeout) if timeout else None)
        del body  # a large close's metadata need not live while the answer is sent
        await _send(send, STATUS_OF[outcome], b"application/json", jsonio.dumps_bytes({
            "session_id": session_id, "kind": kind, "outcome": outcome,
            "spooled_writes": self.recorder.spool.count_writes(session_id)}))

    # -- forwarding ------------------------------------------------------------------------

    def _target(self, scope: dict[str, Any]) -> tuple[URL, list[tuple[bytes, bytes]]]:
        """The upstream URL and the headers to send it (InvalidRequest: not forwardable).
        The path and query go as they came, dot segments and escapes included."""
        target = _raw_path(scope)
        raw_path = self.base_path + target
        if scope.get("query_string"):
            raw_path += b"?" + scope["query_string"]
        headers = end_to_end(scope["headers"], DROP_REQUEST)
        client = scope.get("client")
        if client:
            forwarded = [value for name, value in headers if name == b"x-forwarded-for"]
            headers = [(n, v) for n, v in headers if n != b"x-forwarded-for"]
            chain = b", ".join([*forwarded, client[0].encode("latin-1")])
            headers.append((b"x-forwarded-for", chain))
        if target.startswith(b"/") and _PRINTABLE.fullmatch(raw_path):
            with contextlib.suppress(ValueError):  # yarl refuses it after all
                return URL(self.origin + raw_path.decode("ascii"), encoded=True), headers
        raise InvalidRequest("the request target cannot be forwarded", field="path",
                             expected="a URL path (from /) and query of printable ASCII",
                             actual=repr(raw_path[:80]))

    async def _passthrough(self, scope: dict[str, Any], receive: Any, send: Any,
                           body: bytes | None = None, prefix: tuple[bytes, ...] = ()) -> None:
        """Forward one request and stream its reply back as it comes; `prefix`: the
        body's first chunks, already received (the rest still comes from `receive`)."""
        upload: _Upload | None = None
        content: Any = body
        if body is None and (prefix or _has_body(scope)):
            upload = content = _Upload(receive, self.body_pace, prefix)
        try:
            response = await self._open_while_there(scope, content, receive, upload)
        except (UpstreamUnavailable, CallerStalled) as exc:
            await _problem(send, exc)
            return
        await _relay(scope, receive, send, response, upload)

    async def _recorded_path(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request_timestamp = time.time()
        session_id = _header(scope, self.session_header)
        if not names_session(session_id):
            self.metrics.unrecorded.labels(NO_SESSION).inc()
            await self._passthrough(scope, receive, send)  # streamed, never held
            return
        assert self.recorder is not None
        with self.recorder.generating(session_id):
            await self._turn(scope, receive, send, session_id, request_timestamp)

    async def _turn(self, scope: dict[str, Any], receive: Any, send: Any, session_id: str,
                    request_timestamp: float) -> None:
        """A request that may be a turn of `session_id`: forwarded, its reply recorded
        (or relayed unrecorded, counted by reason) before the caller gets it."""
        # A turn above the store's body limit could never be stored: not held either.
        declared = _content_length(scope)
        if declared is not None and declared > self.max_turn_bytes:
            self._too_large(session_id, "request", exact=declared)
            await self._passthrough(scope, receive, send)
            return
        try:
            read = await _gather(_stream_body(receive, self.body_pace), self.max_turn_bytes)
        except CallerStalled as exc:  # nothing sent up yet: the caller hears why
            log.warning("request body not received in time", session_id=session_id,
                        detail=exc.detail)
            await _problem(send, exc)
            return
        if isinstance(read, tuple):
            self._too_large(session_id, "request", at_least=sum(map(len, read)))
            await self._passthrough(scope, receive, send, prefix=read)
            return
        body = read
        # A large request is parsed on a worker thread while the upstream generates
        # its reply, not before it is sent: its parse is then off the turn's latency.
        deciding = asyncio.ensure_future(_parse_aside(session_id, body))
        try:
            response = await self._open_while_there(scope, body, receive)
        except UpstreamUnavailable as exc:
            self.metrics.unrecorded.labels(UPSTREAM_UNAVAILABLE).inc()
            await _problem(send, exc)
            return
        except ClientGone:
            self.metrics.unrecorded.labels(CALLER_GONE).inc()
            raise
        finally:
            decision = await deciding
        if isinstance(decision, Unrecorded):
            self.metrics.unrecorded.labels(decision.reason).inc()
            await _relay(scope, receive, send, response)
            return
        head = classify_reply_head(response.status, response.headers.get("content-type", ""))
        if head is not None:
            # Whatever its body, it completes no turn: relayed as it comes, not held.
            self.metrics.unrecorded.labels(head.reason).inc()
            await _relay(scope, receive, send, response)
            return
        try:
            raw = await self._read(response, self.max_turn_bytes - len(body))
        except UpstreamUnavailable as exc:
            self.metrics.unrecorded.labels(UPSTREAM_UNAVAILABLE).inc()
            await _problem(send, exc)
            return
        if isinstance(raw, tuple):  # past the bound: relayed as it comes, not held
            # The size: as declared, else more than what was read (the bound passed).
            declared_reply = response.headers.get("content-length", "")
            self._too_large(session_id, "reply", len(body),
                            exact=int(declared_reply) if declared_reply.isdigit() else None,
                            at_least=sum(map(len, raw)))
            await _relay(scope, receive, send, response, prefix=raw)
            return
        status, raw_headers = response.status, response.raw_headers
        timestamp = time.time()
        headers = _buffered_headers(raw_headers, len(raw), scope.get("http_version") == "1.0")
        text = await _decoded(raw_headers, raw, self.max_turn_bytes - len(body))
        if text is None:
            self._too_large(session_id, "decompressed reply", len(body),
                            at_least=self.max_turn_bytes - len(body) + 1)
            await _send_raw(send, status, headers, raw)
            return
        # Its R3 payload decoded once, from the bytes: never a 4 MB str.
        reply, decoded = parse_reply(status, text), len(text)
        del text
        if isinstance(reply, Unrecorded):
            self.metrics.unrecorded.labels(reply.reason).inc()
            await _send_raw(send, status, headers, raw)
            return
        refusal = reply.refusal if isinstance(reply, Refused) else decision.refusal
        if refusal is not None:
            # JSON the store cannot hold (a number past float range, too deep): a turn
            # the store would refuse, counted as its refusal is; no session is opened.
            assert self.recorder is not None
            self.recorder.verdict(decision.session_id, refusal)
            await _send_raw(send, status, headers, raw)
            return
        writing, size = time.perf_counter(), len(body) + len(raw)
        # The spool's file holds the reply decoded (a compressed one may be far larger)
        # and the labels an auto-open would give the session.
        labels = _header(scope, LABELS_HEADER.lower().encode()) or ""
        reservation = self._early_room(
            decision.session_id, len(body) + max(decoded, len(raw)) + len(labels.encode())
            + self.default_labels_bytes)
        recording = self._record(scope, decision, reply, request_timestamp, timestamp, size,
                                 reservation)
        if reservation is not None:
            await self._answer_while_recording(scope, send, decision.session_id, status,
                                               headers, raw, recording,
                                               reservation, writing, timestamp)
            return
        outcome = await recording
        self.metrics.store.labels(outcome).observe(time.perf_counter() - writing)
        if outcome == SPOOL_FULL:
            self.metrics.unrecorded.labels(SPOOL_FULL).inc()
            log.error("turn answered 503 spool-full, not stored", session_id=decision.session_id)
            await _problem(send, SpoolFull(
                "the store cannot take this turn now and the gateway's spool is full; "
                "the turn was not recorded and its reply is withheld (a retry is a new turn)"))
            return
        await _send_raw(send, status, headers, raw)
        self.metrics.added.observe(time.time() - timestamp)

    def _early_room(self, session_id: str, size: int) -> Reservation | None:
        """Room in the spool promised to a turn (its request, decoded reply and labels
        `size` bytes) whose reply may go out while it is written (`_answer_while_recording`),
        or None: when the store is failing or hanging, when the session has writes
        spooled (the turn will be spooled too, and the spool may be full), or when the
        spool has not room for the turn beside its files, the writes under way and the
        other promises — then the turn may still be answered 503 `spool-full`, so its
        reply waits for the outcome."""
        assert self.recorder is not None
        recorder, spool = self.recorder, self.recorder.spool
        if recorder.drain_failing or recorder.store_hangs() or spool.holds(session_id):
            return None
        return spool.reserve(turn_file_bound(size))

    async def _answer_while_recording(self, scope: dict[str, Any], send: Any, session_id: str,
                                      status: int,
                                      headers: list[Any], raw: bytes | bytearray,
                                      recording: Coroutine[Any, Any, str],
                                      reservation: Reservation, writing: float,
                                      timestamp: float) -> None:
        """The reply's head and the body up to its last significant byte sent while the
        turn is written (`_held_back`), the rest once it is durable (committed or
        spooled): the caller holds no complete reply before then, and the reply's ~ms
        of relaying overlap the store's write. The spool's room promised to the turn
        (`reservation`) means it can be spooled whatever comes; were it refused anyway
        (the spool's disk failing as the store does), the connection is cut before the
        rest: the caller sees a broken reply, never an answer whose turn was lost."""
        task = asyncio.ensure_future(recording)
        early = len(raw) - _held_back(raw, headers)
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            if early:
                await send({"type": "http.response.body", "body": memoryview(raw)[:early],
                            "more_body": True})
        finally:
            try:
                # The write goes on if this request is cancelled (a shutdown): it was begun.
                outcome = await asyncio.shield(task)
            finally:
                reservation.release()
        self.metrics.store.labels(outcome).observe(time.perf_counter() - writing)
        if outcome == SPOOL_FULL:
            self.metrics.unrecorded.labels(SPOOL_FULL).inc()
            log.error("turn neither stored nor spooled after its reply began; the caller's "
                      "connection is cut before the reply's last byte",
                      session_id=session_id)
            cut = scope.get("extensions", {}).get(CUT_CONNECTION)
            if cut is None:
                raise TurnNotKept("the turn was neither stored nor spooled")
            cut(scope)
            return
        await send({"type": "http.response.body", "body": memoryview(raw)[early:]})
        self.metrics.added.observe(time.time() - timestamp)

    async def _open_while_there(self, scope: dict[str, Any], body: Any, receive: Any,
                                upload: _Upload | None = None) -> aiohttp.ClientResponse:
        """`_open`, given up when the caller goes away before the reply's head is in
        (ClientGone): the upstream request is cancelled, so the upstream sees its
        connection close as it would see the caller's own hang-up (SGLang then aborts
        the generation), instead of generating for nobody until it is done or the
        upstream timeout passes. The caller's `receive` is watched once the body is
        read (`upload`: once it is sent)."""
        task = asyncio.current_task()
        assert task is not None
        gone = asyncio.Event()
        waiting = [True]

        def hung_up(_: object) -> None:
            if gone.is_set() and waiting[0]:
                task.cancel()

        watcher = asyncio.create_task(_watch_disconnect(receive, gone, upload))
        watcher.add_done_callback(hung_up)
        try:
            # Called in this task, not beside it: a reply whose head and end come
            # together is then relayed with the bytes it had (an extra turn of the loop
            # let aiohttp drop them for the error at its end).
            return await self._open(scope, body)
        except asyncio.CancelledError:
            if gone.is_set() and task.uncancel() == 0:
                raise ClientGone() from None
            raise
        finally:
            waiting[0] = False
            watcher.cancel()

    async def _open(self, scope: dict[str, Any], body: Any) -> aiohttp.ClientResponse:
        """Send a request upstream (`body`: bytes, an `_Upload` or None): its reply with
        the head read, the body not yet. UpstreamUnavailable when it does not answer;
        ClientGone when the caller went away while its body was going up."""
        assert self.client is not None and self.fresh_client is not None
        url, headers = self._target(scope)
        timeout = self.config.upstream_timeout
        # The final head is due `timeout` after the body is sent (without a body: after
        # connecting, itself bounded by `timeout`). aiohttp's read timeout does the
        # same, but an interim 1xx head stops it for good: a `102 Processing`, then
        # silence, held the caller past --upstream-timeout, and an odd `199` forever.
        head_by = asyncio.timeout(None)
        waiting = [True]  # for the head; the body may still be going up after it came
        body_sent = [False]  # this attempt's body all handed to the connection

        def sent() -> None:
            body_sent[0] = True
            if waiting[0]:
                head_by.reschedule(asyncio.get_running_loop().time() + timeout)

        try:
            async with head_by:
                try:
                    for attempt in (1, 2):
                        body_sent[0] = False
                        payload = _bounded(body, timeout, sent)
                        if payload is None:
                            head_by.reschedule(asyncio.get_running_loop().time() + 2 * timeout)
                        try:
                            client = self.client if attempt == 1 else self.fresh_client
                            response = await client.request(
                                scope["method"], url, data=payload,
                                headers=[(name.decode("latin-1"), _as_sent(value))
                                         for name, value in headers],
                                allow_redirects=False)
                            break
                        except aiohttp.ClientOSError as exc:
                            if attempt == 2 or not _unsent(exc, body, body_sent[0]):
                                raise
                            log.info("upstream connection reset under a request body; "
                                     "sending it again", upstream=self.shown,
                                     error=str(exc.__cause__))
                finally:
                    waiting[0] = False
            _ack_promptly(response)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if isinstance(exc.__cause__, ClientGone):  # aiohttp wraps the upload's error
                raise ClientGone() from exc
            if isinstance(exc.__cause__, CallerStalled):
                raise exc.__cause__ from None
            if isinstance(exc, UploadStalled):
                raise UpstreamUnavailable(str(exc), extra={"upstream": self.shown}
                                          ) from exc
            if head_by.expired():
                raise UpstreamUnavailable(
                    f"the upstream {self.shown} sent no final reply head within "
                    f"{timeout:g} s of the request (--upstream-timeout)",
                    extra={"upstream": self.shown}) from exc
            raise UpstreamUnavailable(
                f"the upstream {self.shown} did not answer: {type(exc).__name__}"
                + (f" ({exc})" if str(exc) else ""),
                extra={"upstream": self.shown}) from exc
        if not 200 <= response.status <= 599:
            response.close()
            raise UpstreamUnavailable(
                f"the upstream {self.shown} answered with status {response.status}, "
                "which is not a final HTTP status (200-599)",
                extra={"upstream": self.shown})
        unrelayable = unrelayable_header(end_to_end(response.raw_headers))
        if unrelayable is not None:
            # Checked before anything is relayed or recorded: the HTTP server would
            # refuse the head mid-answer, dropping the caller's connection after its
            # turn had been stored (a retry then stored it twice).
            response.close()
            raise UpstreamUnavailable(
                f"the upstream {self.shown} answered with a reply head that cannot "
                f"be relayed: {unrelayable}", extra={"upstream": self.shown})
        return response

    def _too_large(self, session_id: str, part: str, request_bytes: int | None = None, *,
                   exact: int | None = None, at_least: int = 0) -> None:
        """A turn the store could not take (its body limit, a §1 413): forwarded,
        counted `rejected`, never held whole. Logged with the part's size: `bytes` when
        it is known (declared), else `at_least` (a chunked body, or a reply that
        inflates past the limit, is not read to its end); for a reply, also the
        request's bytes, with which it shares the limit."""
        self.metrics.unrecorded.labels(REJECTED).inc()
        size: dict[str, int] = {"bytes": exact} if exact is not None else \
            {"at_least": at_least}
        if request_bytes is not None:
            size["request_bytes"] = request_bytes
        log.warning("turn not recorded: too large", session_id=session_id, part=part,
                    **size, limit=self.max_turn_bytes, problem="urn:turnlog:too-large")

    async def _read(self, response: aiohttp.ClientResponse,
                    limit: int) -> bytes | bytearray | tuple[bytes | bytearray, ...]:
        """The whole reply body, or (past `limit` bytes) the chunks read so far, the rest
        left to relay; UpstreamUnavailable when it breaks off."""
        try:
            raw = await _read_reply(response, limit)
        except (aiohttp.ClientError, TimeoutError) as exc:
            response.close()  # the connection is in an unknown state: not back to the pool
            raise UpstreamUnavailable(
                f"the upstream reply broke off: {type(exc).__name__}") from exc
        if not isinstance(raw, tuple):
            response.release()
        return raw

    async def _record(self, scope: dict[str, Any], decision: Candidate, reply: Any,
                      request_timestamp: float, timestamp: float, size: int,
                      reservation: Reservation | None = None) -> str:
        assert self.recorder is not None
        record = build_record(scope["path"], decision.request, reply, request_timestamp,
                              timestamp)
        header_labels: dict[str, Any] = {}
        text = _header(scope, LABELS_HEADER.lower().encode())
        if text is not None:
            try:
                header_labels = parse_labels_header(text)
            except DomainError as exc:
                log.warning("ignored a malformed label header", header=LABELS_HEADER,
                            session_id=decision.session_id, detail=exc.detail)
        opening = open_body(decision.session_id, self.config.defaults, header_labels)
        return await self.recorder.record(decision.session_id,
                                          turn_body(uuid.uuid4().hex, record), opening, size,
                                          decision.prompt, reservation)


# -- ASGI helpers ------------------------------------------------------------------------


# A request target's bytes as they may go on: printable ASCII, no space.
_PRINTABLE = re.compile(rb"[\x21-\x7e]*")


def _raw_path(scope: dict[str, Any]) -> bytes:
    """The request's path as it was sent (uvicorn's `raw_path`: not percent-decoded)."""
    raw = scope.get("raw_path")
    return bytes(raw) if raw else scope["path"].encode("utf-8")


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    """A request header's value; its last one when sent twice. miles' session server
    forwards the agent's headers with its own `X-SMG-Routing-Key` added after them, so
    an agent that sent one too puts two on the wire, and miles' is the last."""
    found = None
    for key, value in scope["headers"]:
        if key == name:
            found = value
    if found is None:
        return None
    try:
        return bytes(found).decode("utf-8")
    except UnicodeDecodeError:
        return bytes(found).decode("latin-1")


def _has_body(scope: dict[str, Any]) -> bool:
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


@dataclass(frozen=True)
class BodyPace:
    """How a caller's request body must arrive, as `turnlog serve` has it: a byte at
    least every `idle` seconds (`TURNLOG_BODY_TIMEOUT_S`) and at the minimum pace
    (`MinPace`), counted in seconds of waiting for it (`_stream_body`)."""

    idle: float
    pace: MinPace = MinPace()


async def _stream_body(receive: Any, pace: BodyPace) -> AsyncIterator[bytes]:
    """A request body's chunks as they come; CallerStalled when none comes for `idle`
    seconds or the body falls below its minimum pace (a caller that declared more than
    it sends, or trickles it a byte every 25 s, held its connection, and with a turn
    the gateway's memory, for as long as it liked), ClientGone when the caller hangs
    up. The pace counts only the time spent waiting for the caller's bytes: a body
    streamed up stops being read while the upstream takes nothing, and that wait is
    the upstream's (its `--upstream-timeout`), not the caller's (a review's finding)."""
    loop = asyncio.get_running_loop()
    waited, seen = 0.0, 0
    while True:
        allowed = pace.pace.due(seen) - waited
        begun = loop.time()
        try:
            async with asyncio.timeout(min(pace.idle, allowed)):
                message = await receive()
        except TimeoutError:
            if allowed < pace.idle:
                raise pace.pace.too_slow(seen, waited + loop.time() - begun,
                                         CallerStalled) from None
            raise CallerStalled(
                f"the request body stopped arriving: no byte for {pace.idle:g} s",
                field="body", expected=f"a byte at least every {pace.idle:g} s "
                "(TURNLOG_BODY_TIMEOUT_S)", actual="nothing more") from None
        waited += loop.time() - begun
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if chunk:
            seen += len(chunk)
            yield chunk
        if not message.get("more_body", False):
            return


# A request body goes up in slices of this size, each written within the upstream
# timeout (see `_bounded`).
UPLOAD_SLICE = 1 << 20


class UploadStalled(TimeoutError):
    """The upstream took no more of a request body within the upstream timeout."""


class _AsSent(aiohttp.ClientRequest):
    """aiohttp's request less the `Content-Length: 0` it gives a request of any method
    but GET, HEAD, OPTIONS and TRACE that has no body: the caller sent none (a POST
    without a body, as an engine's `/add_worker` or curl's `-X POST` sends it, has no
    body by HTTP/1.1's framing rules either way), and the gateway adds no header but
    `X-Forwarded-For` (a review's finding). A `Content-Length` the caller sent goes
    up as sent, as every end-to-end header does."""

    def update_body_from_data(self, body: Any, *args: Any, **kwargs: Any) -> None:
        sent = aiohttp.hdrs.CONTENT_LENGTH in self.headers
        super().update_body_from_data(body, *args, **kwargs)
        if body is None and not sent:
            self.headers.popall(aiohttp.hdrs.CONTENT_LENGTH, None)


class _BoundedWriter:
    """aiohttp's request-body writer, each slice's write (its drain included) bounded by
    `timeout`: an upstream that stops reading the body times out like one that stops
    answering. Everything but `write` is the writer's own."""

    def __init__(self, writer: Any, timeout: float) -> None:
        self.writer = writer
        self.timeout = timeout

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)

    async def write(self, chunk: bytes | bytearray | memoryview) -> None:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), UPLOAD_SLICE):
            try:
                async with asyncio.timeout(self.timeout):
                    await self.writer.write(view[start:start + UPLOAD_SLICE])
            except TimeoutError:
                raise UploadStalled(
                    f"the upstream took no more of the request body within "
                    f"{self.timeout:g} s (--upstream-timeout)") from None


def _bounded_writer(writer: AbstractStreamWriter, timeout: float) -> AbstractStreamWriter:
    return cast(AbstractStreamWriter, _BoundedWriter(writer, timeout))


class _Bounded(aiohttp.payload.Payload):
    """A payload written through `_BoundedWriter`, `sent` called once it is all sent
    (mixed in before an aiohttp payload class)."""

    timeout: float
    sent: Callable[[], None]

    async def write_with_length(self, writer: AbstractStreamWriter,
                                content_length: int | None) -> None:
        await super().write_with_length(_bounded_writer(writer, self.timeout), content_length)
        self.sent()


class _BoundedBytes(_Bounded, aiohttp.payload.BytesPayload):
    pass


class _BoundedStream(_Bounded, aiohttp.payload.AsyncIterablePayload):
    pass


def _unsent(exc: aiohttp.ClientOSError, body: Any, all_sent: bool) -> bool:
    """The request may be sent again: the upstream reset the connection (aiohttp's
    "Can not write request body", caused by the reset) before the body was all sent
    (`all_sent`: a reset while waiting for the reply raises the same error, and the
    upstream may then be running the request), and the body is held whole (bytes;
    never a body streamed from the caller: it is gone). An upstream that has not
    received a request's whole body has not answered it (an HTTP server reads the
    body before it calls the application): most often a kept-alive connection the
    upstream closed as the gateway took it."""
    return (not all_sent and isinstance(body, bytes | bytearray)
            and isinstance(exc.__cause__, ConnectionResetError | BrokenPipeError))


def _bounded(body: Any, timeout: float,
             sent: Callable[[], None]) -> aiohttp.payload.Payload | None:
    """A request body (bytes, an `_Upload` or None) as aiohttp sends it, with each
    write bounded by `timeout`, and `sent` called once it is all sent. aiohttp's own
    read timeout starts only once the body is sent, and it has no write timeout: a
    body larger than the sockets' buffers going to an upstream that stopped reading
    would hold the caller for good."""
    if body is None:
        return None
    payload: _BoundedBytes | _BoundedStream = (
        _BoundedBytes(body) if isinstance(body, bytes | bytearray) else _BoundedStream(body))
    payload.timeout = timeout
    payload.sent = sent
    return payload


class _Upload:
    """A request body sent up as it comes from the caller (ClientGone when the caller
    goes away). `done` is set once nothing more is read from it: aiohttp may still be
    sending it when the reply's head is in, and until then the caller's `receive`
    is the upload's, not the disconnect watcher's."""

    def __init__(self, receive: Any, pace: BodyPace, prefix: tuple[bytes, ...] = ()) -> None:
        self.receive = receive
        self.pace = pace
        self.prefix = prefix  # chunks received already, sent first
        self.done = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            prefix, self.prefix = self.prefix, ()
            for chunk in prefix:
                yield chunk
            del prefix
            async for chunk in _stream_body(self.receive, self.pace):
                yield chunk
        finally:
            self.done.set()


async def _watch_disconnect(receive: Any, gone: asyncio.Event,
                            upload: _Upload | None) -> None:
    if upload is not None:
        await upload.done.wait()
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _parse_aside(session_id: str | None, body: bytes) -> Candidate | Unrecorded:
    """`classify_request`, on a worker thread for a body of `PARSE_ASIDE_BYTES` or more
    (run as a task beside the upstream call, it parses while the upstream generates;
    a small body is parsed at once, cheaper than a thread hand-off)."""
    if len(body) < PARSE_ASIDE_BYTES:
        return classify_request(session_id, body)
    return await anyio.to_thread.run_sync(classify_request, session_id, body)


async def _gather(chunks: AsyncIterator[bytes], limit: int) -> bytes | tuple[bytes, ...]:
    """A body from its chunks, joined once at the end; or (past `limit` bytes) the
    chunks gathered so far, the rest left in `chunks` for whoever relays it."""
    gathered: list[bytes] = []
    size = 0
    async for chunk in chunks:
        gathered.append(chunk)
        size += len(chunk)
        if size > limit:
            return tuple(gathered)
    return b"".join(gathered)


def _content_length(scope: dict[str, Any]) -> int | None:
    """The request's declared Content-Length (None: none, or not a number)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            text = bytes(value).strip()
            return int(text) if text.isdigit() else None
    return None


async def _relay(scope: dict[str, Any], receive: Any, send: Any,
                 response: aiohttp.ClientResponse, upload: _Upload | None = None,
                 prefix: tuple[bytes | bytearray, ...] = ()) -> None:
    """Send status and headers, then each chunk as the upstream gives it; a caller that
    goes away stops it (and closes the upstream connection instead of reading a long
    reply to its end). A reply read to its end has given its connection back to the
    pool already."""
    headers = end_to_end(response.raw_headers,
                         NO_CONTENT_LENGTH if response.status in NO_BODY else frozenset())
    gone = asyncio.Event()
    watcher = asyncio.create_task(_watch_disconnect(receive, gone, upload))
    # The caller gone: the relay stops at once and the upstream connection is closed,
    # not at the reply's next chunk (a slow stream kept it, and the upstream
    # generating, until then). By cancelling this task: closing the response under
    # its pending read instead made aiohttp keep the error raised into this frame,
    # a cycle holding the frame's buffers (~16 KB a hang-up) until a full collection.
    task = asyncio.current_task()
    relaying = [True]

    def hung_up(_: object) -> None:
        if gone.is_set() and relaying[0] and task is not None:
            task.cancel()

    watcher.add_done_callback(hung_up)
    try:
        await send({"type": "http.response.start", "status": response.status,
                    "headers": headers})
        for chunk in prefix:  # read already (a turn found too large to hold)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        prefix = ()
        async for chunk in response.content.iter_any():
            if gone.is_set():
                break
            if chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    except (aiohttp.ClientError, TimeoutError) as exc:
        # Headers are gone already: all that is left is to cut the connection. Said
        # here once (the fault is the upstream's), then cut through the protocol's
        # extension; a server without it cuts a reply left incomplete itself, with an
        # error line of its own (an exception escaping here would log a traceback).
        if not gone.is_set():
            log.warning("upstream reply broke off; the caller's connection is cut",
                        path=scope["path"], error=type(exc).__name__)
            cut = scope.get("extensions", {}).get(CUT_CONNECTION)
            if cut is not None:
                cut(scope)
    except asyncio.CancelledError:
        if not gone.is_set() or task is None or task.uncancel() > 0:
            raise  # not (only) the hang-up's: a shutdown
    finally:
        relaying[0] = False
        watcher.cancel()
        response.close()
        if gone.is_set():
            log.info("caller went away mid-reply", path=scope["path"])


def _ack_promptly(response: aiohttp.ClientResponse) -> None:
    """Acknowledge the rest of this reply as it comes (TCP_QUICKACK), not 40 ms late.

    The upstream's connection sat idle while it generated, so the kernel restarts
    its send window small (slow start after idle) and grows it once per ACK round.
    A request/response socket acknowledges lazily (delayed ACKs, up to 40 ms on
    Linux), so a 4 MB reply after a long generation took ~3 such rounds: ~80 ms
    added to the turn (measured with `bench.gateway --think-ms`). Setting
    TCP_QUICKACK once the reply's head is in leaves that mode for this reply.
    """
    connection = response.connection
    transport = connection.transport if connection is not None else None
    sock = transport.get_extra_info("socket") if transport is not None else None
    quickack = getattr(socket, "TCP_QUICKACK", None)  # Linux only
    if sock is not None and quickack is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, quickack, 1)


async def _read_reply(response: aiohttp.ClientResponse,
                      limit: int) -> bytes | bytearray | tuple[bytes | bytearray, ...]:
    """The raw reply body in one buffer; past `limit` bytes (declared or read), the
    chunks read so far instead (the rest is left in `response`, to be relayed).

    The buffer is allocated by the declared Content-Length up to `PREALLOCATE`
    (joining chunks would hold a 100 MB body twice at the join) and grows past
    it only as bytes arrive, so a length the upstream declares but never sends
    costs nothing. A reply that breaks off leaves its buffer emptied: the
    exception's traceback may keep the frame alive until a collection.
    """
    declared = response.headers.get("content-length", "")
    if not declared.isdigit():
        # No declared length: chunks joined once (a buffer grown chunk by chunk would
        # be copied again at each growth).
        return await _gather(_pieces(response.content), limit)
    size = int(declared)
    if size > limit:
        return ()
    buffer = unfilled_bytearray(min(size, PREALLOCATE))  # cut to what came, below
    # Written through a view: a bytearray's own slice assignment copies a `bytes` chunk
    # into a temporary bytearray first (two copies of every reply byte; ~2 % of the
    # gateway's CPU per recorded turn, in a profile). The view is let go before the
    # buffer is resized.
    view = memoryview(buffer)
    filled = 0
    try:
        async for chunk in _pieces(response.content):
            end = filled + len(chunk)
            if end > limit:
                view.release()
                del buffer[filled:]
                return (buffer, chunk) if filled else (chunk,)
            if end <= len(buffer):
                view[filled:end] = chunk
            else:
                view.release()
                del buffer[filled:]
                buffer += chunk
                view = memoryview(buffer)
            filled = end
    except BaseException:
        view.release()
        buffer.clear()
        raise
    view.release()
    del buffer[filled:]
    return buffer


async def _pieces(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """A reply's bytes in the pieces aiohttp received them, none empty. Not
    `iter_any`: it joins the pieces waiting into one `bytes` first, a copy of every
    byte of a reply that is then copied into its buffer anyway (the join was ~5 % of
    the gateway's CPU per recorded 4.2 MB turn in a profile)."""
    async for data, _ in content.iter_chunks():
        if data:
            yield data


def _as_sent(value: bytes) -> str:
    """A header value as the str aiohttp writes back as these bytes: it encodes values
    as UTF-8, so a UTF-8 value (a routing key `s-é`) is decoded as UTF-8 (as latin-1
    it went up re-encoded, another key: a tester's finding). Bytes that are not UTF-8
    cannot go through aiohttp unchanged; they go as their latin-1 reading."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


def _buffered_headers(raw: tuple[tuple[bytes, bytes], ...], length: int,
                      http10: bool = False) -> list[Any]:
    """A buffered reply's headers: hop-by-hop ones dropped, its framing the upstream's —
    its Content-Length, or none when it came chunked (uvicorn then sends it chunked
    too, as the upstream did). A Content-Length other than the `length` read (one
    sent beside chunked framing, which wins) is replaced by it. An HTTP/1.0 caller
    always gets the length: it cannot read chunked framing (RFC 9112 §6.1; a
    tester's finding: its JSON came with the chunk sizes in it)."""
    headers = end_to_end(raw)
    declared = [value for name, value in headers if name == b"content-length"]
    if (declared or http10) and declared != [str(length).encode()]:
        headers = [pair for pair in headers if pair[0] != b"content-length"]
        headers.append((b"content-length", str(length).encode()))
    return headers


async def _decoded(headers: tuple[tuple[bytes, bytes], ...], raw: bytes | bytearray,
                   limit: int) -> bytes | bytearray | None:
    """The reply body as JSON text: undone `gzip`, `deflate`, `br` or `zstd` (the caller
    gets `raw`) on a worker thread, at most `limit` bytes of it (None: more — a
    small body may inflate to gigabytes); b"" for another coding or a body that
    does not decode (`not-json`)."""
    encodings = [value for name, value in headers if name.lower() == b"content-encoding"]
    encoding = b", ".join(encodings).decode("latin-1").strip().lower() or "identity"
    if encoding == "identity":
        return raw
    if encoding not in DECODERS:
        return b""
    return await anyio.to_thread.run_sync(_inflate, encoding, raw, limit)


def _inflate(encoding: str, raw: bytes | bytearray, limit: int) -> bytes | None:
    """`raw` decompressed, if it is at most `limit` bytes so (None: more; b"": does not
    decompress)."""
    try:
        return DECODERS[encoding](raw, limit)
    except (zlib.error, brotli.error, zstandard.ZstdError):
        return b""


def _zlib(wbits: int) -> Any:
    def inflate(raw: bytes | bytearray, limit: int) -> bytes | None:
        stream = zlib.decompressobj(wbits)
        text = stream.decompress(raw, limit + 1)
        if len(text) > limit or stream.unconsumed_tail:
            return None
        return text if stream.eof else b""  # a body cut short does not decode
    return inflate


def _deflate(raw: bytes | bytearray, limit: int) -> bytes | None:
    # RFC 9110's deflate is zlib-wrapped; some servers send it raw.
    try:
        return _zlib(zlib.MAX_WBITS)(raw, limit)
    except zlib.error:
        return _zlib(-zlib.MAX_WBITS)(raw, limit)


def _brotli(raw: bytes | bytearray, limit: int) -> bytes | None:
    stream = brotli.Decompressor()
    text = stream.process(bytes(raw), output_buffer_limit=limit + 1)
    if len(text) > limit:
        return None
    return text if stream.is_finished() else b""


def _zstd(raw: bytes | bytearray, limit: int) -> bytes | None:
    # A streamed frame may not declare its size: decoded as a stream, in pieces.
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True)
    pieces, size = [], 0
    while piece := reader.read(1 << 20):
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            return None
    return b"".join(pieces)


DECODERS = {"gzip": _zlib(16 + zlib.MAX_WBITS), "x-gzip": _zlib(16 + zlib.MAX_WBITS),
            "deflate": _deflate, "br": _brotli, "zstd": _zstd}


_BLANK = frozenset(b" \t\r\n")


def _held_back(raw: bytes | bytearray, headers: list[Any]) -> int:
    """How many of a held reply's last bytes wait for its turn to be durable: from its
    last significant byte on (a JSON document is incomplete without its closing
    bracket, whatever whitespace follows it), or the whole body when it is encoded
    (gzip's last bytes are a checksum: a decoder has the whole document before them)."""
    for name, value in headers:
        if name.lower() == b"content-encoding" and value.strip().lower() not in (
                b"", b"identity"):
            return len(raw)
    end = len(raw)
    while end > 0 and raw[end - 1] in _BLANK:
        end -= 1
    return len(raw) - max(end - 1, 0)


async def _send_raw(send: Any, status: int, headers: list[Any],
                    body: bytes | bytearray) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send(send: Any, status: int, content_type: bytes, body: bytes) -> None:
    await _send_raw(send, status, [(b"content-type", content_type),
                                   (b"content-length", str(len(body)).encode())], body)


# Refusals answered before the request's body was read to its end: the connection
# closes after them (uvicorn honours the header), or what is left of that body (or,
# for a stalled one, never comes) would be read as the connection's next request.
BODY_LEFT_UNREAD = (CallerStalled, TooLarge)


async def _problem(send: Any, error: DomainError, *headers: tuple[bytes, bytes]) -> None:
    body = jsonio.dumps_bytes(error.problem())
    if isinstance(error, BODY_LEFT_UNREAD):
        headers = (*headers, (b"connection", b"close"))
    await _send_raw(send, error.http_status, [
        (b"content-type", PROBLEM), (b"content-length", str(len(body)).encode()), *headers],
        body)


async def _not_allowed(send: Any, error: MethodNotAllowed, allow: bytes) -> None:
    await _problem(send, error, (b"allow", allow))

