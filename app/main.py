"""The ASGI application: routers, problem handlers, body limit, store services."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app import __version__, ui
from app.access import TokenTable
from app.api import problems
from app.api.deps import Uploads
from app.api.middleware import telemetry
from app.api.middleware.auth import BearerAuth
from app.api.middleware.guards import HeaderBounds, Loopback, QueryOnce, QueryTokens
from app.api.middleware.limits import BodyLimit, WriteDeadline
from app.api.middleware.methods import HeadAsGet
from app.api.problems import JSONText
from app.api.routes import (
    add_routes,
    analytics,
    consumers,
    docs_ui,
    feed,
    gates,
    health,
    history,
    hotpath,
    metrics,
    openapi_problems,
    retention,
    samples,
    sessions,
)
from app.services import build_services
from app.settings import Settings, get_settings
from app.settle import settle
from app.ui.guard import UiGuard, UiHeaders
from app.websocket import RefuseWebSocket


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    svc = build_services(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Damage found here is logged now and reported by /readyz (503); the
        # server still starts so the operator can read what is intact.
        with contextlib.suppress(Exception):
            await svc.integrity.problems()
        await settle()  # imports the worker-thread path; freezes what exists (app.settle)
        warming = asyncio.create_task(svc.db.warm())  # connections before the first turns
        yield
        warming.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # logged by warm
            await warming
        await svc.db.dispose()

    app = FastAPI(
        title="turnlog",
        version=__version__,
        description="Event-sourced session store for agentic RL rollouts.",
        default_response_class=JSONText,
        lifespan=lifespan,
        # /docs serves Swagger UI from this server (app.api.routes.docs_ui), never a CDN.
        docs_url=None,
        redoc_url=None,
    )
    app.state.services = svc
    # A trailing slash answers a problem naming the route, never a bodiless 307
    # that a POST client does not follow.
    app.router.redirect_slashes = False
    limits = settings.limits
    app.state.uploads = Uploads(limits.large_body_bytes, limits.max_large_uploads,
                                limits.max_body_values, limits.min_upload_rate,
                                limits.upload_grace_s, limits.offload_body_bytes,
                                limits.body_timeout_s)
    problems.install(app)
    openapi_problems.install(app)  # /openapi.json documents the problems as sent
    # Added innermost first: metrics see every answer; header bounds, tokens in URLs
    # and the loopback guard refuse before auth, auth before the body is read.
    app.add_middleware(HeadAsGet)  # a HEAD is routed as its GET (app.api.middleware.methods)
    app.add_middleware(WriteDeadline)  # from here on, a request's writes keep its deadline
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, timeout=limits.body_timeout_s,
                       min_rate=limits.min_upload_rate, grace=limits.upload_grace_s)
    tokens = TokenTable(settings.access.api_tokens)
    app.add_middleware(QueryOnce)  # a query parameter given twice: 422 (after auth)
    app.add_middleware(BearerAuth, tokens=tokens)
    app.add_middleware(UiGuard, tokens=tokens)  # /ui: the same tokens, or the UI's cookie
    if not tokens:
        app.add_middleware(Loopback, allowed=[settings.server.host, *settings.access.allowed_hosts])
    app.add_middleware(QueryTokens)
    app.add_middleware(HeaderBounds, max_bytes=settings.server.max_header_bytes,
                       max_count=settings.server.max_headers)
    app.add_middleware(UiHeaders)  # every /ui answer, the refusals above included
    app.add_middleware(telemetry.RequestMetrics, metrics=svc.metrics)
    # Outermost: no route speaks WebSocket; a handshake gets a 403 problem, not an empty 403.
    app.add_middleware(RefuseWebSocket, detail="turnlog serves no WebSocket routes; "
                       "use plain HTTP (the feed long-polls: GET /v1/events?wait=…)")
    for module in (health, metrics, sessions, samples, feed, analytics, history, gates,
                   docs_ui, consumers, retention):
        add_routes(app, module.router)
    # Appends first: the bare hot path answers POST …/turns before FastAPI's route of
    # the same path (which documents it and answers its other methods).
    app.router.routes.insert(0, hotpath.AppendRoute(svc, app.state.uploads))
    ui.install(app)
    return app


def create_served_app(settings: Settings) -> FastAPI:
    """The factory `turnlog serve` gives uvicorn (bound to the command's settings, which
    reach every worker process pickled in uvicorn's configuration, never through the
    environment): logging set up in the worker first, then the application."""
    from app import logs

    logs.configure_logging(settings.log.log_level or "info", settings.log.log_format)
    return create_app(settings)
