"""The gateway's spool: turns that could not be stored yet, durable on local disk.

One file per turn, `<sequence>.turn` (20 digits, so names sort in arrival
order; per session that is the order the turns were answered in). A file is
written to a temporary name, fsynced, renamed into place and the directory
fsynced before `add` returns, so a turn the caller was answered for survives
a crash of the gateway. Each file holds the session id, the append body
(with its original `event_id`) and the auto-open body to use if the session
does not exist yet. `remove` deletes a file once the store has acknowledged
it; a crash in between makes the next drain repeat an append the store
answers as an idempotent repeat.

Refuses: deciding what to spool or when to drain (app.gateway.recorder).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.domain.body.turn import json_carried
from app.domain.wire import jsonio
from app.gateway.errors import SpoolFull

SUFFIX = ".turn"
LOCK_NAME = ".lock"
NAME_DIGITS = 20


@dataclass(frozen=True)
class Spooled:
    sequence: int
    session_id: str
    body: dict[str, Any]  # the append body, event_id included
    open_body: dict[str, Any]  # how to open the session if the store does not know it
    size: int  # bytes on disk
    spooled_at: float  # unix seconds


class SpoolInUse(Exception):
    """Another live gateway holds this spool directory."""


class Spool:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        # One gateway per spool: two would drain (and delete) each other's turns.
        self._lock = (self.directory / LOCK_NAME).open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise SpoolInUse(f"the spool {self.directory} is in use by another gateway: "
                             "give each gateway its own --spool-dir") from None
        self.entries: deque[Spooled] = deque()
        self.bytes = 0
        self.per_session: dict[str, int] = {}
        self.next_sequence = 0
        self._load()

    def _path(self, sequence: int) -> Path:
        return self.directory / f"{sequence:0{NAME_DIGITS}d}{SUFFIX}"

    def _load(self) -> None:
        """Turns a previous gateway left behind, in order; half-written temp files go."""
        for stale in self.directory.glob(f"*{SUFFIX}.tmp"):
            stale.unlink(missing_ok=True)
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            data = path.read_bytes()
            entry = jsonio.loads(data)
            sequence = int(path.name[: -len(SUFFIX)])
            self._track(Spooled(sequence, entry["session_id"], entry["body"], entry["open"],
                                len(data), float(entry["spooled_at"])))
            self.next_sequence = max(self.next_sequence, sequence + 1)

    def _track(self, entry: Spooled) -> None:
        self.entries.append(entry)
        self.bytes += entry.size
        self.per_session[entry.session_id] = self.per_session.get(entry.session_id, 0) + 1

    def count(self, session_id: str) -> int:
        """The turns of this session the spool holds (0: none)."""
        return self.per_session.get(session_id, 0)

    def holds(self, session_id: str) -> bool:
        """Whether turns of this session wait here (its next turns must queue behind them)."""
        return session_id in self.per_session

    def __len__(self) -> int:
        return len(self.entries)

    def oldest_age(self) -> float:
        return 0.0 if not self.entries else max(0.0, time.time() - self.entries[0].spooled_at)

    def add(self, session_id: str, body: dict[str, Any], open_body: dict[str, Any]) -> Spooled:
        """Write one turn durably (file and directory fsynced), or SpoolFull."""
        spooled_at = time.time()
        # An R3 payload handed over as bytes is spooled as the base64 JSON carries.
        body = {**body, "record": json_carried(body["record"])} if "record" in body else body
        data = jsonio.dumps_bytes({"session_id": session_id, "body": body, "open": open_body,
                                   "spooled_at": spooled_at})
        if self.bytes + len(data) > self.max_bytes:
            raise SpoolFull(f"spool holds {self.bytes} bytes; this turn needs {len(data)} more "
                            f"than the bound {self.max_bytes} allows")
        sequence = self.next_sequence
        self.next_sequence += 1
        path = self._path(sequence)
        tmp = path.with_name(path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            self._fsync_directory()
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk keeps no half-written turn
            path.unlink(missing_ok=True)  # renamed but not known durable: not spooled
            raise
        entry = Spooled(sequence, session_id, body, open_body, len(data), spooled_at)
        self._track(entry)
        return entry

    def remove(self, entry: Spooled) -> None:
        """Forget the oldest turn once the store acknowledged it."""
        assert self.entries and self.entries[0] is entry, "the spool drains in order"
        self.entries.popleft()
        self._path(entry.sequence).unlink(missing_ok=True)
        self.bytes -= entry.size
        left = self.per_session[entry.session_id] - 1
        if left:
            self.per_session[entry.session_id] = left
        else:
            del self.per_session[entry.session_id]

    def close(self) -> None:
        self._lock.close()  # releases the lock

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
