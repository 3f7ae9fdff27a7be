"""The gateway's spool: writes that could not be stored yet, durable on local disk.

One file per write, `<sequence>.turn` (20 digits, so names sort in arrival
order, which per session is the order the writes were answered in; the
suffix is the one spools had when they held turns only, so a spool an
earlier gateway left is read as it is). A write
is a turn (`kind` "turn"), or a close or a reward a client handed the gateway
to carry out behind the session's spooled turns ("close", "reward";
docs/gateway.md). A file is written to a temporary name, fsynced, renamed
into place and the directory fsynced before `add` returns (the gateway's
`add_async`: on a worker thread, one write at a time), so a write the
caller was answered for survives a crash of the gateway. Each file holds the
kind, the session id, the body (a turn's with its original `event_id`) and,
for a turn, the auto-open body to use if the session does not exist yet.
`remove` deletes a file once the store has acknowledged it; a crash in
between makes the next drain repeat a write the store answers as an
idempotent repeat (a close or a reward the same way: a close repeated with
its body, a reward with its `event_id`).

Refuses: deciding what to spool or when to drain (app.gateway.recorder).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread

from app.domain.body.turn import json_carried
from app.domain.errors import DomainError
from app.domain.wire import jsonio
from app.gateway.errors import SpoolFull

SUFFIX = ".turn"
TURN, CLOSE, REWARD = "turn", "close", "reward"
KINDS = frozenset({TURN, CLOSE, REWARD})
LOCK_NAME = ".lock"
NAME_DIGITS = 20


@dataclass(frozen=True)
class Spooled:
    """A spooled write as the spool tracks it: where it is and what it is, not its body
    (read from its file when it is drained, `Spool.read`): a parsed turn is ~10x its
    bytes on disk, and `--spool-max-bytes` bounds the disk, so bodies kept in memory
    made a full spool of long prompts take ~10 GB."""

    sequence: int
    session_id: str
    event_id: str | None  # the write's own (a turn's, a reward's); None for a close
    size: int  # bytes on disk
    spooled_at: float  # unix seconds
    kind: str = TURN


@dataclass(frozen=True)
class SpooledBody:
    body: dict[str, Any]  # the append body (event_id included), close body or reward body
    open_body: dict[str, Any] | None  # a turn's: how to open the session if it is unknown


def _event_id(body: dict[str, Any]) -> str | None:
    event_id = body.get("event_id")
    return event_id if isinstance(event_id, str) else None


@dataclass(frozen=True)
class _Prepared:
    """A write as its file will hold it, not yet written."""

    session_id: str
    kind: str
    event_id: str | None
    spooled_at: float
    data: bytes


def _prepare(session_id: str, body: dict[str, Any], open_body: dict[str, Any] | None,
             kind: str) -> _Prepared:
    assert kind in KINDS, kind
    spooled_at = time.time()
    # An R3 payload handed over as bytes is spooled as the base64 JSON carries.
    if kind == TURN and "record" in body:
        body = {**body, "record": json_carried(body["record"])}
    data = jsonio.dumps_bytes({"kind": kind, "session_id": session_id, "body": body,
                               "open": open_body, "spooled_at": spooled_at})
    return _Prepared(session_id, kind, _event_id(body), spooled_at, data)


# What a turn's file may take beyond its request, reply and labels: the record's
# other fields (timestamps, method, path, status, event id), the open body's
# settings and the file's own fields.
_TURN_FILE_EXTRA = 64 << 10
# A turn's file holds its request, reply and labels re-encoded: strings and integers
# as long as they came or shorter, a float at most ~4.5x (`1e15` is written
# `1000000000000000.0`), so five times their bytes bound it.
_TURN_FILE_FACTOR = 5


def turn_file_bound(size: int) -> int:
    """The most bytes a turn whose request, reply and labels (the auto-open's) took
    `size` bytes can take in the spool (what `Spool.reserve` is asked for)."""
    return _TURN_FILE_FACTOR * size + _TURN_FILE_EXTRA


class Reservation:
    """Room promised in the spool (`Spool.reserve`) to one turn, so that the turn can be
    spooled whatever the spool holds by then: the gateway sends a reply's head (and its
    body but the end) while the turn is written, and such a turn can no longer be
    answered 503 `spool-full`. Used when the turn is spooled, or released."""

    def __init__(self, spool: Spool, size: int) -> None:
        self.spool = spool
        self.size = size
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.spool.reserved -= self.size


class SpoolInUse(Exception):
    """Another live gateway holds this spool directory."""


class SpoolUnreadable(Exception):
    """A spooled file this gateway cannot carry out."""


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
        self.reserved = 0  # bytes promised to turns being written (`reserve`)
        self.writing = 0  # bytes of writes past `_reserve`, not yet tracked in `bytes`
        self.turns = 0  # the entries that are turns
        # Per session, its entries of each kind (a session with none is not a key).
        self.per_session: dict[str, Counter[str]] = {}
        self.next_sequence = 0
        self._writing = asyncio.Lock()  # `add_async`: one write at a time, in order
        # Per session, its writes `add_async` has taken and not yet tracked, by kind.
        self._pending: dict[str, Counter[str]] = {}
        try:
            self._load()
        except BaseException:
            self._lock.close()  # the lock goes with it: nothing holds this spool
            raise

    def _path(self, sequence: int) -> Path:
        return self.directory / f"{sequence:0{NAME_DIGITS}d}{SUFFIX}"

    def _load(self) -> None:
        """Turns a previous gateway left behind, in order; half-written temp files go."""
        for stale in self.directory.glob(f"*{SUFFIX}.tmp"):
            stale.unlink(missing_ok=True)
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            data = path.read_bytes()
            try:
                entry = jsonio.loads(data)
                sequence = int(path.name[: -len(SUFFIX)])
                # A file of a gateway before closes and rewards were spooled has no kind.
                kind = entry.get("kind", TURN)
                spooled = Spooled(sequence, str(entry["session_id"]),
                                  _event_id(entry["body"]), len(data),
                                  float(entry["spooled_at"]), kind)
            except (DomainError, KeyError, TypeError, ValueError, AttributeError) as exc:
                # Written whole and renamed into place, so damaged on disk or not a
                # gateway's: said, never skipped (it may hold a turn a caller saw).
                raise SpoolUnreadable(
                    f"{path} is not a spooled write this gateway can read "
                    f"({type(exc).__name__}: {exc}); move it out of {self.directory} "
                    "(keep it: it may hold a turn a caller saw) to start") from None
            if kind not in KINDS:
                raise SpoolUnreadable(f"{path} holds a write of kind {kind!r}, which this "
                                      "gateway does not know (a newer gateway's spool?)")
            self._track(spooled)
            self.next_sequence = max(self.next_sequence, sequence + 1)

    def _track(self, entry: Spooled) -> None:
        self.entries.append(entry)
        self.bytes += entry.size
        self.per_session.setdefault(entry.session_id, Counter())[entry.kind] += 1
        if entry.kind == TURN:
            self.turns += 1

    def count_turns(self, session_id: str) -> int:
        """The turns of this session the spool holds (0: none)."""
        return self._kinds(session_id)[TURN]

    def count_writes(self, session_id: str) -> int:
        """The writes of this session the spool holds, closes and rewards included."""
        return self._kinds(session_id).total()

    def holds_close(self, session_id: str) -> bool:
        """Whether a close of this session waits here."""
        return self._kinds(session_id)[CLOSE] > 0

    def holds(self, session_id: str) -> bool:
        """Whether writes of this session wait here (its next ones must queue behind them),
        those being written (`add_async`) included."""
        return session_id in self.per_session or session_id in self._pending

    def _kinds(self, session_id: str) -> Counter[str]:
        """This session's writes by kind: on disk, and being written."""
        return (self.per_session.get(session_id) or Counter()) + \
            (self._pending.get(session_id) or Counter())

    def __len__(self) -> int:
        return len(self.entries)

    def oldest_age(self) -> float:
        return 0.0 if not self.entries else max(0.0, time.time() - self.entries[0].spooled_at)

    def reserve(self, size: int) -> Reservation | None:
        """`size` bytes promised to one turn (`Reservation`), or None when its files and
        the promises already made leave less room. A write that holds no promise
        counts the promises as taken (`add`)."""
        if self.bytes + self.writing + self.reserved + size > self.max_bytes:
            return None
        self.reserved += size
        return Reservation(self, size)

    def add(self, session_id: str, body: dict[str, Any], open_body: dict[str, Any] | None,
            kind: str = TURN, reservation: Reservation | None = None) -> Spooled:
        """Write one write durably (file and directory fsynced), or SpoolFull. With
        `reservation`, the write may take the room promised to it."""
        prepared = _prepare(session_id, body, open_body, kind)
        sequence = self._reserve(prepared, reservation)
        try:
            self._write(sequence, prepared.data)
        finally:
            self.writing -= len(prepared.data)
        return self._track_new(sequence, prepared, reservation)

    async def add_async(self, session_id: str, body: dict[str, Any],
                        open_body: dict[str, Any] | None, kind: str = TURN,
                        reservation: Reservation | None = None) -> Spooled:
        """`add`, with the encoding, the write and the fsyncs on a worker thread: a few
        MB turn's take milliseconds, on the event loop every session's relaying
        shares, and a store outage sends every turn here.

        In call order, one at a time (the lock is the first thing awaited, and
        asyncio's lock is first come, first served), so a session's writes are
        numbered, tracked and drained in the order they were made. From the call
        on, the write counts as held (`holds`, `count_writes`): the session's next
        writes queue behind it, as behind a write on disk. Once begun, a write is
        finished and tracked even if its caller is cancelled (its file would
        otherwise be drained only after a restart)."""
        pending = self._pending.setdefault(session_id, Counter())
        pending[kind] += 1
        settled = False

        def settle() -> None:  # once: when tracked (counted there now), or on failure
            nonlocal settled
            if settled:
                return
            settled = True
            pending[kind] -= 1
            if not +pending and self._pending.get(session_id) is pending:
                del self._pending[session_id]

        try:
            async with self._writing:
                written = asyncio.ensure_future(self._written(session_id, body, open_body,
                                                              kind, settle, reservation))
                try:
                    return await asyncio.shield(written)
                except asyncio.CancelledError:
                    # The write goes on, and holds the next back until it is tracked.
                    while not written.done():
                        with contextlib.suppress(asyncio.CancelledError):
                            await asyncio.shield(written)
                    raise
        finally:
            settle()

    async def _written(self, session_id: str, body: dict[str, Any],
                       open_body: dict[str, Any] | None, kind: str,
                       settle: Callable[[], None],
                       reservation: Reservation | None = None) -> Spooled:
        prepared = await anyio.to_thread.run_sync(_prepare, session_id, body, open_body, kind)
        sequence = self._reserve(prepared, reservation)
        try:
            await anyio.to_thread.run_sync(self._write, sequence, prepared.data)
        finally:
            self.writing -= len(prepared.data)  # and `bytes` takes it, in the same step
        entry = self._track_new(sequence, prepared, reservation)
        settle()  # in the same step: the write is never counted twice, nor not at all
        return entry

    def _reserve(self, prepared: _Prepared, reservation: Reservation | None = None) -> int:
        """The write's sequence number, or SpoolFull: the room promised to other turns,
        and the writes under way, are not this write's; its own promise
        (`reservation`) is. From here until it is tracked (or fails) the write's bytes
        count as `writing`."""
        promised = self.reserved - (reservation.size if reservation and reservation.held
                                    else 0)
        taken = self.bytes + self.writing
        if taken + promised + len(prepared.data) > self.max_bytes:
            raise SpoolFull(f"spool holds {taken} bytes and promised {promised} more; "
                            f"this {prepared.kind} needs {len(prepared.data)} more than the "
                            f"bound {self.max_bytes} allows")
        self.writing += len(prepared.data)
        sequence = self.next_sequence
        self.next_sequence += 1
        return sequence

    def _write(self, sequence: int, data: bytes) -> None:
        """The file, durable: written to a temporary name, fsynced, renamed, the directory
        fsynced. Touches nothing but the disk (it runs on a worker thread)."""
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

    def _track_new(self, sequence: int, prepared: _Prepared,
                   reservation: Reservation | None = None) -> Spooled:
        entry = Spooled(sequence, prepared.session_id, prepared.event_id, len(prepared.data),
                        prepared.spooled_at, prepared.kind)
        self._track(entry)
        if reservation is not None:
            reservation.release()  # in the same step: its bytes are counted as held now
        return entry

    def read(self, entry: Spooled) -> SpooledBody:
        """A spooled write's body, from its file (OSError or InvalidRequest when the file
        is gone or damaged: it was fsynced by this spool, so only something outside it
        does that)."""
        data = jsonio.loads(self._path(entry.sequence).read_bytes())
        return SpooledBody(data["body"], data.get("open"))

    def remove(self, entry: Spooled) -> None:
        """Forget the oldest write once the store acknowledged it."""
        assert self.entries and self.entries[0] is entry, "the spool drains in order"
        self.entries.popleft()
        self._path(entry.sequence).unlink(missing_ok=True)
        self.bytes -= entry.size
        kinds = self.per_session[entry.session_id]
        kinds[entry.kind] -= 1
        if not +kinds:  # none left of any kind
            del self.per_session[entry.session_id]
        if entry.kind == TURN:
            self.turns -= 1

    def close(self) -> None:
        self._lock.close()  # releases the lock

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
