"""Body size and time limits, enforced before any body is parsed (pure ASGI middleware).

Each read of a body that is still arriving must deliver within `timeout`
seconds, or the request is answered 408 and its connection closed: a client
that declares 1,000 bytes and sends 10 no longer holds a connection forever.
Once the body is complete, reads pass through untimed (a streaming reply
listens for the disconnect for as long as it runs).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.http_errors import RequestTimeout
from app.api.problems import send_problem
from app.domain.errors import TooLarge


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_problem(send, self._error(int(declared)))
            return
        seen, complete = 0, False

        async def counted() -> Message:
            # A chunked body without Content-Length is counted as it streams in; the
            # domain error reaches the problem+json handler before anything is parsed.
            nonlocal seen, complete
            if complete or self.timeout is None:
                message = await receive()
            else:
                try:
                    # A timeout scope, not `wait_for`: no task per chunk (a 3 MB body
                    # arrives in ~50 reads).
                    async with asyncio.timeout(self.timeout):
                        message = await receive()
                except TimeoutError:
                    raise RequestTimeout(
                        f"request body not received: no data for {self.timeout} s",
                        field="body", expected=f"the next bytes within {self.timeout} s",
                        actual=f"{seen} bytes, then silence") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > self.max_bytes:
                    raise self._error(seen)
            else:
                complete = True
            return message

        await self.app(scope, counted, send)

    def _error(self, size: int) -> TooLarge:
        return TooLarge(
            f"request body exceeds the limit of {self.max_bytes} bytes",
            field="body", expected=f"at most {self.max_bytes} bytes", actual=size,
        )
