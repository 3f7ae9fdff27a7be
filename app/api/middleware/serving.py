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
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from app.api.http_errors import Overloaded, RequestTimeout
from app.api.middleware.guards import headers_too_large
from app.domain.errors import DomainError
from app.domain.wire import jsonio
from app.settings import ServerSettings

REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
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

    def on_url(self, url: bytes) -> None:
        self._count(len(url), 0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4, 1)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def _count(self, size: int, fields: int) -> None:
        self._header_bytes += size
        self._header_count += fields
        if self._header_bytes > self.max_header_bytes or self._header_count > self.max_headers:
            self._refusal = headers_too_large(self._header_count, self._header_bytes,
                                              self.max_headers, self.max_header_bytes)
            # Raising stops the parser; uvicorn then calls `send_400_response`, below.
            raise HeaderLimitExceeded

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            super().send_400_response(msg)
            return
        self.logger.warning("request headers over the limit; closing")
        refusal, self._refusal = self._refusal, None
        self._refuse(refusal)

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


class HeaderLimitExceeded(Exception):
    """Raised from a parser callback to stop parsing a request over the header bounds."""
