"""WebSocket handshakes, refused by both HTTP shells: neither `turnlog serve` nor
`turnlog gateway` speaks WebSocket (the gateway does not proxy it either).

Owns the one answer a handshake gets from either: 403 problem+json
`urn:turnlog:websocket-refused`, sent through the ASGI extension
`websocket.http.response` (an HTTP answer to a handshake), which uvicorn offers;
a server without it gets a plain close (uvicorn answers that 403 with an empty
body). Refuses everything but the handshake: any other scope is the shells'.
"""

from __future__ import annotations

from typing import Any

from app.domain.errors import DomainError
from app.domain.wire import jsonio

PROBLEM = b"application/problem+json"


class WebSocketRefused(DomainError):
    """A WebSocket handshake: not served, not proxied."""

    slug = "websocket-refused"
    status = 403
    title = "WebSocket not served"


async def refuse_websocket(scope: dict[str, Any], receive: Any, send: Any, detail: str) -> None:
    """Answer a `websocket` scope's handshake 403 problem+json saying `detail`."""
    await receive()  # websocket.connect
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    body = jsonio.dumps_bytes(WebSocketRefused(detail).problem())
    await send({"type": "websocket.http.response.start", "status": WebSocketRefused.status,
                "headers": [(b"content-type", PROBLEM),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "websocket.http.response.body", "body": body})


class RefuseWebSocket:
    """ASGI middleware: a `websocket` scope is refused (`refuse_websocket`); everything
    else goes on to `app`."""

    def __init__(self, app: Any, detail: str) -> None:
        self.app = app
        self.detail = detail

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await refuse_websocket(scope, receive, send, self.detail)
            return
        await self.app(scope, receive, send)
