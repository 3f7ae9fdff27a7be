"""RFC 9457 problem+json: the one place domain errors become HTTP answers."""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.domain import jsonio
from app.domain.errors import DomainError

PROBLEM = "application/problem+json"
log = structlog.get_logger("turnlog.api")


class JSONText(JSONResponse):
    """JSON rendered ASCII-only, so any stored string (even a lone surrogate) encodes."""

    def render(self, content: Any) -> bytes:
        return jsonio.dumps(content).encode("ascii")


def problem_response(body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONText:
    return JSONText(body, status_code=int(body["status"]), media_type=PROBLEM, headers=headers)


def _field_of(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def install(app: FastAPI) -> None:
    @app.exception_handler(DomainError)
    async def _domain(_request: Request, exc: DomainError) -> JSONText:
        return problem_response(exc.problem())

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONText:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid", "type": "invalid"}
        field = _field_of(tuple(first.get("loc", ())))
        return problem_response({
            "type": "urn:turnlog:invalid-request",
            "title": "Invalid request",
            "status": 422,
            "detail": f"{field}: {first.get('msg')}",
            "field": field,
            "expected": first.get("type"),
            "actual": _short(first.get("input")),
        })

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONText:
        slug = {404: "not-found", 405: "method-not-allowed", 413: "too-large"}.get(
            exc.status_code, "http-error")
        return problem_response({
            "type": f"urn:turnlog:{slug}",
            "title": str(exc.detail),
            "status": exc.status_code,
            "detail": str(exc.detail),
        }, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONText:
        log.exception("unhandled error", path=request.url.path, error=repr(exc))
        return problem_response({
            "type": "urn:turnlog:internal",
            "title": "Internal error",
            "status": 500,
            "detail": "the server failed to answer this request; it has been logged",
        })


def _short(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."
