"""Body size limit, enforced before any body is parsed (pure ASGI middleware)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.problems import send_problem
from app.domain.errors import TooLarge


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_problem(send, self._error(int(declared)))
            return
        seen = 0

        async def counted() -> Message:
            # A chunked body without Content-Length is counted as it streams in; the
            # domain error reaches the problem+json handler before anything is parsed.
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error(seen)
            return message

        await self.app(scope, counted, send)

    def _error(self, size: int) -> TooLarge:
        return TooLarge(
            f"request body exceeds the limit of {self.max_bytes} bytes",
            field="body", expected=f"at most {self.max_bytes} bytes", actual=size,
        )
