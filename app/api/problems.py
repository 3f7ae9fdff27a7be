"""RFC 9457 problem+json: the one place domain errors become HTTP answers."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import asyncpg
import structlog
from asyncpg.exceptions import (
    InsufficientResourcesError,
    InternalClientError,
    InternalServerError,
    OperatorInterventionError,
)
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from app.api.http_errors import Overloaded, RequestTimeout, Unavailable
from app.api.middleware.methods import allowed_methods
from app.api.problem_wire import PROBLEM
from app.domain.errors import DomainError, InvalidRequest
from app.domain.wire import jsonio
from app.store.engine.dialect import SQLITE_BUSY_S
from app.store.engine.disk import chain as _chain
from app.store.engine.disk import disk_full
from app.store.engine.sqlite_files import DatabaseFileReplaced, SqliteBusy

# Seconds a client should wait after a lost database connection (the pool
# reconnects on the next checkout, pre-ping weeds out dead connections).
UNAVAILABLE_RETRY_AFTER = "1"
log = structlog.get_logger("turnlog.api")
CLIENT_CLOSED = 499
UNAVAILABLE_LOG_PERIOD = 5.0  # seconds between "database unavailable" warnings
# Error texts of a damaged SQLite file (sqlite3.DatabaseError, SQLITE_CORRUPT/NOTADB).
SQLITE_DAMAGE = ("malformed", "not a database", "corrupt")
# Texts of asyncpg's InternalClientError when a connection's protocol broke under a
# call: the server ended the backend mid-message (a terminate, a restart) before the
# driver read the socket's end. Any other InternalClientError is a bug (500).
BROKEN_PROTOCOL = ("cannot switch to state", "protocol is in an unexpected state",
                   "unknown error in protocol implementation")
# What Citus's coordinator says (SQLSTATE XX000, "internal error") when a worker node it
# needs went away mid-statement or at commit, or its own postmaster died under a
# statement: the node is lost, not the statement bad. Retrying is safe (every write is
# idempotent), and the outcome may be that it landed.
CITUS_NODE_LOST = ("at least one active node", "connection to the remote node",
                   "could not establish any connections to the node",
                   "failed to commit transaction on", "remote transaction",
                   "postmaster was shut down")
# Failures that mean "the database cannot answer now": each gets the 503 handler,
# which still answers 500 for anything `database_unavailable` does not recognize.
UNAVAILABLE_TYPES: tuple[type[BaseException], ...] = (
    DBAPIError, OSError, PoolTimeout, asyncpg.PostgresError, asyncpg.InterfaceError,
    InternalClientError)


class JSONText(JSONResponse):
    """JSON that renders any stored string (even a lone surrogate, escaped)."""

    def render(self, content: Any) -> bytes:
        return jsonio.dumps_bytes(content)


def problem_response(body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONText:
    return JSONText(body, status_code=int(body["status"]), media_type=PROBLEM, headers=headers)


def _field_of(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts) or "body"


def install(app: FastAPI) -> None:
    # One throttle per app: a burst of failures is one warning every few seconds.
    warn_unavailable = _Throttle(UNAVAILABLE_LOG_PERIOD)

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
            "expected": _expected(first),
            "actual": _short(first.get("input")),
        })

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONText:
        slug = {404: "not-found", 405: "method-not-allowed", 413: "too-large"}.get(
            exc.status_code, "http-error")
        return problem_response({
            "type": f"urn:turnlog:{slug}",
            "title": str(exc.detail),
            "status": exc.status_code,
            "detail": _routing_detail(app, request, exc),
        }, headers=_allow(app, request, exc))

    async def _unavailable(request: Request, exc: Exception) -> JSONText:
        if sqlite_overflow(exc):
            # Not transient: SQLite's SUM of integers stops at 2^63 (PostgreSQL's is exact).
            return problem_response(InvalidRequest(
                "the totals this request sums are beyond SQLite's 64-bit integers",
                field="query",
                expected="a narrower query (a label filter, a time range), or PostgreSQL",
                actual="integer overflow").problem())
        if not database_unavailable(exc):
            return await _unexpected(request, exc)
        # Transient: the transaction was rolled back (or its commit is unknown);
        # a retry with the same body is safe because every write is idempotent.
        warn_unavailable(request.url.path, exc)
        replaced = next((c for c in _chain(exc) if isinstance(c, DatabaseFileReplaced)),
                        None)
        if replaced is not None:
            # Not transient: every write of this process would be lost; said as it is.
            return unavailable_response(str(replaced))
        busy = sqlite_busy(exc)
        if busy is not None:
            # Said as it is: another process holds the file's lock; the connection is fine.
            return unavailable_response(str(busy))
        if disk_full(exc):
            # Said as it is: no retry succeeds until someone frees space.
            return unavailable_response(
                "the database's disk is full: nothing of this request was stored; free "
                "space on the database's disk, then retry it unchanged")
        if clock_behind(exc):
            # Not transient either: the store was restored onto another server and not
            # migrated since; no retry succeeds until `turnlog migrate` moves its clock.
            return unavailable_response(
                "the store's transaction clock is behind this database server's ids (a "
                "restore onto another server): nothing of this request was stored; run "
                "`turnlog migrate` on the database, then retry it unchanged")
        if rolled_back(exc):
            return unavailable_response(
                "the database rolled this request back (a conflict with a concurrent "
                f"write); {_retry_hint(request.method)}")
        return unavailable_response(
            f"the database connection failed during this request; {_retry_hint(request.method)}")

    for kind in UNAVAILABLE_TYPES:
        app.add_exception_handler(kind, _unavailable)  # type: ignore[arg-type]

    @app.exception_handler(Unavailable)
    async def _store_unavailable(request: Request, exc: Unavailable) -> JSONText:
        warn_unavailable(request.url.path, exc)
        return problem_response(exc.problem(), headers={"Retry-After": UNAVAILABLE_RETRY_AFTER})

    @app.exception_handler(Overloaded)
    async def _overloaded(_request: Request, exc: Overloaded) -> JSONText:
        # A large body that waited too long for an upload slot: its bytes were never
        # read, and may be hundreds of MB still on their way; the client retries anew.
        return problem_response(exc.problem(), headers={
            "Retry-After": UNAVAILABLE_RETRY_AFTER, "Connection": "close"})

    @app.exception_handler(RequestTimeout)
    async def _timeout(_request: Request, exc: RequestTimeout) -> JSONText:
        # The rest of the body may still be on its way: this connection is done.
        return problem_response(exc.problem(), headers={"Connection": "close"})

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, _exc: ClientDisconnect) -> Response:
        # Not a server error: nobody is listening. The status only reaches the
        # metrics middleware (as 499, nginx's "client closed request").
        log.info("client disconnected mid-request", path=request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONText:
        log.exception("unhandled error", path=request.url.path, error=repr(exc))
        return problem_response({
            "type": "urn:turnlog:internal",
            "title": "Internal error",
            "status": 500,
            "detail": "the server failed to answer this request; it has been logged",
        })


def _retry_hint(method: str) -> str:
    """What a 503's reader may do about a transient failure: a read changes nothing; a
    write sent again with the same body takes effect once (its key: an event's
    `event_id`, a claim's `claim_id`, the path of an open, a group or an ack)."""
    if method in ("GET", "HEAD"):
        return "retry it (a read changes nothing)"
    return ("retry it unchanged (a write sent again with the same body takes effect once: "
            "turns, closes and rewards by event_id, claims by claim_id)")


# Where a raw `OSError` must come from to mean "the database": its driver, the pool,
# the store. Anywhere else (a local file, a socket of ours) it is a server error.
DATABASE_MODULES = ("sqlalchemy", "asyncpg", "aiosqlite", "sqlite3", "app.store")


def raised_by_database(exc: BaseException) -> bool:
    """`exc` was raised inside the database path (a frame of its traceback is)."""
    tb = exc.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module.startswith(DATABASE_MODULES):
            return True
        tb = tb.tb_next
    return False


def database_unavailable(exc: BaseException) -> bool:
    """A lost, refused or damaged database (retryable later), not a bad statement.

    Looks through the chain (`_chain`): a pool or connect failure may surface as the
    raw `OSError`.
    """
    for current in _chain(exc):
        if isinstance(current, DBAPIError) and current.connection_invalidated:
            return True
        if isinstance(current, OperationalError | InterfaceError | PoolTimeout
                      | asyncpg.PostgresConnectionError | asyncpg.InterfaceError
                      | OperatorInterventionError | InsufficientResourcesError
                      # rolled back whole (a deadlock, or a transaction behind the
                      # store's clock just after a restore): the retry is safe
                      | asyncpg.exceptions.TransactionRollbackError
                      # a lock not granted in time (the store's clock moving at a new
                      # connection waits for writers in flight, at most 30 s)
                      | asyncpg.exceptions.LockNotAvailableError):
            return True
        if isinstance(current, OSError) and raised_by_database(current):
            return True
        if isinstance(current, sqlite3.DatabaseError) and damaged_sqlite(current):
            return True
        if isinstance(current, InternalClientError) and any(
                sign in str(current) for sign in BROKEN_PROTOCOL):
            return True
        if isinstance(current, InternalServerError) and any(
                sign in str(current) for sign in CITUS_NODE_LOST):
            return True
    return False


# What migration 0012's position function raises for a writer behind the store's clock.
CLOCK_BEHIND = "is behind the store's clock"


def clock_behind(exc: BaseException) -> bool:
    """A write refused because the store's clock is behind the server's ids (a restore
    not migrated since), anywhere in the chain."""
    return any(isinstance(current, asyncpg.exceptions.SerializationError)
               and CLOCK_BEHIND in str(current) for current in _chain(exc))


def rolled_back(exc: BaseException) -> bool:
    """Rolled back by the database for a conflict (a deadlock, a serialization
    failure), anywhere in the chain."""
    return any(isinstance(current, asyncpg.exceptions.TransactionRollbackError)
               for current in _chain(exc))


def sqlite_busy(exc: BaseException) -> SqliteBusy | None:
    """A SQLite write that waited its whole busy timeout (`SqliteBusy`, or SQLite's own
    "database is locked"), anywhere in the chain; as `SqliteBusy`."""
    for current in _chain(exc):
        if isinstance(current, SqliteBusy):
            return current
        if isinstance(current, sqlite3.OperationalError) \
                and str(current).startswith("database is locked"):
            return SqliteBusy(None, SQLITE_BUSY_S)
    return None


def sqlite_overflow(exc: BaseException) -> bool:
    """SQLite's SUM past 2^63 ("integer overflow"), anywhere in the chain."""
    return any(isinstance(current, sqlite3.OperationalError)
               and str(current) == "integer overflow" for current in _chain(exc))


def damaged_sqlite(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(sign in text for sign in SQLITE_DAMAGE)


def unavailable_response(detail: str) -> JSONText:
    return problem_response(Unavailable(detail).problem(),
                            headers={"Retry-After": UNAVAILABLE_RETRY_AFTER})


class _Throttle:
    """One warning per `period` seconds for a burst of the same failure, with a count."""

    def __init__(self, period: float) -> None:
        self.period = period
        self.last = -period
        self.suppressed = 0

    def __call__(self, path: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self.last < self.period:
            self.suppressed += 1
            return
        # No traceback: the cause is the database, the error's name says which way.
        log.warning("database unavailable", path=path, error=type(exc).__name__,
                    cause=type(getattr(exc, "orig", None) or exc.__cause__ or exc).__name__,
                    suppressed_since_last=self.suppressed)
        self.last, self.suppressed = now, 0



# pydantic's error codes name its parser, not what the client should send.
_EXPECTED = {"int_parsing": "integer", "int_type": "integer", "float_parsing": "number",
             "float_type": "number", "bool_parsing": "boolean", "bool_type": "boolean",
             "string_type": "string", "missing": "a value (required)",
             "greater_than_equal": "integer >= {ge}", "greater_than": "number > {gt}",
             "less_than": "number < {lt}", "less_than_equal": "number <= {le}"}


def _expected(error: Any) -> Any:
    code = error.get("type")
    template = _EXPECTED.get(code)
    if template is None:
        return code
    try:
        return template.format(**(error.get("ctx") or {}))
    except (KeyError, IndexError):
        return code


def _allow(app: FastAPI, request: Request, exc: StarletteHTTPException
           ) -> dict[str, str] | None:
    """A 405's `Allow`: every method the path is served with, not only the first
    matching route's (`app.api.middleware.methods`)."""
    headers = getattr(exc, "headers", None)
    if exc.status_code != 405:
        return headers
    methods = allowed_methods(app.router.routes, request.scope)
    return {**(headers or {}), "Allow": ", ".join(methods)} if methods else headers


def _routing_detail(app: FastAPI, request: Request, exc: StarletteHTTPException) -> str:
    """A routing 404/405 names the method and path (and the slash-less route, if any)."""
    method, path = request.method, request.url.path
    if exc.status_code == 405:
        return f"{method} is not allowed on {path}"
    if exc.status_code != 404 or exc.detail != "Not Found":
        return str(exc.detail)
    if path.endswith("/") and path != "/":
        from starlette.routing import Match

        scope = {**request.scope, "path": path.rstrip("/")}
        if any(route.matches(scope)[0] is not Match.NONE for route in app.router.routes):
            return (f"no route {method} {path}: drop the trailing slash "
                    f"({method} {path.rstrip('/')})")
    return f"no route {method} {path} (the routes are listed at /docs)"


def _short(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."
