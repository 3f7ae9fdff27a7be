"""Alembic environment: async, one chain for SQLite and PostgreSQL.

The URL comes from `config.attributes["url"]`, else TURNLOG_DATABASE_URL. When
the caller hands over a connection (`config.attributes["connection"]`), the
migration runs on it (connection sharing, used by the app and the tests).
SQLite runs in batch mode so ALTERs work there.
"""

import asyncio
import contextlib
import fcntl
from collections.abc import Iterator

import sqlalchemy as sa
from sqlalchemy import pool
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import create_async_engine

from alembic import context
from app.settings import get_settings
from app.store.engine.dialect import MIGRATION_LOCK, RECLOCK, RECLOCK_ON_CONNECT
from app.store.engine.schema import metadata

config = context.config
target_metadata = metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        transaction_per_migration=True,
    )


def do_run_migrations(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()
    _reclock(connection)


def _reclock(connection: Connection) -> None:
    """The store's transaction clock ahead of every stamped row (migration 0012), on
    every migration run: after a restore onto another server, whose transaction ids
    may be far behind the restored rows', `turnlog migrate` (or a start of `serve` /
    `gateway`) puts it right before anything is written."""
    if connection.dialect.name != "postgresql":
        return
    # From 0014 on, the full reclock only when the server may be behind (after a crash,
    # a restart, a restore): a migrate at head then needs no Citus worker up.
    connection.exec_driver_sql(RECLOCK_ON_CONNECT)
    connection.exec_driver_sql(RECLOCK)  # before 0014 (a downgrade's target): 0012's
    connection.commit()


@contextlib.contextmanager
def _sqlite_file_locked(url: str) -> Iterator[None]:
    """One migrating process at a time on a SQLite file: an exclusive `flock` on the
    file itself (SQLite's own locks are POSIX record locks, which it does not touch;
    PostgreSQL's: `MIGRATION_LOCK`). Two processes started together on a new file
    (`turnlog serve` and `turnlog gateway`) both created tables: "table sessions already exists"."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        yield
        return
    with open(parsed.database or "", "ab") as handle:  # an empty file is a new database
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


async def run_async_migrations(url: str) -> None:
    from app.store.engine.migrate import NotTurnlogDatabase, foreign_tables

    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        with _sqlite_file_locked(url):
            async with engine.connect() as guard:
                if guard.dialect.name == "postgresql":
                    await guard.execute(sa.text(f"SELECT pg_advisory_lock({MIGRATION_LOCK})"))
                    await guard.commit()  # the session-level lock stays; its reads end
                # Judged before anything is written (a database that is not turnlog's is
                # left as it was), and after any other process's migration finished.
                refusal = await guard.run_sync(foreign_tables)
                await guard.rollback()
                if refusal is not None:
                    raise NotTurnlogDatabase(refusal)
                async with engine.connect() as connection:
                    await connection.run_sync(do_run_migrations)
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        do_run_migrations(connection)
        return
    url = config.attributes.get("url") or get_settings().store.database_url
    asyncio.run(run_async_migrations(url))


if context.is_offline_mode():
    context.configure(
        url=config.attributes.get("url") or get_settings().store.database_url,
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
