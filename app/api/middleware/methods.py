"""Which methods a path answers: HEAD wherever GET is, and a 405 that lists them all.

FastAPI's routes answer only the methods they declare, so a HEAD on a GET
route was a 405, although HTTP (RFC 9110 §9.1) has every server that answers
GET answer HEAD. `HeadAsGet` routes a HEAD as its GET; uvicorn sends the
headers of the GET's answer without its body (it drops the body of any answer
to a HEAD). It is the innermost middleware: the route sees a GET, while the
middlewares before it (authorization, where HEAD reads as GET does; metrics)
and the access log see the HEAD.

Starlette answers a method a path does not serve with 405 and an `Allow` of
the first route whose path matched, so `DELETE /v1/sessions` said `Allow:
POST` although `GET /v1/sessions` is served too. `allowed_methods` is every
route's methods for the path, for the 405's `Allow` (`app.api.problems`).

Refuses: nothing; every other method goes on unchanged.
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send


class HeadAsGet:
    """A HEAD request is routed as the GET of the same URL."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


# The methods a route may serve; each is tried against the path to find which are.
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(routes: list[BaseRoute], scope: Scope) -> list[str]:
    """The methods some route serves at the scope's path (HEAD beside GET), sorted.
    Asked of each route as routing asks (`matches`), so included routers and the
    bare append route answer too."""
    methods = {method for method in METHODS
               if any(route.matches({**scope, "method": method})[0] is Match.FULL
                      for route in routes)}
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)
