"""Group commit: concurrent one-round-trip appends of different sessions share one commit.

PostgreSQL only (not Citus, not SQLite: see docs/ingest.md, "Group commit").
While `siblings` or more of this process's one-trip appends are in flight (a
call alone, or a committing group, counts once), the calls that arrive collect
in an open group (and any call joins a group already open) for at most
`window_s`, `max_appends` calls or `max_bytes` of arguments; then one
connection runs

    BEGIN; SELECT turnlog_try_append(...) × n (one pipelined batch); COMMIT

and each caller is answered only once that COMMIT has returned, so every
position handed out is durable. With fewer in flight a call does not wait: it
runs alone, as the plain single call, on a connection of its own, in parallel
with the others — PostgreSQL already flushes the WAL of commits that wait
together once, and a group would run its members one after another on one
backend and make each wait for the window (PostgreSQL's `commit_delay` waits
only when `commit_siblings` transactions are active, for the same reason).

Why the guarantees of the single call still hold:

- a group holds at most one call per session: a call whose session is
  already in the open group closes that group (it is committed now) and then
  opens the next one, or runs alone if fewer than `siblings` are in flight,
  so two appends of a session are never in one transaction.
  Two calls of one session are pending together only when they were sent
  without waiting for each other's reply (a client that waits sends the next
  turn after the previous one's commit); like two single calls they are then
  unordered, and each checks the session's turn count under the row lock: the
  one attached against a count the other has moved writes nothing and
  answers None (general path, which attaches it after the other), exactly as
  alone;
- `turnlog_try_append` (migration 0009) catches any error of its own call in
  a subtransaction and answers NULL, having written nothing: a failing member
  falls back alone to the general path, the others are untouched;
- the calls run in `session_id` order, so two groups (on two connections)
  always take their row locks in the same order and cannot deadlock;
- the group is one transaction: its rows become visible at once, with one
  transaction id, which the feed fence compares with the horizon as it does
  any transaction's (an uncommitted group holds later commits back);
- a failure of the batch itself (the connection lost, a statement timeout,
  the server shutting down) or of the COMMIT answers every member with that
  error, as the single call would have raised it: none of them is told
  "stored". A statement error of the batch that is not about the connection
  rolled everything back: each member is answered None and decides alone on
  the general path.

Owns: forming groups and running their transaction.
Refuses: deciding anything about a turn (the function and `writes.py` do).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import structlog

from app.store.append import fastpath

log = structlog.get_logger("turnlog.store")

TRY_APPEND = "SELECT turnlog_try_append(" + ", ".join(f"${i}" for i in range(1, 39)) + ")"

# Errors of the batch that are about the connection or the server, not a statement:
# the single call would have raised them to its caller, so the group raises them too.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
    asyncpg.exceptions.InternalClientError, asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError)


def argument_bytes(args: tuple[Any, ...]) -> int:
    """The size of a call's text and bytea arguments (what the group bounds)."""
    return sum(len(a) for a in args if isinstance(a, str | bytes))


@dataclass
class _Member:
    args: tuple[Any, ...]
    done: asyncio.Future[int | None]

    @property
    def session_id(self) -> str:
        return str(self.args[0])


@dataclass
class _Group:
    members: list[_Member] = field(default_factory=list)
    sessions: set[str] = field(default_factory=set)
    nbytes: int = 0
    timer: asyncio.TimerHandle | None = None


@dataclass
class GroupStats:
    """What the groups did (tests and the benchmark read it)."""

    alone: int = 0       # calls that ran as the single call
    groups: int = 0      # transactions of two calls or more
    grouped: int = 0     # calls in those
    largest: int = 0
    failed: int = 0      # groups whose batch or commit raised


class GroupCommit:
    """One per process and database: see the module docstring."""

    def __init__(self, pool: asyncpg.Pool, window_s: float, max_appends: int,
                 max_bytes: int, siblings: int = 1) -> None:
        # siblings=1: a group whenever anything is in flight (what tests that build
        # groups deterministically want); the server passes its setting (default 5).
        self.pool = pool
        self.window_s = window_s
        self.max_appends = max_appends
        self.max_bytes = max_bytes
        self.siblings = siblings
        self.stats = GroupStats()
        self._open: _Group | None = None
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def append(self, args: tuple[Any, ...]) -> int | None:
        """The call's position (durable), or None (the general path decides)."""
        nbytes = argument_bytes(args)
        group = self._open
        if group is not None and str(args[0]) in group.sessions:
            self._flush(group)  # never two calls of one session in one group
            group = None
        if group is None:
            if self._in_flight < self.siblings or self.max_appends <= 1 \
                    or nbytes >= self.max_bytes:
                return await self._alone(args)
            group = self._open = _Group()
            group.timer = asyncio.get_running_loop().call_later(
                self.window_s, self._flush, group)
        member = _Member(args, asyncio.get_running_loop().create_future())
        # A caller that stops waiting (cancelled) leaves the group's answer unread.
        member.done.add_done_callback(_consume)
        group.members.append(member)
        group.sessions.add(member.session_id)
        group.nbytes += nbytes
        if len(group.members) >= self.max_appends or group.nbytes >= self.max_bytes:
            self._flush(group)
        # The group commits whatever happens to this caller: shield its answer.
        return await asyncio.shield(member.done)

    async def _alone(self, args: tuple[Any, ...]) -> int | None:
        self._in_flight += 1
        self.stats.alone += 1
        try:
            return await fastpath.call(self.pool, args)
        finally:
            self._in_flight -= 1

    def _flush(self, group: _Group) -> None:
        """Close the open group and commit it in a task of its own."""
        if self._open is not group:
            return  # already flushed (the timer fired after the size bound)
        self._open = None
        if group.timer is not None:
            group.timer.cancel()
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._commit(group.members))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _commit(self, members: list[_Member]) -> None:
        try:
            if len(members) == 1:
                self.stats.alone += 1
                try:
                    position = await fastpath.call(self.pool, members[0].args)
                except Exception as exc:
                    _answer(members[0], error=exc)
                else:
                    _answer(members[0], position)
                return
            members = sorted(members, key=lambda m: m.session_id)
            try:
                positions = await self._transaction(members)
            except Exception as exc:
                self.stats.failed += 1
                for member in members:
                    _answer(member, error=exc)
                return
            self.stats.groups += 1
            self.stats.grouped += len(members)
            self.stats.largest = max(self.stats.largest, len(members))
            log.debug("group committed", appends=len(members))
            for member, position in zip(members, positions, strict=True):
                _answer(member, position)
        except BaseException:
            for member in members:
                if not member.done.done():
                    member.done.cancel()
            raise
        finally:
            self._in_flight -= 1

    async def _transaction(self, members: list[_Member]) -> list[int | None]:
        """BEGIN, the members' calls in one batch, COMMIT: the positions (None: fall back)."""
        conn: asyncpg.Connection
        async with self.pool.acquire() as conn, fastpath.discard_if_broken(conn):
            transaction = conn.transaction()
            await transaction.start()
            try:
                rows = await conn.fetchmany(TRY_APPEND, [m.args for m in members])
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await transaction.rollback()
                if isinstance(exc, asyncpg.PostgresError) and not isinstance(
                        exc, CONNECTION_ERRORS):
                    return [None] * len(members)  # rolled back: each decides alone
                raise
            await transaction.commit()
        return [None if row[0] is None else int(row[0]) for row in rows]

    async def drain(self) -> None:
        """Commit the open group now and wait for every group in flight."""
        if self._open is not None:
            self._flush(self._open)
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _answer(member: _Member, position: int | None = None,
            error: BaseException | None = None) -> None:
    if member.done.done():
        return
    if error is not None:
        member.done.set_exception(error)
    else:
        member.done.set_result(position)


def _consume(future: asyncio.Future[int | None]) -> None:
    if not future.cancelled():
        future.exception()
