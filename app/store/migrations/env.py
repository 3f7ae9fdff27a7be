"""Alembic environment: async, one chain for SQLite and PostgreSQL.

The URL comes from `config.attributes["url"]`, else TURNLOG_DATABASE_URL. When
the caller hands over a connection (`config.attributes["connection"]`), the
migration runs on it (connection sharing, used by the app and the tests).
SQLite runs in batch mode so ALTERs work there.
"""

import asyncio

from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from alembic import context
from app.settings import get_settings
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


async def run_async_migrations(url: str) -> None:
    from app.store.engine.migrate import NotTurnlogDatabase, foreign_tables

    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        # Judged on a connection of its own (its reads end with it), before anything
        # is written: a database that is not turnlog's is left as it was.
        async with engine.connect() as connection:
            refusal = await connection.run_sync(foreign_tables)
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
