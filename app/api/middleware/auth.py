"""Bearer-token authorization (pure ASGI middleware, before any body is read).

With `TURNLOG_API_TOKENS` configured, every request needs `Authorization:
Bearer <token>` except the service routes (`/healthz`, `/readyz`, `/metrics`,
`/openapi.json`, `/docs`): all of `/v1/*`, and any route added later (deny by
default). The scope a route needs follows from its method: GET, HEAD and
OPTIONS read; every other method may change something (open, append, close,
metric history, gate evaluation, which records values) and needs a `write`
token, which also reads. A missing or unknown token is 401, a read token on
a write route 403, both problem+json with `WWW-Authenticate`. The token
format is `app.settings.parse_api_tokens`. The web UI (`/ui`) is guarded by
`app.ui.guard.UiGuard` with the same rule (`authorize`), which also takes the
token from the login cookie and answers a browser with a login form.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

import structlog
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.http_errors import Forbidden, Unauthorized
from app.api.problems import send_problem
from app.api.routes.docs_ui import ASSET_PATHS
from app.domain.errors import DomainError
from app.settings import Scope as TokenScope

# `/` only redirects to the UI (which asks for a token itself), so it is open.
OPEN_PATHS = frozenset({"/", "/healthz", "/readyz", "/metrics", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc", *ASSET_PATHS})
UI_PREFIX = "/ui"
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CHALLENGE = 'Bearer realm="turnlog"'
log = structlog.get_logger("turnlog.auth")
UNKNOWN_TOKEN = "unknown token"


def is_ui(path: str) -> bool:
    """`/ui` and below: authorized by `app.ui.guard.UiGuard` (bearer or login cookie)."""
    return path == UI_PREFIX or path.startswith(UI_PREFIX + "/")


def required_scope(method: str) -> TokenScope:
    return "read" if method.upper() in READ_METHODS else "write"


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            if scheme.lower() == b"bearer" and token:
                return token
            return None
    return None


class TokenTable:
    """The configured tokens; lookups compare against every token in constant time."""

    def __init__(self, tokens: Mapping[str, TokenScope]) -> None:
        self._tokens = [(token.encode("ascii"), scope) for token, scope in tokens.items()]

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def scope_of(self, presented: bytes) -> TokenScope | None:
        found: TokenScope | None = None
        # No early exit: the time taken does not depend on which token matched.
        for token, scope in self._tokens:
            if hmac.compare_digest(token, presented):
                found = scope
        return found


def authorize(tokens: TokenTable, method: str, presented: bytes | None) -> None:
    """Raise `Unauthorized`/`Forbidden` unless `presented` may call a `method` route."""
    needed = required_scope(method)
    if presented is None:
        raise Unauthorized("this route needs `Authorization: Bearer <token>`",
                           field="Authorization", expected="Bearer <token>", actual="missing")
    scope = tokens.scope_of(presented)
    if scope is None:
        raise Unauthorized("the bearer token is not one this server knows",
                           field="Authorization", expected="a configured API token",
                           actual=UNKNOWN_TOKEN)
    if needed == "write" and scope != "write":
        raise Forbidden(f"{method} needs a write token; this token may only read",
                        field="Authorization", expected="a write token", actual="a read token")


class BearerAuth:
    def __init__(self, app: ASGIApp, tokens: TokenTable) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.tokens or scope["path"] in OPEN_PATHS \
                or is_ui(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            authorize(self.tokens, scope["method"], bearer_token(scope.get("headers") or []))
        except (Unauthorized, Forbidden) as exc:
            log.warning("request refused", method=scope["method"], path=scope["path"],
                        problem=f"urn:turnlog:{exc.slug}", status=exc.http_status)
            await send_problem(send, exc, {"www-authenticate": challenge(exc)})
            return
        await self.app(scope, receive, send)


def challenge(error: DomainError) -> str:
    """The RFC 6750 `WWW-Authenticate` value for a refusal."""
    if isinstance(error, Forbidden):
        return CHALLENGE + ', error="insufficient_scope", scope="write"'
    if error.actual == UNKNOWN_TOKEN:
        return CHALLENGE + ', error="invalid_token"'
    return CHALLENGE
