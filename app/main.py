"""The ASGI application: routers, problem handlers, body limit, store services."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app import __version__
from app.api import (
    analytics,
    feed,
    gates,
    health,
    history,
    problems,
    samples,
    sessions,
    telemetry,
)
from app.api.auth import BearerAuth, TokenTable
from app.api.limits import BodyLimit
from app.api.problems import JSONText
from app.services import build_services
from app.settings import Settings, get_settings


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    svc = build_services(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Everything imported and built so far lives as long as the process: out of
        # the collector's sight, a full collection (triggered by the containers a
        # 2k-token turn decodes into) costs ~0.1 ms instead of ~20 (docs/ingest.md).
        gc.collect()
        gc.freeze()
        yield
        await svc.db.dispose()

    app = FastAPI(
        title="turnlog",
        version=__version__,
        description="Event-sourced session store for agentic RL rollouts.",
        default_response_class=JSONText,
        lifespan=lifespan,
    )
    app.state.services = svc
    problems.install(app)
    # Added innermost first: metrics see every answer, auth refuses before the body is read.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BearerAuth, tokens=TokenTable(settings.token_scopes))
    app.add_middleware(telemetry.RequestMetrics, metrics=svc.metrics)
    for module in (health, telemetry, sessions, samples, feed, analytics, history, gates):
        app.include_router(module.router)
    return app


def create_served_app() -> FastAPI:
    """The factory `turnlog serve` gives uvicorn: JSON logs in every worker process first."""
    from app.logs import configure_logging

    configure_logging()
    return create_app()
