"""The routers: one module per resource, each handler parse -> store -> reply.

Owns the REST routes, the append's bare ASGI hot path (`hotpath`) and its log
line (`append_log`), the Prometheus scrape (`metrics`) and the OpenAPI
documentation (`docs`, `docs_ui`).
Refuses cross-cutting concerns (those are `middleware`); errors are mapped
once, in `app.api.problems`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import APIRouter, FastAPI


def add_routes(app: FastAPI, router: APIRouter) -> None:
    """A router's routes, as its module built them, added to `app` as they are.

    `include_router` wraps a router for each application, and FastAPI (0.165) builds
    every route of it again on that application's first request: ~30-40 ms of CPU per
    application, paid by every test that makes one. The routes are complete when their
    module is imported (the router's prefix, tags, and `JSONText` as the response
    class, as the application's default would give them) and hold nothing of an
    application (no dependency overrides), so the applications of a process share
    them."""
    app.router.routes.extend(router.routes)
