"""Making a turn durable: commit it to the store, or spool it; drain the spool; idle close;
closes and rewards clients hand the gateway, carried out in order behind the spool.

`Recorder.record` answers one of five outcomes for a turn the proxy holds:
- `recorded`: committed (the session auto-opened first if the store did not
  know it);
- `session-closed` / `rejected`: the store's verdict (a docs/api.md §1 4xx);
  the caller still gets the upstream reply;
- `spooled`: the store gave no verdict (connection or I/O error, timeout,
  5xx) — or earlier turns of the session still wait in the spool, and order
  per session comes first, or the drainer's own attempt has been waiting on
  the store for longer than the store timeout (a store that hangs costs
  each turn nothing more than that first wait) — so the turn was written
  and fsynced to the spool;
- `spool-full`: neither stored nor spooled; the caller gets 503. A store
  write that outlived the store timeout may still commit: with the spool
  full, the caller's answer then waits for that write's own outcome (bounded
  by the database's busy and command timeouts), so a turn answered 503 is
  never in the store, and its retry is never a second copy.

An error the store would raise again for the same turn (a value the
database cannot hold: SQLSTATE classes 22 and 54, SQLite's "too big") is a
verdict too, `rejected`: spooled, such a turn would block its session's
queue for good.

`Recorder.carry_out` takes a close or a reward a client sends the gateway
(the miles hooks do, so that a close never overtakes the session's spooled
turns): carried out at once when the spool holds nothing of the session and
the store answers, else spooled behind them; the store's verdict (a §1 4xx)
is the caller's answer when it is met at once.

A background drainer appends spooled turns in order with their original
event ids (an append already committed answers as an idempotent repeat, so
a crash between commit and delete stores nothing twice). With
`idle_close_seconds`, sessions opened by a gateway are closed once their last
recorded turn is older than that: those this gateway records turns for, and
the open ones a gateway opened before this one started (found in the store).
The store's last event of the session decides, not this gateway's memory
(another gateway on the same store may be recording it), and a session with
a turn on its way through this gateway (`generating`) is left open.

Refuses: HTTP (app.gateway.proxy) and the rules of what a turn is
(app.domain.body.gateway).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import asyncpg
import numpy as np
import sqlalchemy as sa
import sqlalchemy.exc
import structlog

from app.domain.body.deadline import store_wait
from app.domain.body.gateway import (
    IDLE_CLOSE,
    OPENED_BY,
    RECORDED,
    REJECTED,
    SESSION_CLOSED,
    SPOOL_FULL,
    SPOOLED,
    check_reward_order,
    reward_may_wait,
    reward_of_late_close,
)
from app.domain.body.rewards import parse_reward
from app.domain.body.session import SessionDefinition, parse_close, parse_open
from app.domain.body.turn import TurnBody, parse_turn
from app.domain.errors import (
    DomainError,
    InvalidRequest,
    SessionClosed,
    SessionConflict,
    UnknownSession,
)
from app.domain.log.tree import check_first_turn
from app.gateway.errors import SpoolFull, StoreUnavailable
from app.gateway.metrics import GatewayMetrics
from app.gateway.spool import CLOSE, REWARD, TURN, Reservation, Spool, Spooled
from app.services import Services
from app.store.append.writes import Opened, Written
from app.store.read.gateway import last_event_us, open_sessions_opened_by

log = structlog.get_logger("turnlog.gateway")

# A turn's outcomes: RECORDED, SPOOLED, and SPOOL_FULL (the caller gets a 503) or a verdict
# (the domain's `STORE_OUTCOMES`).
# `carry_out`'s answers for a close or a reward besides SPOOLED: done now, an identical
# repeat.
WRITTEN, REPEAT = "written", "repeat"
# Parse and encode larger turns on a worker thread. A 4 MB turn's ~4 ms of it is
# cheaper inline: the two thread hand-offs cost ~1.5 ms of CPU and the loop waits on
# the worker's GIL anyway (bench.gateway, 1 and 8 sessions); a 100 MB one would hold
# every other session's relay for ~100 ms.
OFFLOAD_BYTES = 16 << 20
DRAIN_RETRY_S = 0.5  # wait between drain attempts while the store cannot answer
PROBE_TIMEOUT_S = 2.0
T = TypeVar("T")


def recurs(exc: BaseException) -> bool:
    """Whether the store would raise `exc` again for the same turn: a value it cannot
    hold (SQLSTATE 22 data exception, 54 program limit exceeded; SQLite's DataError,
    e.g. a string or blob too big), not a fault of the moment (a connection, a lock,
    a timeout)."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, asyncpg.DataError | asyncpg.ProgramLimitExceededError
                      | sqlite3.DataError):
            return True
        if isinstance(error, sqlalchemy.exc.DataError):
            return True
        error = getattr(error, "orig", None) or error.__cause__
    return False


async def bounded(work: Coroutine[Any, Any, T], timeout: float) -> T:
    """`work`, or TimeoutError after `timeout` seconds — without waiting for it to stop.

    `asyncio.wait_for` waits for the cancelled work to unwind, and a SQLite
    write blocked on another process's lock unwinds only after its busy
    timeout: the caller would wait that long. The abandoned work goes on in
    the background; whatever it commits later is an append the spool repeats
    with the same event_id, which the store answers as an idempotent repeat.
    """
    return await within(asyncio.ensure_future(work), timeout)


async def within(task: asyncio.Future[T], timeout: float) -> T:
    """`bounded`, for a task the caller holds (to wait for it again later)."""
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.add_done_callback(_consume)
        raise TimeoutError(f"the store did not answer within {timeout} s")
    return task.result()


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("an abandoned store call ended", error=type(task.exception()).__name__)


class Recorder:
    def __init__(self, services: Services, spool: Spool, metrics: GatewayMetrics, *,
                 store_timeout: float, idle_close_seconds: float | None = None) -> None:
        self.services = services
        self.spool = spool
        self.metrics = metrics
        self.store_timeout = store_timeout
        self.idle_close_seconds = idle_close_seconds
        self.wake = asyncio.Event()
        self.drain_failing = False  # the last drain attempt got no verdict
        # Sessions opened by a gateway → monotonic time of their last recorded turn.
        self.last_turn: dict[str, float] = {}
        # Sessions with turns sent upstream and not yet recorded → how many.
        self.in_flight: Counter[str] = Counter()
        self._tasks: list[asyncio.Task[None]] = []
        # The drainer's attempt: (entry, its store call — for a turn, whether it was
        # created —, monotonic time it began).
        self._attempt: tuple[Any, asyncio.Future[Any], float] | None = None
        metrics.watch_spool(lambda: spool.turns, lambda: len(spool), lambda: spool.bytes,
                            spool.oldest_age, lambda: spool.reserved)

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._drain_loop(), name="gateway-drain"))
        if self.idle_close_seconds:
            self._tasks.append(asyncio.create_task(self._idle_loop(), name="gateway-idle"))
        if len(self.spool):
            log.info("draining the spool left by a previous gateway", turns=self.spool.turns,
                     writes=len(self.spool), bytes=self.spool.bytes)
            self.drain_failing = True  # not ready until a drain gets through
            self.wake.set()

    async def stop(self) -> None:
        if self._attempt is not None:
            self._attempt[1].cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    # -- one turn -------------------------------------------------------------------

    async def record(self, session_id: str, body: dict[str, Any],
                     open_body: dict[str, Any], size: int = 0,
                     prompt: np.ndarray | None = None,
                     reservation: Reservation | None = None) -> str:
        """`prompt`: the turn's `input_ids` already validated (`Candidate.prompt`);
        `reservation`: room in the spool promised to this turn, which it takes if it
        is spooled (the caller releases it after)."""
        if self.spool.holds(session_id):
            # Behind its earlier turns.
            return await self._spool(TURN, session_id, body, open_body, reservation)
        if self.store_hangs():
            # Another attempt would wait the whole store timeout too: the caller is
            # answered now, and the drainer appends the turn once the store answers.
            log.warning("the store is not answering; spooling the turn", session_id=session_id)
            return await self._spool(TURN, session_id, body, open_body, reservation)
        write = asyncio.ensure_future(self._store(session_id, body, open_body, size, prompt))
        try:
            created = await within(write, self.store_timeout)
        except Exception as exc:  # noqa: BLE001 - sorted below
            if self._is_verdict(exc):
                return self.verdict(session_id, exc)
            # Connection, I/O, timeout, 5xx: the store gave no verdict.
            outcome = await self._no_verdict(session_id, body, open_body, exc, reservation)
            if outcome == SPOOL_FULL and not write.done():
                return await self._outcome_of(session_id, write)
            if outcome == SPOOLED:
                # The abandoned write may still commit (a lock released late): the turn
                # is recorded then, and its drain is a repeat, not counted.
                write.add_done_callback(self._count_late_write)
            return outcome
        if created:
            self.metrics.recorded.inc()
        return RECORDED

    def _count_late_write(self, write: asyncio.Future[bool]) -> None:
        if not write.cancelled() and write.exception() is None and write.result():
            self.metrics.recorded.inc()

    @staticmethod
    def _is_verdict(exc: BaseException) -> bool:
        """A §1 refusal (4xx), or an error the store would raise again (`recurs`)."""
        if isinstance(exc, DomainError):
            return exc.http_status < 500
        return recurs(exc)

    async def _outcome_of(self, session_id: str, write: asyncio.Future[bool]) -> str:
        """A turn neither stored in time nor spooled (the spool is full), its write
        still running: its answer is that write's outcome, not a 503 that a later
        commit would make false (the caller's retry would be a second copy)."""
        log.warning("spool full; waiting for the store's answer to this turn",
                    session_id=session_id)
        try:
            created = await asyncio.shield(write)
        except Exception as exc:  # noqa: BLE001 - sorted below
            if self._is_verdict(exc):
                return self.verdict(session_id, exc)
            log.error("the turn's store write failed: answered 503, not stored",
                      session_id=session_id, error=type(exc).__name__)
            return SPOOL_FULL
        log.info("the turn's late store write committed: answered with the reply",
                 session_id=session_id)
        if created:
            self.metrics.recorded.inc()
        return RECORDED

    async def _store(self, session_id: str, body: dict[str, Any], open_body: dict[str, Any],
                     size: int = 0, prompt: np.ndarray | None = None) -> bool:
        """Store the turn (opening its session first if need be); False when the store
        held it already (a repeat: e.g. drained again after a crash between its commit
        and the spool's cleanup), which `recorded` does not count twice."""
        writer = self.services.writer
        offload = size > OFFLOAD_BYTES
        first: tuple[SessionDefinition, TurnBody] | None = None
        if not offload and writer.cached_definition(session_id) is None:
            # No state of this session here, most often a new one: open first and append
            # the turn parsed once, reading nothing before (the open says whether the
            # session existed). A turn a new session would refuse goes to the general
            # path: an existing session's state may take it.
            with contextlib.suppress(DomainError):
                first = self._first_turn(body, open_body, prompt)
            written = None if first is None else await self._open_and_append(
                session_id, open_body, *first, offload)
            if written is not None:
                await self._touch(session_id)
                return written.created
        try:
            written = await writer.append_turn(session_id, body, offload=offload,
                                               prompt=prompt)
        except UnknownSession:
            # No session is opened for a turn the store would refuse (raised here).
            definition, turn = first or self._first_turn(body, open_body, prompt)
            written = await self._open_and_append(session_id, open_body, definition, turn,
                                                  offload)
            if written is None:
                written = await writer.append_turn(session_id, body, offload=offload,
                                                   prompt=prompt)
        await self._touch(session_id)
        return written.created

    def _first_turn(self, body: dict[str, Any], open_body: dict[str, Any],
                    prompt: np.ndarray | None) -> tuple[SessionDefinition, TurnBody]:
        """The turn checked as the first of the session the gateway would open, still
        empty (pure rules; raises their refusal): the definition and the parsed turn."""
        definition = parse_open(open_body)
        turn = parse_turn(body, definition, None, prompt)
        check_first_turn(turn, definition, self.services.writer.max_nodes)
        return definition, turn

    async def _open_and_append(self, session_id: str, open_body: dict[str, Any],
                               definition: SessionDefinition, turn: TurnBody,
                               offload: bool) -> Written | None:
        """Open the session and append its first turn (a large one encoded on a worker
        thread); None when the open wrote nothing: the session existed. The append may
        still be a repeat (`created` False): another writer of the same turn (a drain
        of its spooled copy) stored it between the open and this append."""
        if not (await self._open(session_id, open_body)).created:
            return None
        return await self.services.writer.append_parsed(session_id, definition, turn,
                                                        offload)

    async def _open(self, session_id: str, open_body: dict[str, Any]) -> Opened:
        """Open with the gateway's definition; a session that has the id already (with
        this definition or another: opened meanwhile, or through the API) is not
        opened (`created` False)."""
        try:
            opened = await self.services.writer.open(open_body, explain_conflict=False)
        except SessionConflict:
            return Opened(parse_open(open_body), created=False)
        if opened.created:
            log.info("session opened", session_id=session_id, labels=open_body["labels"])
        return opened

    def verdict(self, session_id: str, exc: BaseException) -> str:
        """A turn the store refused (or would: `Candidate.refusal`), counted and logged
        with its problem type; the reason it is counted under."""
        reason = SESSION_CLOSED if isinstance(exc, SessionClosed) else REJECTED
        self.metrics.unrecorded.labels(reason).inc()
        if isinstance(exc, DomainError):
            log.warning("turn not recorded", session_id=session_id, reason=reason,
                        problem=f"urn:turnlog:{exc.slug}", detail=exc.detail, field=exc.field)
        else:
            log.error("turn not recorded: the store cannot hold it", session_id=session_id,
                      reason=reason, error=type(exc).__name__, detail=str(exc)[:300])
        return reason

    async def _no_verdict(self, session_id: str, body: dict[str, Any],
                          open_body: dict[str, Any], exc: BaseException,
                          reservation: Reservation | None = None) -> str:
        log.warning("store gave no verdict; spooling the turn", session_id=session_id,
                    error=type(exc).__name__, detail=str(exc)[:200])
        self.drain_failing = True  # not ready until a drain gets through
        return await self._spool(TURN, session_id, body, open_body, reservation)

    async def _spool(self, kind: str, session_id: str, body: dict[str, Any],
                     open_body: dict[str, Any] | None = None,
                     reservation: Reservation | None = None) -> str:
        """Write a turn (with how to open its session), a close or a reward to the spool:
        SPOOLED, or SPOOL_FULL."""
        try:
            try:
                await self.spool.add_async(session_id, body, open_body, kind, reservation)
            finally:
                # Also when the caller was cancelled: the spool finishes a write it began,
                # and the drainer must not sleep on it.
                self.wake.set()
        except SpoolFull as exc:
            log.error("spool full: not spooled", kind=kind, session_id=session_id,
                      detail=str(exc))
            return SPOOL_FULL
        except (OSError, TypeError, ValueError) as exc:
            # The disk refused, or the write cannot be written as JSON: as good as
            # full (503), never a silent loss and never a 500.
            log.error("cannot write the spool: not spooled", kind=kind, session_id=session_id,
                      error=type(exc).__name__, detail=str(exc))
            return SPOOL_FULL
        if kind != TURN:
            log.info("close or reward spooled behind the session's spooled writes", kind=kind,
                     session_id=session_id)
        return SPOOLED

    # -- closes and rewards handed to the gateway ---------------------------------------

    async def carry_out(self, kind: str, session_id: str, body: Any,
                        timeout: float | None = None) -> str:
        """A close (`CLOSE`) or a reward (`REWARD`) of the session, in order behind its
        spooled writes: carried out now (`WRITTEN`, or `REPEAT` for an identical
        repeat), or `SPOOLED` for the drainer when the spool holds writes of the
        session or the store gives no verdict in time (`store_wait`: the caller's
        `X-Turnlog-Timeout`, `timeout`, is met). A refusal of the body or the store's
        verdict (a §1 4xx, or a value the database cannot hold) raises its
        `DomainError`, and nothing is spooled; so does a reward the spool could not
        order behind its session's close (`check_reward_order`: 409 `session-open`;
        `reward_may_wait`: 503 `store-unavailable`, the client sends it again with its
        `event_id`). `SpoolFull` when a write can be neither done nor spooled: then the
        store write, if still running, is waited for, and its outcome is the answer
        (a 503 is never a write that commits later). A write abandoned after the wait
        may still commit; its spooled copy, and the caller's resend, are then
        answered as repeats (a close by its body, a reward by its `event_id`), never a
        second write."""
        if kind == CLOSE:
            parse_close(body)
        else:
            parse_reward(body)  # refused before anything is spooled
            check_reward_order(session_id, self.spool.count_turns(session_id),
                               self.spool.holds_close(session_id))
        if self.spool.holds(session_id) or self.store_hangs():
            return await self._spool_or_wait(kind, session_id, body, None)
        wait = store_wait(timeout, self.store_timeout)
        write = asyncio.ensure_future(self._write(kind, session_id, body))
        try:
            wrote = await within(write, wait)
        except DomainError as exc:
            if exc.http_status < 500:
                raise
            self._no_verdict_on(kind, session_id, exc, wait)
            return await self._spool_or_wait(kind, session_id, body, write)
        except Exception as exc:  # noqa: BLE001 - sorted below
            if recurs(exc):
                raise InvalidRequest(f"the store cannot hold this {kind}: "
                                     f"{type(exc).__name__}", field="body",
                                     expected="values the database can hold",
                                     actual=str(exc)[:200]) from None
            self._no_verdict_on(kind, session_id, exc, wait)
            return await self._spool_or_wait(kind, session_id, body, write)
        return WRITTEN if wrote else REPEAT

    def _no_verdict_on(self, kind: str, session_id: str, exc: BaseException,
                       wait: float) -> None:
        if isinstance(exc, TimeoutError) and wait < self.store_timeout:
            # The caller's short timeout, not a sick store: readiness stays as it is.
            log.info("the store did not answer within the caller's timeout", kind=kind,
                     session_id=session_id, waited=wait)
            return
        log.warning("store gave no verdict on a close or reward", kind=kind,
                    session_id=session_id, error=type(exc).__name__, detail=str(exc)[:200])
        self.drain_failing = True

    async def _spool_or_wait(self, kind: str, session_id: str, body: Any,
                             write: asyncio.Future[bool] | None) -> str:
        """Spool the write; with the spool full, the outcome of its store write if that
        is still running (its answer, never a 503 that a late commit makes false). A
        reward with nothing of its session spooled before it is not spooled
        (`reward_may_wait`)."""
        if kind == REWARD and not reward_may_wait(self.spool.count_writes(session_id)):
            log.warning("reward not spooled: no close of its session in the spool",
                        session_id=session_id)
            raise StoreUnavailable(
                "the store did not take this reward in time, and the gateway holds no close "
                "of its session to put it behind: send it again with the same event_id (a "
                "try still in flight may record it; the resend is then a repeat)")
        if await self._spool(kind, session_id, body) == SPOOLED:
            return SPOOLED
        full = SpoolFull(f"the store cannot take this {kind} now and the gateway's spool is "
                         "full: it was not written (send it again)")
        if write is None:
            raise full
        log.warning("spool full; the store's answer is the answer", kind=kind,
                    session_id=session_id)
        try:
            wrote = await asyncio.shield(write)  # done already, or still running
        except Exception as exc:  # noqa: BLE001 - its verdict, or the spool's refusal
            if isinstance(exc, DomainError) and exc.http_status < 500:
                raise
            log.error("a close or reward not written: its store write failed, the spool is "
                      "full", kind=kind, session_id=session_id, error=type(exc).__name__)
            raise full from None
        return WRITTEN if wrote else REPEAT

    async def _write(self, kind: str, session_id: str, body: Any) -> bool:
        writer = self.services.writer
        if kind == CLOSE:
            wrote = await writer.close_session(session_id, body)
            self.last_turn.pop(session_id, None)  # nothing left for the idle close
            return wrote
        return (await writer.record_reward(session_id, body)).created

    async def _drain_write(self, entry: Spooled, body: dict[str, Any]) -> None:
        """A spooled close or reward. A close that finds its session closed already by
        a close without a reward leaves its own as a reward event
        (`reward_of_late_close`) and is done; else the store's refusal is raised."""
        try:
            await self._write(entry.kind, entry.session_id, body)
        except SessionClosed:
            reward = reward_of_late_close(
                parse_close(body), await self.services.reader.close_of(entry.session_id)
            ) if entry.kind == CLOSE else None
            if reward is None:
                raise
            await self._write(REWARD, entry.session_id, reward)
            log.warning("a spooled close found its session closed already: its reward is "
                        "recorded as a reward event", session_id=entry.session_id,
                        reward=reward["reward"], event_id=reward["event_id"])

    # -- the drainer -------------------------------------------------------------------

    async def _drain_loop(self) -> None:
        while True:
            if not len(self.spool):
                self.drain_failing = False
                await self.wake.wait()
                self.wake.clear()
                continue
            if not await self._drain_one():
                self.drain_failing = True
                await asyncio.sleep(DRAIN_RETRY_S)

    async def _drain_one(self) -> bool:
        """Write the oldest spooled write (a turn's append, a close, a reward); False when
        the store gave no verdict (yet).

        An attempt that outlives the store timeout is not cancelled (a SQLite
        write blocked on a lock cannot be): the next round waits for the same
        attempt again instead of starting another one beside it.
        """
        entry = self.spool.entries[0]
        if self._attempt is None or self._attempt[0] is not entry:
            try:
                read = self.spool.read(entry)
            except (OSError, DomainError) as unreadable:
                # Not dropped: the spool is then not drained (readyz says so) until an
                # operator restores the file, or removes it and restarts the gateway.
                log.error("a spooled write cannot be read back; the drain waits for it",
                          session_id=entry.session_id, sequence=entry.sequence,
                          error=type(unreadable).__name__, detail=str(unreadable)[:300])
                return False
            work = self._drain_write(entry, read.body) if entry.kind != TURN else \
                self._store(entry.session_id, read.body, read.open_body or {}, entry.size)
            del read  # the attempt holds what it needs; the spool holds no bodies
            self._attempt = (entry, asyncio.ensure_future(work), time.monotonic())
        task = self._attempt[1]
        done, _ = await asyncio.wait({task}, timeout=self.store_timeout)
        if not done:
            return False
        self._attempt = None
        exc = task.exception()
        if exc is None:
            if entry.kind == TURN and task.result():
                self.metrics.recorded.inc()
        elif self._is_verdict(exc) and entry.kind != TURN:
            # The caller was answered 202 long ago: said here, for the operator.
            self.metrics.refused_writes.labels(entry.kind).inc()
            log.error("a spooled close or reward was refused by the store", kind=entry.kind,
                      session_id=entry.session_id, spooled_at=entry.spooled_at,
                      problem=f"urn:turnlog:{getattr(exc, 'slug', 'store-error')}",
                      detail=str(exc)[:300])
        elif self._is_verdict(exc):
            self.verdict(entry.session_id, exc)
            if isinstance(exc, SessionClosed):
                # Its caller was answered long ago; the session was closed meanwhile
                # (e.g. by a client whose close waited on the same store): a lost turn.
                log.error("a spooled turn arrived after its session was closed: not recorded",
                          session_id=entry.session_id, spooled_at=entry.spooled_at,
                          event_id=entry.event_id)
        else:
            log.debug("drain attempt failed", error=type(exc).__name__)
            return False
        self.spool.remove(entry)
        self.drain_failing = False
        if not len(self.spool):
            log.info("spool drained")
        return True

    def store_hangs(self) -> bool:
        """The drainer's current attempt has waited on the store for longer than the
        store timeout, with no answer yet. Only a hang counts: an attempt that fails
        fast (a turn the store errs on, a refused connection) leaves new turns trying
        the store, so one bad spooled turn never sends every turn to the spool."""
        attempt = self._attempt
        return (attempt is not None and not attempt[1].done()
                and time.monotonic() - attempt[2] > self.store_timeout)

    # -- readiness ----------------------------------------------------------------------

    async def ready(self) -> tuple[bool, str]:
        """Ready iff the spool is not stuck and the store answers (the spool first: it
        is known at once, where a hung store takes the probe's timeout to say so)."""
        if len(self.spool) and self.drain_failing:
            return False, (f"the spool holds {self.spool.turns} turns and "
                           f"{len(self.spool) - self.spool.turns} closes or rewards the "
                           "store does not take")
        try:
            async def probe() -> None:
                async with self.services.db.read() as conn:
                    await conn.execute(sa.text("SELECT 1"))

            await bounded(probe(), PROBE_TIMEOUT_S)
        except Exception as exc:
            return False, f"the store is unreachable ({type(exc).__name__})"
        return True, "ready"

    # -- idle close ------------------------------------------------------------------------

    @contextlib.contextmanager
    def generating(self, session_id: str) -> Iterator[None]:
        """A turn of `session_id` is on its way (sent upstream, its reply not yet recorded):
        the idle close leaves the session open meanwhile (a generation may outlast
        the idle time; closing under it would lose the turn)."""
        self.in_flight[session_id] += 1
        try:
            yield
        finally:
            self.in_flight[session_id] -= 1
            if not self.in_flight[session_id]:
                del self.in_flight[session_id]

    async def _touch(self, session_id: str) -> None:
        if not self.idle_close_seconds:
            return
        if session_id not in self.last_turn:
            definition = await self.services.writer.definition(session_id)
            if definition.opened_by != OPENED_BY:
                return
        self.last_turn[session_id] = time.monotonic()

    async def _adopt_open_sessions(self) -> bool:
        """Track the open sessions a gateway opened before this one started (so one left
        idle across a restart is still closed); False while the store cannot answer."""
        try:
            found = await bounded(open_sessions_opened_by(self.services.db, OPENED_BY),
                                  self.store_timeout)
        except Exception as exc:
            log.debug("cannot list open sessions yet", error=type(exc).__name__)
            return False
        now_wall, now = time.time(), time.monotonic()
        for session_id, last_us in found:
            self.last_turn.setdefault(session_id, now - max(0.0, now_wall - last_us / 1e6))
        if found:
            log.info("tracking open sessions opened by a gateway", sessions=len(found))
        return True

    async def _latest_turn(self, session_id: str, last: float) -> float | None:
        """The later of `last` and the session's last event in the store, on the
        monotonic clock; None when the store does not answer."""
        try:
            last_us = await bounded(last_event_us(self.services.db, session_id),
                                    self.store_timeout)
        except Exception as exc:
            log.warning("idle check failed; retrying", session_id=session_id,
                        error=type(exc).__name__)
            return None
        if last_us is None:
            return last
        stored = time.monotonic() - max(0.0, time.time() - last_us / 1e6)
        return max(last, stored)

    async def _idle_loop(self) -> None:
        assert self.idle_close_seconds
        limit = self.idle_close_seconds
        period = max(0.05, min(limit / 4, 5.0))
        adopted = False
        while True:
            await asyncio.sleep(period)
            if not adopted:
                adopted = await self._adopt_open_sessions()
            for session_id, last in list(self.last_turn.items()):
                if time.monotonic() - last > limit:
                    await self._close_if_idle(session_id, last, limit)

    async def _close_if_idle(self, session_id: str, last: float, limit: float) -> None:
        """Close `session_id` if no turn of it came for `limit` seconds: none recorded here
        since `last`, none on its way here or held in the spool, none in the store
        (another gateway on it may be recording the session)."""
        if self.spool.holds(session_id) or session_id in self.in_flight:
            return
        latest = await self._latest_turn(session_id, last)
        if latest is None or self.last_turn.get(session_id) != last \
                or session_id in self.in_flight:
            return  # the store cannot say now, or a turn came meanwhile: next round
        if latest > last:
            self.last_turn[session_id] = latest  # idle from the other gateway's turn
            if time.monotonic() - latest <= limit:
                return
            last = latest
        try:
            await bounded(self.services.writer.close_session(
                session_id, {"metadata": dict(IDLE_CLOSE)}), self.store_timeout)
        except (SessionClosed, UnknownSession):
            pass  # closed by someone else (another body) or gone
        except Exception as exc:
            log.warning("idle close failed; retrying", session_id=session_id,
                        error=type(exc).__name__)
            return
        else:
            log.info("session closed after idle time", session_id=session_id,
                     idle_seconds=round(time.monotonic() - last, 3))
        if self.last_turn.get(session_id) == last:
            del self.last_turn[session_id]
