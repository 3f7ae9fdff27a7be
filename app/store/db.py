"""Engines and transactions, one configuration per dialect chosen from the URL.

SQLite (embedded default): WAL, `foreign_keys=ON`, `synchronous=FULL`, a
busy timeout, and `BEGIN IMMEDIATE` for writes so a writer never upgrades a
read lock mid-transaction; in-process writers queue on an asyncio lock
instead of spinning on the busy timeout. PostgreSQL (asyncpg): READ
COMMITTED, pre-ping, statement and idle-in-transaction timeouts so no append
can hold the feed fence for long. Everything dialect-specific about
connections lives here; dialect-specific SQL lives in `dialect.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from app.settings import Settings


def normalize_url(url: str) -> str:
    """Accept plain `postgres://`, `postgresql://` and `sqlite://` URLs and pick the
    async drivers (`postgres://` is what Heroku-style environments hand out)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "postgres":
        parsed, backend = parsed.set(drivername="postgresql+asyncpg"), "postgresql"
    if backend == "postgresql" and parsed.drivername != "postgresql+asyncpg":
        parsed = parsed.set(drivername="postgresql+asyncpg")
    elif backend == "sqlite" and parsed.drivername != "sqlite+aiosqlite":
        parsed = parsed.set(drivername="sqlite+aiosqlite")
    elif backend not in ("postgresql", "sqlite"):
        raise ValueError(f"unsupported database {backend!r}: use sqlite or postgresql")
    return parsed.render_as_string(hide_password=False)


def _sqlite_engine(url: str, *, immediate: bool) -> AsyncEngine:
    engine = create_async_engine(url, connect_args={"timeout": 60}, poolclass=NullPool
                                 if ":memory:" in url else None)

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        for pragma in ("journal_mode=WAL", "foreign_keys=ON", "synchronous=FULL",
                       "busy_timeout=60000"):
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def _postgres_engine(url: str, settings: Settings) -> AsyncEngine:
    server_settings = {
        "application_name": "turnlog",
        "idle_in_transaction_session_timeout": "30000",
    }
    if settings.statement_timeout_ms:
        server_settings["statement_timeout"] = str(settings.statement_timeout_ms)
    return create_async_engine(
        url,
        pool_size=settings.pool_size,
        max_overflow=settings.max_overflow,
        pool_pre_ping=True,
        pool_recycle=1800,
        isolation_level="READ COMMITTED",
        connect_args={"server_settings": server_settings, "command_timeout": 120},
    )


class Database:
    """The store's handle on one database: a writer and a reader engine."""

    def __init__(self, url: str, settings: Settings) -> None:
        self.url = normalize_url(url)
        self.dialect = make_url(self.url).get_backend_name()
        self.is_sqlite = self.dialect == "sqlite"
        if self.is_sqlite:
            self.writer = _sqlite_engine(self.url, immediate=True)
            self.reader = _sqlite_engine(self.url, immediate=False)
        else:
            self.writer = self.reader = _postgres_engine(self.url, settings)
        self._write_lock = asyncio.Lock() if self.is_sqlite else None

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """One short write transaction; committed on success, rolled back on error."""
        if self._write_lock is not None:
            async with self._write_lock, self.writer.begin() as conn:
                yield conn
        else:
            async with self.writer.begin() as conn:
                yield conn

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A read-only transaction with one consistent snapshot on SQLite."""
        async with self.reader.connect() as conn:
            try:
                yield conn
            finally:
                await conn.rollback()

    async def dispose(self) -> None:
        await self.writer.dispose()
        if self.reader is not self.writer:
            await self.reader.dispose()
