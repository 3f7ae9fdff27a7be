"""The HTTP/1.1 protocol `turnlog serve` hands uvicorn: httptools with bounds.

uvicorn's httptools protocol buffers request headers without limit and waits
for them without end. This subclass counts header bytes and fields as the
parser reports them and answers 431 (and closes) as soon as either bound is
passed, before the request reaches the app or its authorization; and it
closes a connection whose request line and headers do not arrive within
`TURNLOG_HEADER_TIMEOUT_S` (408). Bodies are timed per read in
`app.api.middleware.limits.BodyLimit`; idle keep-alive connections by uvicorn's own
`timeout_keep_alive`. The bounds are the `server` settings of `turnlog serve`,
handed to every worker with uvicorn's configuration (`app.served.guarded_protocol`).

It also offers a POST's route the rest of its body read straight into the
route's buffer (`DirectBody`, the scope extension `turnlog.direct_body`): the
append's hot path takes a multi-MB turn that way. Through uvicorn each read of
a body is copied four times (the loop's bytes, the parser's, uvicorn's buffer,
the ASGI message) and handed on by a dozen Python calls; read directly, the
kernel writes it into the route's buffer (a buffered protocol in the
connection's place until the declared length is in) and nothing else runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

import httptools
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from app.api.http_errors import Overloaded, RequestTimeout
from app.api.middleware.guards import headers_too_large
from app.asgi_extensions import CUT_CONNECTION, DIRECT_BODY, SERVER_CLOSING
from app.domain.errors import DomainError, InvalidRequest
from app.domain.wire import jsonio
from app.settings import ServerSettings

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
# Cheap and database-free: a liveness probe must not read "dead" because a thousand
# long-polls hold the concurrency limit (the orchestrator would restart a busy server).
BYPASS_LIMIT = frozenset({"/healthz"})


class GuardedHttpTools(HttpToolsProtocol):
    def __init__(self, *args: Any, bounds: ServerSettings, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_header_bytes = bounds.max_header_bytes
        self.max_headers = bounds.max_headers
        self.header_timeout = bounds.header_timeout_s
        self._header_bytes = 0
        self._header_count = 0
        self._hosts = 0
        self._trailers = False
        self._refusal: DomainError | None = None
        self._header_timer: asyncio.TimerHandle | None = None

    # -- header timeout ---------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        self.logger.warning("request headers not received in %ss; closing", self.header_timeout)
        self._refuse(RequestTimeout(
            f"request line and headers not received within {self.header_timeout} s",
            field="headers", expected=f"complete headers within {self.header_timeout} s",
            actual="incomplete"))

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # already answered and closing: ignore the rest of the flood
        if self.cycle is None or self.cycle.response_complete:
            # Bytes of a new request (or the first): its headers are now on the clock.
            self._arm_header_timer()
        super().data_received(data)

    # -- header bounds ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._header_count = 0
        self._hosts = 0
        self._trailers = False

    def on_url(self, url: bytes) -> None:
        self._count(len(url), 0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4, 1)
        if self._trailers:
            # A chunked body's trailer fields: the parser reports them as headers, and
            # uvicorn appended them to the request's, where they could name another
            # session or forge X-Forwarded-For, as TCP happened to split the request (a
            # tester's finding). RFC 9112 §7.1.2: never merged; dropped.
            return
        if name.lower() == b"host":
            self._hosts += 1
            if self._hosts > 1:
                # RFC 9112 §3.2: a request with more than one Host line is a 400 — a proxy
                # reading the other one would disagree with us about whom it is for.
                self._refusal = InvalidRequest(
                    "the request has more than one Host header", field="Host",
                    expected="exactly one Host header", actual="2 or more", status=400)
                raise HeaderLimitExceeded
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._trailers = True  # what the parser reports as headers from now on
        self._disarm_header_timer()
        if self.parser.should_upgrade() and not self._should_upgrade() and self._has_body():
            # An Upgrade it does not serve (any but WebSocket; `curl --http2` sends
            # `Upgrade: h2c` on plain http), with a body: the parser takes what follows
            # the head for the new protocol's, so the app would get an empty body and act
            # on it (the gateway relayed the declared length and hung for its upstream
            # timeout; a close went through without its reward: a tester's and a review's
            # findings). Refused here, before the app is started: 400.
            upgrade = next((v for k, v in self.headers if k == b"upgrade"), b"")
            self._refusal = InvalidRequest(
                "a request with a body cannot ask to change protocols (Upgrade) here: send "
                "it without the Upgrade header (curl: --http1.1)", field="Upgrade",
                expected="no Upgrade header on a request with a body (HTTP/1.1 only)",
                actual=upgrade.decode("latin-1")[:64], status=400)
            raise HeaderLimitExceeded
        self._host_from_target()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
            # By a weak reference: the scope holds this, and the cycle holds the scope.
            extensions[CUT_CONNECTION] = functools.partial(self._cut, weakref.ref(cycle))
            extensions[SERVER_CLOSING] = self._closing()
            if self.scope["method"] == "POST":
                extensions[DIRECT_BODY] = DirectBody(self, cycle)

    def _closing(self) -> asyncio.Event:
        """`SERVER_CLOSING`: one event per server, kept in the state its connections
        share (uvicorn's `ServerState`)."""
        state = self.server_state
        event: asyncio.Event | None = getattr(state, "turnlog_closing", None)
        if event is None:
            event = asyncio.Event()
            state.turnlog_closing = event  # type: ignore[attr-defined]
        return event

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown reaches each connection here: requests that only
        wait are told (`SERVER_CLOSING`), then uvicorn's own handling (an idle
        connection closed, a busy one closed after its answer)."""
        self._closing().set()
        super().shutdown()

    def _cut(self, cycle_ref: weakref.ref[RequestResponseCycle], _scope: Any = None) -> None:
        """`CUT_CONNECTION`: close the connection under this request's answer, left
        incomplete on purpose (the caller sees the cut). Marked as the caller's hang-up
        would mark it, so uvicorn does not log "returned without completing response"
        for what the app has said already (a request pipelined behind it is not
        answered). Nothing once that answer is complete: the connection may be another
        request's by then."""
        cycle = cycle_ref()
        if cycle is None or cycle.response_complete:
            return
        cycle.disconnected = True
        cycle.message_event.set()
        if self.transport is not None:
            self.transport.close()

    def _host_from_target(self) -> None:
        """An absolute-form target (`GET http://name/path`) names the host itself, and
        then the Host header is to be ignored (RFC 9112 §3.2.2): the header is made the
        target's authority, so the Host checks judge the name the request is for."""
        if not self.url[:8].lower().startswith((b"http://", b"https://")):
            return
        try:
            target = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            return  # uvicorn refuses it in a moment (400)
        if not target.host:
            return
        host = b"[" + target.host + b"]" if b":" in target.host else target.host  # IPv6
        authority = host + (b":%d" % target.port if target.port else b"")
        self.headers[:] = [(k, v) for k, v in self.headers if k != b"host"]
        self.headers.append((b"host", authority))

    def fresh_parser(self) -> None:
        """A new parser for the connection's next request, after a body read directly
        (the old one never saw those bytes: it still waits for them)."""
        self.parser = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)

    def _count(self, size: int, fields: int) -> None:
        self._header_bytes += size
        self._header_count += fields
        if self._header_bytes > self.max_header_bytes or self._header_count > self.max_headers:
            self._refusal = headers_too_large(self._header_count, self._header_bytes,
                                              self.max_headers, self.max_header_bytes)
            # Raising stops the parser; uvicorn then calls `send_400_response`, below.
            raise HeaderLimitExceeded

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this when the parser stops: a header bound passed (`_count`), or
        # bytes that are not HTTP/1.1 (an unknown method, a Content-Length that is no
        # number, one beside chunked). Either way the answer is problem+json, as every
        # other error is, never uvicorn's plain-text 400.
        if self._refusal is None:
            self._refuse(InvalidRequest(
                "the request is not valid HTTP/1.1: an unknown method, a malformed "
                "request line or header, or a Content-Length that is no length",
                field="request", expected="an HTTP/1.1 request (RFC 9112)",
                actual="unparsable", status=400))
            return
        self.logger.warning("request headers refused; closing")
        refusal, self._refusal = self._refusal, None
        self._refuse(refusal)

    def _has_body(self) -> bool:
        return any((name == b"content-length" and value.strip() not in (b"", b"0"))
                   or name == b"transfer-encoding" for name, value in self.headers)

    def _unsupported_upgrade_warning(self) -> None:
        # uvicorn calls this when the parser stopped at an Upgrade it does not serve. One
        # with a body was refused before (`on_headers_complete`); one without went to the
        # app whole and is answered over HTTP/1.1 (RFC 9110 §7.8 lets a server ignore
        # Upgrade). The parser reads nothing more on this connection (a request pipelined
        # behind it would wait unanswered): it closes after the answer.
        self.logger.debug("Upgrade header ignored: served over HTTP/1.1, then closed")
        if self.cycle is not None:
            self.cycle.keep_alive = False

    def _refuse(self, error: DomainError) -> None:
        """Answer `error` as problem+json and close, without involving the app."""
        self._disarm_header_timer()
        body = jsonio.dumps_bytes(error.problem())
        status = error.http_status
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/problem+json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n"
                % (status, REASONS.get(status, b"Error"), len(body)))
        self._refusal = error
        self.transport.write(head + body)
        self.transport.close()


    # -- the concurrency limit ------------------------------------------------------------

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        # uvicorn answers over `limit_concurrency` with a plain-text 503 of its own:
        # /healthz is served anyway, everything else gets the API's problem+json.
        if app is service_unavailable:
            app = self.app if cycle.scope["path"] in BYPASS_LIMIT else overloaded
        super()._start_asgi_task(cycle, app)


async def overloaded(_scope: Any, _receive: Any, send: Any) -> None:
    """The 503 past `TURNLOG_LIMIT_CONCURRENCY`, as problem+json (and the connection
    closed, as uvicorn does: the client retries on a new one)."""
    error = Overloaded("the server is at its concurrency limit; retry shortly",
                        field="connection", expected="fewer requests or connections in flight",
                        actual="at TURNLOG_LIMIT_CONCURRENCY")
    body = jsonio.dumps_bytes(error.problem())
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class DirectBody:
    """The rest of one request's body read straight into the route's `BodyBuffer`.

    The route first reads the body's first message through the ASGI `receive` as
    usual (that answers `Expect: 100-continue` and counts the bytes for the body
    limit), then calls `read_rest`. It takes what uvicorn holds of the body already,
    pauses the connection's reads, puts a `_DirectReader` in the protocol's place
    and resumes: each read of the socket lands in the buffer, up to the declared
    length and no further (a pipelined request after it stays in the socket). Then
    the connection's protocol is put back with a fresh parser, as if the parser had
    seen the body end. A failure or cancellation on the way (a timeout, the route's
    task cancelled) puts it back too, and closes the connection after the answer:
    where that body ended is no longer known.
    """

    def __init__(self, protocol: GuardedHttpTools, cycle: RequestResponseCycle) -> None:
        self.protocol = protocol
        self.cycle = cycle

    async def read_rest(self, buffer: Any, declared: int,
                        progress: Callable[[int], None] | None = None) -> bool:
        """Fill `buffer` (a `BodyBuffer` of `declared` bytes, some added already) to
        `declared`, calling `progress(n)` as bytes arrive; ClientDisconnect if the
        caller goes. False, with nothing read, when the body is not this connection's
        to read now (complete already, answered, another request's turn): the route
        then reads on through `receive`."""
        protocol, cycle = self.protocol, self.cycle
        transport = protocol.transport
        if (protocol.cycle is not cycle or not cycle.more_body or cycle.disconnected
                or cycle.response_complete or transport is None or transport.is_closing()
                or protocol.parser is None or cycle.waiting_for_100_continue):
            return False
        protocol.flow.pause_reading()
        if cycle.body:  # received since the route's last read: the buffer's first
            if buffer.filled + len(cycle.body) > declared:
                return False  # more than declared (the parser would not allow it)
            buffer.add(cycle.body)
            if progress is not None:
                progress(len(cycle.body))
            cycle.body = bytearray()
        if buffer.filled >= declared:
            return False  # the parser's own end of message will come with its next read
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        reader = _DirectReader(protocol, cycle, buffer, declared, done, progress)
        transport.set_protocol(reader)
        transport.resume_reading()
        try:
            await done
        except BaseException:
            reader.abandon()
            raise
        return True


class _DirectReader(asyncio.BufferedProtocol):
    """The connection's protocol while a body is read straight into its buffer."""

    def __init__(self, protocol: GuardedHttpTools, cycle: RequestResponseCycle, buffer: Any,
                 declared: int, done: asyncio.Future[None],
                 progress: Callable[[int], None] | None) -> None:
        self.protocol, self.cycle, self.buffer = protocol, cycle, buffer
        self.declared, self.done, self.progress = declared, done, progress

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer.window()[:self.declared - self.buffer.filled]

    def buffer_updated(self, nbytes: int) -> None:
        self.buffer.advance(nbytes)
        if self.buffer.filled >= self.declared:
            self._give_back()
            self.protocol.fresh_parser()
            self.cycle.more_body = False
            if not self.done.done():
                self.done.set_result(None)
        elif self.progress is not None:
            self.progress(nbytes)

    def _give_back(self) -> None:
        """The connection's own protocol in place again, its reads paused (as uvicorn's
        flow control has them: resumed by the next read or the end of the answer)."""
        transport = self.protocol.transport
        if transport.get_protocol() is self:
            with contextlib.suppress(RuntimeError):  # paused already, or closing
                transport.pause_reading()
            transport.set_protocol(self.protocol)
        self.protocol.flow.read_paused = True

    def abandon(self) -> None:
        """Given up before the body's end: the connection closes after the answer."""
        self._give_back()
        self.cycle.keep_alive = False

    def eof_received(self) -> None:
        self.protocol.eof_received()  # the connection then closes: connection_lost

    def connection_lost(self, exc: Exception | None) -> None:
        self.protocol.connection_lost(exc)
        if not self.done.done():
            self.done.set_exception(ClientDisconnect())

    def pause_writing(self) -> None:
        self.protocol.pause_writing()

    def resume_writing(self) -> None:
        self.protocol.resume_writing()


class HeaderLimitExceeded(Exception):
    """Raised from a parser callback to stop parsing a request over the header bounds."""
