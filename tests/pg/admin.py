"""Admin work on a running server over asyncpg: create and drop test databases.

Everything here can be called from synchronous code and from inside a running
event loop: the work runs on a helper thread with its own loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy.engine import URL, make_url

from tests.pg.common import CONNECT_TIMEOUT_S, PostgresServer

_T = TypeVar("_T")


def create_database(server: PostgresServer, name: str) -> str:
    """Create a fresh, empty database ``name`` (dropping any existing one first).

    Returns the database's ``postgresql+asyncpg://`` URL.
    """
    admin = make_url(server.url)
    ident = quote_ident(name)

    async def work() -> None:
        conn = await connect(admin)
        try:
            await _terminate_and_drop(conn, name, ident)
            await conn.execute(f"CREATE DATABASE {ident} TEMPLATE template0 ENCODING 'UTF8'")
        finally:
            await conn.close()

    run_in_thread(work)
    return admin.set(database=name).render_as_string(hide_password=False)


def drop_database(server: PostgresServer, name: str) -> None:
    """Terminate all connections to ``name`` and drop it if it exists."""
    admin = make_url(server.url)
    ident = quote_ident(name)

    async def work() -> None:
        conn = await connect(admin)
        try:
            await _terminate_and_drop(conn, name, ident)
        finally:
            await conn.close()

    run_in_thread(work)


def quote_ident(name: str) -> str:
    if not name or "\x00" in name:
        raise ValueError(f"invalid database name: {name!r}")
    return '"' + name.replace('"', '""') + '"'


async def connect(url: URL) -> Any:
    import asyncpg

    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    return await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT_S)


async def _terminate_and_drop(conn: Any, name: str, ident: str) -> None:
    for attempt in range(5):
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {ident}")
            return
        except Exception as exc:
            # ObjectInUseError: a client reconnected between terminate and drop; retry.
            if type(exc).__name__ != "ObjectInUseError" or attempt == 4:
                raise
            await asyncio.sleep(0.1 * (attempt + 1))


def run_in_thread(fn: Callable[[], Awaitable[_T]]) -> _T:
    """Run ``fn()`` to completion on a fresh event loop in a helper thread."""
    result: list[_T] = []
    error: list[BaseException] = []

    async def main() -> _T:
        return await fn()

    def target() -> None:
        try:
            result.append(asyncio.run(main()))
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="pgserver-admin", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
