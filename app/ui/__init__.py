"""The web UI: session lists, trees, token lanes, samples and run views under `/ui`.

Served by the API process from files inside the package (templates and
static scripts travel in the wheel; nothing comes from a CDN). `install`
adds the routes, the static files and `GET /` (a browser pointed at the
server lands on the UI, not on a JSON 404); `app.ui.guard.UiGuard` (added with
the other middleware in `app.main`) sets the security headers and checks tokens.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles


def install(app: FastAPI) -> None:
    from app.api.routes import add_routes
    from app.ui.pages import STATIC, router

    add_routes(app, router)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui", status_code=307)

    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
