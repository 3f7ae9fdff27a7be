"""Guarding `/ui`: security headers on every answer, and read-token auth by cookie.

Every `/ui` answer carries a strict Content-Security-Policy (scripts, styles
and images only from turnlog itself, no inline script, no framing) and
`nosniff`. With API tokens configured, the bearer middleware
(`app/api/middleware/auth.py`) leaves `/ui` to this one: a page needs a valid token,
either as `Authorization: Bearer` or as the cookie the login form sets
(HttpOnly, SameSite=Strict, path `/ui`). The cookie is honoured on reading
methods only, so a cross-site form can never write with it. A page without
a valid token answers 401 with the login form; the stylesheet, scripts and
the login endpoint itself are open. Refuses the token rules themselves:
`app.api.middleware.auth.authorize` decides, as for the API.
"""

from __future__ import annotations

from http.cookies import CookieError, SimpleCookie

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.access import (
    Forbidden,
    TokenTable,
    Unauthorized,
    authorize,
    bearer_token,
    challenge,
)
from app.api.middleware.auth import is_ui
from app.api.problem_wire import send_problem
from app.ui.render import SIGNED_IN, login_page

COOKIE = "turnlog_ui_token"
OPEN_PATHS = frozenset({"/ui/login", "/ui/logout"})
OPEN_PREFIX = "/ui/static/"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
}


def cookie_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name.lower() == b"cookie":
            jar: SimpleCookie = SimpleCookie()
            try:
                jar.load(value.decode("latin-1"))
            except CookieError:
                continue
            if COOKIE in jar and jar[COOKIE].value:
                return jar[COOKIE].value.encode("latin-1")
    return None


class UiHeaders:
    """The `/ui` answers' security headers (HEADERS), on every one of them: added
    outside the guards that refuse before the UI's own (a foreign Host's 421, header
    bounds, tokens in the URL), whose answers carried none."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_ui(scope["path"]):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


class UiGuard:
    def __init__(self, app: ASGIApp, tokens: TokenTable) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_ui(scope["path"]):
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        by_cookie = False
        if self.tokens and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIX):
            headers = scope.get("headers") or []
            presented = bearer_token(headers)
            if not presented and method.upper() in ("GET", "HEAD"):  # as docs/ui.md says
                cookie = cookie_token(headers)
                by_cookie = bool(cookie)
                presented = cookie or presented
            try:
                authorize(self.tokens, method, presented)
            except (Unauthorized, Forbidden) as exc:
                if isinstance(exc, Unauthorized) and method.upper() in ("GET", "HEAD"):
                    response = login_page(path, scope.get("query_string", b""),
                                          error=bool(presented))
                    # A 401 names its scheme (RFC 9110 §11.6.1), the form's page too.
                    response.headers["www-authenticate"] = challenge(exc)
                    await response(scope, receive, send)
                    return
                await send_problem(send, exc, {"www-authenticate": challenge(exc)})
                return
        signed_in = SIGNED_IN.set(by_cookie)
        try:
            await self.app(scope, receive, send)
        finally:
            SIGNED_IN.reset(signed_in)
