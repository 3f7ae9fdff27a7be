"""A full disk under the store: how a write's error says so, and, on SQLite, whether the
database's disk is still full (for `/readyz`).

Every SQLite write goes through `Database.write()` or `Database.sqlite_writer()`,
inside `DiskWatch.watching()`: a write that failed for a full disk marks the disk
full, one that committed a change (sqlite3's `total_changes` grew: a repeat, a
dry run or a refusal proves nothing) unmarks it. While marked, `/readyz` asks
how much room there is, the free space of the file's filesystem plus the file's
own free pages (what R3 retention freed): `ROOM_AFTER_FULL` unmarks it without
a write, so a balancer that took the server out on the 503 lets it back in.
Each process keeps its own mark (`serve --workers N`: one per worker); less
than `ROOM_MIN` of room counts as full in every process, marked or not (the
gateway, or another worker, met the full disk first).

PostgreSQL's disk is not this process's to measure: a full disk there fails each
write (503 `unavailable`, "the database's disk is full"), and a full WAL disk
stops the server (`/readyz` then says the database is unreachable).

Refuses: deciding what is answered (the API maps errors to HTTP, once).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg

# Free bytes (the filesystem's and the file's own free pages) after which a disk marked
# full by a failed write counts as not full any more: room for a few 2k-token turns
# with R3 (~1-4 MB each; R3 retention needs a few MB itself to write its records).
ROOM_AFTER_FULL = 16 * 2**20
# Less room than this is a full disk whoever met it (no write of this process failed).
ROOM_MIN = 2**20
SQLITE_FULL = "database or disk is full"


def chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and what it wraps: SQLAlchemy's driver error in `.orig`, else the cause or
    the context."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else (
            current.__cause__ or current.__context__)


def disk_full(exc: BaseException) -> bool:
    """The database's disk is full (SQLite's SQLITE_FULL, PostgreSQL's 53100), anywhere
    in the chain."""
    return any(isinstance(current, asyncpg.exceptions.DiskFullError)
               or (isinstance(current, sqlite3.OperationalError)
                   and SQLITE_FULL in str(current))
               for current in chain(exc))


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding `path`."""
    found = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
    return found.f_bavail * found.f_frsize


class Changes:
    """The rows one write changed, as its sqlite3 connection counts them."""

    def __init__(self) -> None:
        self.driver: Any = None
        self.before = self.after = 0

    def counted_on(self, driver: Any) -> None:
        """Count on this connection (an aiosqlite or sqlite3 one) from now."""
        self.driver, self.before = driver, driver.total_changes
        self.after = self.before

    def ended(self) -> None:
        """The write's statements ran (read while its connection is surely open: the
        pool may close it once it is back)."""
        if self.driver is not None:
            self.after = self.driver.total_changes

    def made(self) -> bool:
        return self.after > self.before


class DiskWatch:
    """Whether the SQLite file's disk is full, as its writes and its free space say."""

    def __init__(self, path: str | None) -> None:
        self.path = path  # None: a database in memory, which has no disk to watch
        self.full_since: float | None = None  # time.monotonic() of the first failure

    def failed(self, exc: BaseException) -> None:
        if self.path is not None and self.full_since is None and disk_full(exc):
            self.full_since = time.monotonic()

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[Changes]:
        """Around one write (its commit included): a failure for a full disk marks it,
        a committed change unmarks it."""
        changes = Changes()
        try:
            yield changes
        except BaseException as exc:
            self.failed(exc)
            raise
        if changes.made():
            self.full_since = None

    def filesystem_room(self) -> int | None:
        """The filesystem's free bytes when they could leave the disk full (less than
        `ROOM_AFTER_FULL`); None when there is plenty, which also ends a mark."""
        if self.path is None:
            return None
        try:
            free = free_bytes(self.path)
        except OSError:
            free = 0  # its folder gone: the filesystem has no room for it
        if free >= ROOM_AFTER_FULL:
            self.full_since = None
            return None
        return free

    def still_full(self, room: int) -> int | None:
        """`room` (the filesystem's free bytes plus the file's free pages) when the disk
        counts as full, else None: marked by a failed write and less than
        `ROOM_AFTER_FULL`, or, marked or not, less than `ROOM_MIN` (another process,
        or another worker, met the full disk first)."""
        if self.path is None:
            return None
        if self.full_since is not None and room >= ROOM_AFTER_FULL:
            self.full_since = None
        return room if self.full_since is not None or room < ROOM_MIN else None
