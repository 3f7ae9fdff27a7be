"""The applications of a process share the routes their modules built
(`app.api.routes.add_routes`), and every route answers as the application's default
would have it: `JSONText` unless the route names its own response class."""

from __future__ import annotations

from pathlib import Path

from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from app.api.problems import JSONText
from app.main import create_app
from app.settings import Settings


def app_routes(tmp_path: Path) -> list[object]:
    settings = Settings.load(database_url=f"sqlite+aiosqlite:///{tmp_path / 'r.db'}",
                             migrate_on_start=False, api_tokens="")
    return list(create_app(settings).router.routes)


def test_every_route_is_added_as_built_none_wrapped_per_application(tmp_path):
    first, second = app_routes(tmp_path), app_routes(tmp_path)
    # An included router is built again on each application's first request.
    wrapped = [type(r).__name__ for r in first if not hasattr(r, "path")]
    assert wrapped == []
    again = {id(r) for r in second}
    # Only the application's own `GET /` (app.ui.install) is made per application.
    assert [r.path for r in first if isinstance(r, APIRoute) and id(r) not in again] == ["/"]


def test_a_route_without_its_own_response_class_answers_json_text(tmp_path):
    """The application's default (`JSONText`) no longer reaches a router's routes: each
    router names it (a router that does not gives its routes FastAPI's JSONResponse)."""
    routes = [r for r in app_routes(tmp_path) if isinstance(r, APIRoute)]
    assert sum(r.response_class is JSONText for r in routes) > 40
    assert [r.path for r in routes if r.response_class is JSONResponse] == []
