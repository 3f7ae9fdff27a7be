"""Request guards that run before authorization (pure ASGI middleware).

`HeaderBounds` refuses a request with too many or too large headers (431);
the served protocol (`app.api.middleware.serving`) already cuts such a request off while
it streams in, this is the same bound for any other ASGI server. `Loopback`
protects the no-token mode from the browser: a web page on the same machine
can send a `text/plain` POST to 127.0.0.1 (a cross-site request) or reach it
under its own name (DNS rebinding). Without tokens, therefore, only loopback
`Host` names (and `TURNLOG_ALLOWED_HOSTS`) are served, a foreign `Origin` is
refused, and a write whose body declares a type must declare JSON or
MessagePack, which a browser cannot send cross-site without asking first
(CORS preflight, which this server never grants); a browser always sends an
`Origin` with a cross-site write, so an untyped body without one is a script.
With tokens configured nothing here applies: a browser never attaches a
bearer token on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import parse_qsl

import structlog
from starlette.types import ASGIApp, Receive, Scope, Send

from app.access import (
    URL_TOKEN_CHALLENGE,
    ForeignHost,
    allowed_names,
    foreign_request,
    header_map,
    token_in_url,
)
from app.api.http_errors import HeadersTooLarge
from app.api.problem_wire import send_problem
from app.domain.body.queries import repeated_parameter
from app.domain.errors import UnsupportedMediaType
from app.domain.wire import msgpackio

log = structlog.get_logger("turnlog.guard")
WRITE_TYPES = frozenset({"application/json", *msgpackio.MEDIA_TYPES,
                         msgpackio.NARROW_MEDIA_TYPE})
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class HeaderBounds:
    def __init__(self, app: ASGIApp, max_bytes: int, max_count: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_count = max_count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope.get("headers") or []
            size = sum(len(k) + len(v) + 4 for k, v in headers)
            if len(headers) > self.max_count or size > self.max_bytes:
                await send_problem(send, headers_too_large(len(headers), size, self.max_count,
                                                           self.max_bytes))
                return
        await self.app(scope, receive, send)


def headers_too_large(count: int, size: int, max_count: int, max_bytes: int) -> HeadersTooLarge:
    return HeadersTooLarge(
        f"request headers exceed the limit of {max_count} headers or {max_bytes} bytes",
        field="headers", expected=f"at most {max_count} headers, {max_bytes} bytes",
        actual=f"{count} headers, {size} bytes")


class Loopback:
    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = allowed_names(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.refusal(scope)
        if error is not None:
            log.warning("request refused", method=scope["method"], path=scope["path"],
                        problem=f"urn:turnlog:{error.slug}", status=error.http_status)
            await send_problem(send, error)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> ForeignHost | UnsupportedMediaType | None:
        headers = header_map(scope.get("headers") or [])
        refused = foreign_request(headers, self.allowed)
        if refused is not None:
            return refused
        if scope["method"].upper() in READ_METHODS or not has_body(headers):
            return None
        declared = headers.get(b"content-type")
        if declared is None or not declared.strip():  # blank: as not sent (the routers agree)
            # No browser sends a body without a type and without an Origin (checked
            # above); scripts and curl that leave it out get the API's JSON default.
            return None
        media = declared.decode("latin-1").partition(";")[0].strip().lower()
        if media not in WRITE_TYPES:
            # Only turns read MessagePack; every other write names JSON alone (as its router).
            turns = scope["path"].rstrip("/").endswith("/turns")
            return UnsupportedMediaType(
                "a turn's body must be JSON or MessagePack" if turns
                else "a write's body must be JSON", field="content-type",
                expected=" | ".join(sorted(WRITE_TYPES)) if turns else "application/json",
                actual=declared.decode("latin-1")[:80] or "empty")
        return None


def has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length")
    if b"transfer-encoding" in headers:
        return True
    return length is not None and length.strip() not in (b"", b"0")


class QueryOnce:
    """A query parameter given twice on an API route (`/v1/…`) is a 422 naming it
    (`repeated_parameter`): the framework kept the last value, so `step=1&step=2`
    answered for step 2 alone (a tester's doubt). The UI's pages are left as they are."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = scope.get("query_string") if scope["type"] == "http" else None
        if query and scope["path"].startswith("/v1/"):
            refusal = repeated_parameter(parse_qsl(query.decode("latin-1"),
                                                   keep_blank_values=True))
            if refusal is not None:
                await send_problem(send, refusal)
                return
        await self.app(scope, receive, send)


# A token in a URL lands in access logs, proxies and browser history, so it is refused;
# the names are matched decoded (`app.domain.wire.url_tokens`), as the routers read them.
class QueryTokens:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = token_in_url(scope.get("query_string") or b"")
            if refusal is not None:
                await send_problem(send, refusal, {"www-authenticate": URL_TOKEN_CHALLENGE})
                return
        await self.app(scope, receive, send)
