"""problem+json answered straight over ASGI: the FastAPI-free half of `app.api.problems`.

The HTTP guards in front of every route (header and body bounds, auth, the UI's
guard) answer before any route runs, and `turnlog gateway` serves through the same
guarded protocol without FastAPI at all; importing FastAPI (its models build
their schemas at import) only for this would cost every gateway process ~0.3 s of
CPU at start. The media type and the rendering of a `DomainError` are the ones
`app.api.problems` uses for route answers.
"""

from __future__ import annotations

from starlette.types import Send

from app.domain.errors import DomainError
from app.domain.wire import jsonio

PROBLEM = "application/problem+json"


async def send_problem(send: Send, error: DomainError,
                       headers: dict[str, str] | None = None) -> None:
    """Answer with `error` straight from ASGI middleware, before any route runs."""
    body = jsonio.dumps_bytes(error.problem())
    raw = [(b"content-type", PROBLEM.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": error.http_status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
