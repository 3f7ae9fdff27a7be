"""The UI's Jinja2 environment and the pages both the router and the guard answer with.

Templates load from the package (`app/ui/templates`) and autoescape every
value, SVG included: labels, ids and record text are user data.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any
from urllib.parse import urlencode

from fastapi.responses import HTMLResponse
from jinja2 import Environment, PackageLoader, StrictUndefined

from app.domain.body.labels import label_text
from app.domain.errors import DomainError
from app.ui.views import text_of, visible_controls

# `finalize`: every value a template writes shows its directional controls as codes.
templates = Environment(loader=PackageLoader("app.ui", "templates"), autoescape=True,
                        undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                        finalize=visible_controls)
templates.globals.update(text_of=text_of, label_text=label_text, urlencode=urlencode)


def utf8(text: str) -> bytes:
    """A rendered page as UTF-8. Stored text may hold a lone surrogate (valid in a JSON
    escape, not in UTF-8): it shows as its escape (`\\ud800`), not as a 500."""
    return text.encode("utf-8", "backslashreplace")


# Set by the guard for a page request it let in on the UI's cookie: the page offers a
# sign-out button (`POST /ui/logout`). A request with a bearer header has nothing to
# sign out of.
SIGNED_IN: ContextVar[bool] = ContextVar("turnlog_ui_signed_in", default=False)


def render(template: str, code: int = 200, **context: Any) -> HTMLResponse:
    context.setdefault("signed_in", SIGNED_IN.get())
    return HTMLResponse(utf8(templates.get_template(template).render(**context)),
                        status_code=code)


def error_page(exc: DomainError) -> HTMLResponse:
    return render("error.html", exc.http_status, error=exc.problem())


def login_page(path: str, query: bytes, *, error: bool) -> HTMLResponse:
    """The 401 answer to a page request without a valid read token."""
    target = path + ("?" + query.decode("latin-1") if query else "")
    return render("login.html", 401, next=target, error=error)
