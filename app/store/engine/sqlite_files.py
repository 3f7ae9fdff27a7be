"""SQLite: the file a connection writes is still the one at the database's path.

A server keeps its SQLite connections open. If the database file or its `-wal`
file is removed or replaced under it (a clean-up script, a backup restored with
`mv` over a running server), its connections keep writing into files no path
names any more: every commit still succeeds and is answered 201, and all of it
is gone at the next start. So each writer connection remembers the files it
opened (device and inode: the database file when it connects, its `-wal` at the
first write, when it exists), and every write transaction compares them with
what the path names now; a difference is `DatabaseFileReplaced` (503, and
`/readyz` says `database-replaced`) and nothing of that write is committed.

The `-wal` file's identity is stable while any connection has the database
open (SQLite removes it only when the last one closes), so a connection of
ours that sees another one was removed or replaced under it.
"""

from __future__ import annotations

import os
from typing import Any

# (st_dev, st_ino): a file, whatever its name.
FileId = tuple[int, int]
INFO_KEY = "turnlog_sqlite_files"


class DatabaseFileReplaced(OSError):
    """The SQLite file (or its `-wal`) at the database's path is not the one this
    connection writes: committing would answer for writes that are lost."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(
            f"the SQLite file {path} {what} while this server had it open: its writes "
            "would be lost; nothing of this request was stored. Restart the server "
            "(check the file first: `turnlog rebuild`)")
        self.path = path


class SqliteBusy(OSError):
    """A SQLite write that waited its whole busy timeout: for the file's write lock
    (SQLite's "database is locked": another process holds it) or, before that, in this
    process's queue of writers (`queued`: behind a write waiting for that lock, or a
    queue that long). Nothing of this write was stored."""

    def __init__(self, path: str | None, seconds: float, *, queued: bool = False) -> None:
        name = f"the SQLite file {path}" if path else "the SQLite file"
        if queued:
            why = (f"this write waited {seconds:g} s in this server's queue of writers to "
                   f"{name} (a write ahead of it waits for the file's lock, which another "
                   "process holds, or the queue is that long)")
            hint = "; for many concurrent writers, use PostgreSQL"
        else:
            why = (f"{name} is locked: its busy timeout ({seconds:g} s) ran out while "
                   "another process (a second turnlog process, a `sqlite3` shell, a "
                   "backup) held its write lock")
            hint = ", and find what holds the file if this lasts"
        super().__init__(f"{why}; nothing of this request was stored. Retry it{hint}")
        self.path = path


def file_id(path: str) -> FileId | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def remember(info: dict[str, Any], path: str, first: dict[str, Any]) -> None:
    """On connect: the database file this connection opened — the one the engine's
    first connection opened (`first`, shared by the engine's connections): a
    connection opened after the file was replaced would otherwise take the new file
    for its own, and the pool would mix writes into the two."""
    database = first.setdefault("database", file_id(path))
    info[INFO_KEY] = (database, file_id(path + "-wal"))


def check(info: dict[str, Any], path: str) -> None:
    """Before a write: raise `DatabaseFileReplaced` if the path names other files than
    the ones this connection has open."""
    known = info.get(INFO_KEY)
    if known is None:
        return  # not a connection made by our engine (nothing remembered)
    database, wal = known
    if file_id(path) != database:
        raise DatabaseFileReplaced(path, "was removed or replaced")
    now = file_id(path + "-wal")
    if wal is None:
        # This connection has not opened a -wal yet (none existed when it connected):
        # it opens the one at the path, remembered from its first write on.
        if now is not None:
            info[INFO_KEY] = (database, now)
        return
    if now != wal:
        raise DatabaseFileReplaced(path, "had its -wal file removed or replaced")
