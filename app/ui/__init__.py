"""The web UI: session lists, trees, token lanes, samples and run views under `/ui`.

Served by the API process from files inside the package (templates and
static scripts travel in the wheel; nothing comes from a CDN). `install`
adds the routes and the static files; `app.ui.guard.UiGuard` (added with
the other middleware in `app.main`) sets the security headers and checks tokens.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles


def install(app: FastAPI) -> None:
    from app.ui.pages import STATIC, router

    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
