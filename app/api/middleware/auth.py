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

import structlog
from starlette.types import ASGIApp, Receive, Scope, Send

from app.access import Forbidden, TokenTable, Unauthorized, authorize, bearer_token, challenge
from app.api.problem_wire import send_problem
from app.api.routes.docs_ui import ASSET_PATHS

# `/` only redirects to the UI (which asks for a token itself), so it is open.
OPEN_PATHS = frozenset({"/", "/healthz", "/readyz", "/metrics", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc", *ASSET_PATHS})
UI_PREFIX = "/ui"
log = structlog.get_logger("turnlog.auth")


def is_ui(path: str) -> bool:
    """`/ui` and below: authorized by `app.ui.guard.UiGuard` (bearer or login cookie)."""
    return path == UI_PREFIX or path.startswith(UI_PREFIX + "/")


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
