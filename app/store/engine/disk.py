"""A full disk under the store: how a write's error says so, and, on SQLite, whether the
database's disk is still full (for `/readyz`).

Every SQLite write goes through `Database.write()` or `Database.sqlite_writer()`,
which tell `DiskWatch` how it went: a write that failed for a full disk marks the
disk full, one that committed unmarks it. While marked, `/readyz` asks how much
room the file's filesystem has: at least `ROOM_AFTER_FULL` free (someone freed
space; writes will tell) unmarks it without a write, so a balancer that took the
server out on the 503 lets it back in. Less is still full: 503 `disk-full`.

PostgreSQL's disk is not this process's to measure: a full disk there answers each
write 503 `disk-full`, and a full WAL disk stops the server (`/readyz` then says
the database is unreachable).

Refuses: deciding what is answered (the API maps errors to HTTP, once).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator

import asyncpg

# Free bytes on the SQLite file's filesystem after which a disk marked full by a failed
# write counts as not full any more (a 2k-token turn with R3 is ~1-4 MB; R3 retention
# needs a few MB itself to write its records).
ROOM_AFTER_FULL = 64 * 2**20
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


class DiskWatch:
    """Whether the SQLite file's disk is full, as its writes and its free space say."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.full_since: float | None = None  # time.monotonic() of the first failure

    def failed(self, exc: BaseException) -> None:
        if self.full_since is None and disk_full(exc):
            self.full_since = time.monotonic()

    def wrote(self) -> None:
        self.full_since = None

    def still_full(self) -> int | None:
        """The free bytes while the disk counts as full, else None."""
        if self.full_since is None:
            return None
        try:
            free = free_bytes(self.path)
        except OSError:
            return 0  # its folder gone: no write will succeed either
        if free >= ROOM_AFTER_FULL:
            self.full_since = None
            return None
        return free
