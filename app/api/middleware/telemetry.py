"""Per-route request metrics: every HTTP request counted and timed by route template.

Requests are counted by route template (`/v1/sessions/{session_id}/turns`),
never by raw path, so the label set stays bounded; an unmatched path counts
as `<unmatched>`. Owns no rule: it only observes what the handlers answered.
Refuses the scrape itself (`app.api.routes.metrics`) and the append's log line
(`app.api.routes.append_log`).
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.metrics import ApiMetrics

UNMATCHED = "<unmatched>"


class RequestMetrics:
    """Pure ASGI middleware: count and time every HTTP request by route template."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception escaping the app becomes a 500 further out

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            method = scope["method"]
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - started)
