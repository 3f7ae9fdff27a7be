"""Transactions on one database: a writer and a reader engine, and the store's clock.

`Database.write()` is one short write transaction (queued in process where
the backend has a single writer, and never committed past its request's
deadline, `write_deadline`), `Database.read()` a read-only one, and on
PostgreSQL `Database.driver_pool()` the asyncpg pool the one-round-trip
append calls its function on. How
each backend's engines are configured is `dialect.py`'s; `now_us` is the one
clock every `recorded_us` column is stamped with.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import asyncpg
import sqlalchemy as sa
import structlog
from sqlalchemy.ext.asyncio import AsyncConnection

from app.domain.body.deadline import TIMEOUT_HEADER
from app.domain.errors import DeadlineExceeded
from app.settings import Settings
from app.store.engine import sqlite_files
from app.store.engine.dialect import (
    SQLITE_BUSY_S,
    ConnectionWarmer,
    backend,
    busy_pragma,
    create_driver_pool,
    create_engines,
    normalize_url,
    single_writer,
    sqlite_busy_budget,
    sqlite_path,
)
from app.store.engine.disk import DiskWatch

log = structlog.get_logger("turnlog.store")
# Seconds a warmed connection waits for the others before going back to the pool.
WARM_HOLD_S = 1.0


# When the request being served gives up on its writes (`time.monotonic()`), or None:
# set per request from `X-Turnlog-Timeout` (app.api.middleware.limits.WriteDeadline).
_deadline: ContextVar[float | None] = ContextVar("turnlog_write_deadline", default=None)
# Set inside a `write()` that turned out to write nothing (a repeat answered from what
# is stored): its deadline does not apply, since nothing of it would commit late.
_unwritten: ContextVar[bool] = ContextVar("turnlog_write_unwritten", default=False)


@contextlib.contextmanager
def write_deadline(seconds: float) -> Iterator[None]:
    """Writes made inside commit only within `seconds` from now."""
    token = _deadline.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def has_deadline() -> bool:
    """Whether the writes being made keep a request's deadline."""
    return _deadline.get() is not None


def check_deadline() -> None:
    """Raise DeadlineExceeded if the current write's deadline has passed (nothing if
    it has none)."""
    deadline = _deadline.get()
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(
            f"this write was not committed: its {TIMEOUT_HEADER} ran out while it waited "
            "(a lock the database held, most likely); nothing was stored",
            field=TIMEOUT_HEADER, expected="a commit within the timeout",
            actual=f"not committed {-left:.3f} s after it")


def _before_commit() -> None:
    if not _unwritten.get():
        check_deadline()


def now_us() -> int:
    """Microseconds since the epoch: what every `recorded_us` column holds."""
    return time.time_ns() // 1000


class Database:
    """The store's handle on one database: a writer and a reader engine."""

    def __init__(self, url: str, settings: Settings) -> None:
        self.url = normalize_url(url)
        self.dialect = backend(self.url)
        self.settings = settings
        self.writer, self.reader = create_engines(self.url, settings)
        self._write_lock = asyncio.Lock() if single_writer(self.url) else None
        self._sqlite_path = sqlite_path(self.url) if self.dialect == "sqlite" else None
        # SQLite: whether its disk is full, as the writes found it (`/readyz` reports it).
        self.disk = DiskWatch(self._sqlite_path) if self.dialect == "sqlite" else None
        self._driver_pool: asyncpg.Pool | None = None
        self._driver_pool_lock = asyncio.Lock()
        # Run on each new driver-pool connection: set by the writer, whose calls it warms.
        self.warm_connection: ConnectionWarmer | None = None

    @property
    def one_trip_appends(self) -> bool:
        """An append with a cached state is one call: of `turnlog_append` on PostgreSQL
        (and Citus), of one function on aiosqlite's thread on SQLite."""
        return True

    async def _warm_connection(self, conn: asyncpg.Connection) -> None:
        """`warm_connection`, looked up when each connection opens (set after the pool
        was made, it still applies)."""
        if self.warm_connection is not None:
            await self.warm_connection(conn)

    async def driver_pool(self) -> asyncpg.Pool:
        """The asyncpg pool of the one-round-trip append, opened on first use."""
        if self._driver_pool is None:
            async with self._driver_pool_lock:
                if self._driver_pool is None:
                    pool = await create_driver_pool(self.url, self.settings,
                                                    self._warm_connection)
                    assert pool is not None, "only PostgreSQL has a driver pool"
                    self._driver_pool = pool
        return self._driver_pool

    async def warm(self) -> None:
        """Open the driver pool's connections now, not on the first requests
        (PostgreSQL; SQLite has none): a new connection costs the request that
        opens it ~5 ms, ~20 ms when a rollout's eight sessions open theirs at
        once (`bench/gateway.py`, first turns). Best effort: with the database
        down they are opened on demand later, as before. Cancelled (a shutdown
        while it runs), every connection it holds goes back to the pool first:
        the pool's close waits for them."""
        if self.dialect == "sqlite":
            return
        try:
            pool = await self.driver_pool()
        except Exception as exc:  # the pool itself could not be made: on demand, later
            log.debug("driver pool not warmed", error=type(exc).__name__)
            return
        count = self.settings.store.pool_size
        arrived = 0
        everyone = asyncio.Event()  # all connections are out: each holds its own till then

        def arrive() -> None:
            nonlocal arrived
            arrived += 1
            if arrived == count:
                everyone.set()

        async def hold() -> BaseException | None:
            acquired = False
            try:
                async with pool.acquire():
                    acquired = True
                    arrive()
                    # Held till the others are out (else an acquire takes this one
                    # again), but not while a slow connect keeps requests waiting.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(WARM_HOLD_S):
                            await everyone.wait()
            except Exception as exc:
                if not acquired:
                    arrive()
                return exc
            return None

        failed = [e for e in await asyncio.gather(*(hold() for _ in range(count)))
                  if e is not None]
        if failed:
            log.debug("driver pool partly warmed", failed=len(failed),
                      error=type(failed[0]).__name__)

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """One short write transaction; committed on success, rolled back on error,
        and rolled back (DeadlineExceeded) if the request's deadline passed before the
        commit: its client, gone, cannot be told, and later writes of other clients
        must not be overtaken by it."""
        token = _unwritten.set(False)
        try:
            if self._write_lock is not None:
                assert self.disk is not None
                async with self._queued(), self.disk.watching() as changes, \
                        self.writer.begin() as conn:
                    changes.counted_on(await self._same_files(conn))
                    yield conn
                    _before_commit()
                    changes.ended()  # the commit's failure still marks the disk
            else:
                async with self.writer.begin() as conn:
                    yield conn
                    _before_commit()
        finally:
            _unwritten.reset(token)

    @staticmethod
    def wrote_nothing() -> None:
        """Inside `write()`: this transaction wrote nothing (a repeat answered from the
        stored state), so it is answered even past its request's deadline."""
        _unwritten.set(True)

    @asynccontextmanager
    async def sqlite_writer(self) -> AsyncIterator[Any]:
        """SQLite: the writer's aiosqlite connection, in no transaction, queued like
        `write()`; for the one-call append (`app/store/append/sqlite_path.py`), which
        runs its own `BEGIN IMMEDIATE` … `COMMIT` on it."""
        assert self._write_lock is not None and self.disk is not None, \
            "only SQLite has a single writer"
        async with self._queued(), self.disk.watching() as changes, \
                self.writer.connect() as conn:
            driver = await self._same_files(conn)
            pragma = busy_pragma((await conn.get_raw_connection()).info)
            if pragma is not None:  # the caller runs its own BEGIN IMMEDIATE on it
                await driver.execute(pragma)
            changes.counted_on(driver)
            yield driver
            changes.ended()

    @asynccontextmanager
    async def _queued(self) -> AsyncIterator[None]:
        """SQLite: this process's one writer at a time, the whole wait (in this queue,
        then for the file's lock) at most the busy timeout. Behind a write waiting for
        the file's lock (another process holds it), the N-th in line waited N busy
        timeouts (a tester's finding), and a write that reached the head late started
        a full one of its own (another's): past the budget, `SqliteBusy` (503) while
        queued, SQLite's own "database is locked" once begun; nothing stored."""
        assert self._write_lock is not None
        budget: int | None = None
        try:
            # Held: waited for within the budget. Free: taken at once, no timer to set up.
            if self._write_lock.locked():
                loop = asyncio.get_running_loop()
                queued_at = loop.time()
                async with asyncio.timeout(SQLITE_BUSY_S):
                    await self._write_lock.acquire()
                waited = loop.time() - queued_at
                if waited >= 0.5:  # worth a statement: what is left for the file's lock
                    budget = max(1, int((SQLITE_BUSY_S - waited) * 1000))
            else:
                await self._write_lock.acquire()
        except TimeoutError:
            raise sqlite_files.SqliteBusy(self._sqlite_path, SQLITE_BUSY_S,
                                          queued=True) from None
        token = sqlite_busy_budget.set(budget)
        try:
            yield
        finally:
            sqlite_busy_budget.reset(token)
            self._write_lock.release()

    async def _same_files(self, conn: AsyncConnection) -> Any:
        """SQLite: this writer connection's files are still the ones at the path
        (`sqlite_files`); `DatabaseFileReplaced` if not. Its driver connection."""
        raw = await conn.get_raw_connection()
        if self._sqlite_path is not None:
            sqlite_files.check(raw.info, self._sqlite_path)
        return raw.driver_connection

    async def disk_room(self) -> int | None:
        """SQLite, for `/readyz`: the room there is (bytes) while its disk counts as full
        (`DiskWatch`), else None. The file is asked only when the filesystem is short."""
        free = self.disk.filesystem_room() if self.disk is not None else None
        if self.disk is None or free is None:
            return None
        async with self.read() as conn:  # the file's own free pages count as room
            pages = (await conn.execute(sa.text("PRAGMA freelist_count"))).scalar_one()
            size = (await conn.execute(sa.text("PRAGMA page_size"))).scalar_one()
        return self.disk.still_full(free + int(pages) * int(size))

    async def files_intact(self) -> None:
        """`/readyz`: raise `DatabaseFileReplaced` if a writer connection's files are no
        longer the ones at the path (SQLite; nothing to check elsewhere). Not queued
        behind the writes (one may wait a minute for another process's lock): it only
        compares files."""
        if self._sqlite_path is not None:
            async with self.writer.connect() as conn:
                await self._same_files(conn)

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A read-only transaction with one consistent snapshot on SQLite."""
        async with self.reader.connect() as conn:
            try:
                yield conn
            finally:
                await conn.rollback()

    async def dispose(self) -> None:
        if self._driver_pool is not None:
            pool, self._driver_pool = self._driver_pool, None
            await pool.close()
        await self.writer.dispose()
        if self.reader is not self.writer:
            await self.reader.dispose()
