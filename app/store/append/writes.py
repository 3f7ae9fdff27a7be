"""The append transactions: open a session, record a turn, close a session, record
a reward after the close.

Each write is one short transaction that appends the event (and its R3
patch) and updates the inline projections, serialized per session only (a
row lock on PostgreSQL; SQLite has a single writer). Validation is the
domain's; this module orders the steps: parse → lock → idempotency → fold →
attach → insert → commit, and only then updates the in-process state cache.

An append whose session state is cached takes one round trip instead
(`fastpath.py` on PostgreSQL, `sqlite_path.py` on SQLite): attach against the
cached state, then one call that locks, checks the state is still the
session's, writes and commits; if the check fails nothing is written and the
general path runs.
On plain PostgreSQL (not Citus) concurrent calls of different sessions share
one commit (`group.py`, `TURNLOG_GROUP_COMMIT_*`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio.to_thread
import asyncpg
import numpy as np
import sqlalchemy as sa
import structlog
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from app.domain.body.rewards import RewardBody, all_rewarded, latest_rewards, parse_reward, targets
from app.domain.body.session import (
    SessionDefinition,
    open_conflict,
    parse_close,
    parse_open,
)
from app.domain.body.turn import TurnBody, parse_turn
from app.domain.errors import (
    DomainError,
    IdempotencyConflict,
    SessionClosed,
    SessionOpen,
)
from app.domain.log.events import (
    R3_PRUNED,
    REWARD_RECORDED,
    SESSION_CLOSED,
    SESSION_OPENED,
    TURN_RECORDED,
    PreparedTurn,
    StoredTurn,
    encode_prepared,
    encode_turn,
    prepare_turn,
    stored_content,
    without_r3,
)
from app.domain.log.tree import Attachment, SessionState
from app.domain.projection.rows import (
    closed_head,
    iso_us,
    label_rows,
    node_row,
    open_rows,
    sample_row,
    session_head,
    session_summary,
)
from app.domain.projection.samples import build_samples
from app.domain.wire import jsonio
from app.store.append import fastpath, sqlite_path, warm
from app.store.append.group import GroupCommit
from app.store.engine.db import Database, now_us
from app.store.engine.dialect import CITUS_DETECT
from app.store.engine.schema import (
    events,
    nodes,
    patch_row,
    r3_patches,
    samples,
    session_labels,
    sessions,
)
from app.store.fold.loader import StateCache, load_patches, load_state, session_row
from app.store.handoff.consumers import enqueue_closed, enqueue_rewarded

log = structlog.get_logger("turnlog.store")


@dataclass(frozen=True)
class Opened:
    """What an open did: the session as parsed, whether this call opened it, and,
    when it did, the open route's reply (`summary` of the row it wrote)."""

    definition: SessionDefinition
    created: bool
    summary: dict[str, Any] | None = None


@dataclass(frozen=True)
class Written:
    body: dict[str, Any]
    created: bool
    # Bytes of R3 patch stored by this append (0 for a repeat or a turn without R3).
    r3_bytes: int = 0


def turn_reply(session_id: str, node: Any) -> dict[str, Any]:
    """The append reply, from a `nodes` row."""
    r3 = None
    if node["r3_start"] is not None:
        r3 = {"start": node["r3_start"], "end": node["r3_end"]}
    return {
        "session_id": session_id,
        "seq": node["seq"],
        "parent": node["parent"],
        "depth": node["depth"],
        "num_tokens": node["num_tokens"],
        "r3": r3,
        "finish_reason": node["finish_reason"],
        "position": node["position"],
    }


async def _insert_event(conn: AsyncConnection, values: dict[str, Any]) -> int:
    result = await conn.execute(events.insert().values(**values).returning(events.c.position))
    return int(result.scalar_one())


async def append_r3_pruned(conn: AsyncConnection, session_id: str, freed_bytes: int) -> None:
    """The `r3_pruned` event (`{"bytes": n}`), in the caller's transaction: R3 retention
    (`app.store.ops.retention`) frees the patches, the log is appended here."""
    await conn.execute(events.insert().values(
        session_id=session_id, type=R3_PRUNED, payload=jsonio.dumps({"bytes": freed_bytes}),
        recorded_us=now_us()))


T = TypeVar("T")
# A prepared payload's record JSON up to this many characters is joined with its
# parent on the event loop (a copy of ~20 µs), not on a worker thread.
_INLINE_JSON = 1 << 20


def parse_prepared(raw: Any, definition: SessionDefinition,
                   prompt: np.ndarray | None = None) -> tuple[TurnBody, PreparedTurn]:
    """`parse_turn`, then `prepare_turn`: a large turn's CPU work in one call, for one
    worker-thread trip (the API's hot route makes the same trip with the decoding)."""
    body = parse_turn(raw, definition, None, prompt)
    return body, prepare_turn(body, definition.num_layers)


async def run(offload: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, on a worker thread when `offload` (pure CPU work on a large turn)."""
    if not offload:
        return fn(*args)
    return await anyio.to_thread.run_sync(functools.partial(fn, *args))


class Writer:
    def __init__(self, db: Database, cache: StateCache, max_nodes: int) -> None:
        self.db = db
        self.cache = cache
        self.max_nodes = max_nodes
        # A new connection of the append's pool calls the functions once, rolled back.
        db.warm_connection = functools.partial(warm.warm_connection, max_nodes=max_nodes)
        # Where the one-round-trip call goes: the pool it was decided for, and the
        # pool itself (one transaction per append) or the group commit on it.
        self._via: tuple[asyncpg.Pool, asyncpg.Pool | GroupCommit] | None = None
        self._via_lock = asyncio.Lock()

    async def one_trip_via(self) -> asyncpg.Pool | GroupCommit:
        """The driver pool, or a group commit on it: on plain PostgreSQL with
        `group_commit_window_us` > 0. Never on Citus, where a group of sessions on
        several workers would be a two-phase commit (docs/ingest.md)."""
        pool = await self.db.driver_pool()
        if self._via is not None and self._via[0] is pool:
            return self._via[1]
        async with self._via_lock:
            if self._via is None or self._via[0] is not pool:
                settings = self.db.settings
                via: asyncpg.Pool | GroupCommit = pool
                if settings.store.group_commit_window_us > 0:
                    async with pool.acquire() as conn:
                        citus = await conn.fetchval(CITUS_DETECT) is not None
                    if not citus:
                        via = GroupCommit(pool, settings.store.group_commit_window_us / 1e6,
                                          settings.store.group_commit_max_appends,
                                          settings.store.group_commit_max_bytes,
                                          settings.store.group_commit_siblings)
                self._via = (pool, via)
            return self._via[1]

    async def open_session(self, raw: Any) -> tuple[SessionDefinition, bool]:
        """`open`: the session as parsed, and whether this call opened it."""
        opened = await self.open(raw)
        return opened.definition, opened.created

    async def open(self, raw: Any, *, explain_conflict: bool = True) -> Opened:
        """Open a session, or answer the repeat of an open (409 for another body, naming
        the field that differs unless `explain_conflict` is off: one read fewer, for a
        caller that takes any conflict as "opened already", as the gateway does).

        On PostgreSQL (and Citus) one call of `turnlog_open` (migration 0010)
        writes the row, the labels and the event; SQLite writes them in one
        `BEGIN IMMEDIATE` transaction. Either way the reply of an open that
        wrote is built from the row it wrote, not read back.
        """
        definition = parse_open(raw)
        recorded = now_us()
        row, payload = open_rows(definition, recorded)
        if self.db.dialect == "sqlite":
            stored = await self._open_locked(definition, row, payload)
        else:
            stored = await fastpath.open_session(
                await self.db.driver_pool(),
                fastpath.open_args(row, label_rows(definition), payload))
        if stored is not None:
            if stored != row["open_fingerprint"]:
                raise open_conflict(await self._opened_as(definition.session_id)
                                    if explain_conflict else None, definition)
            return Opened(definition, False)
        # Committed: the state a fold of the new log would give, so the first turn need not
        # fold it (two reads). Only if no state is held: a request that folded meanwhile
        # knows more (a stale state would be refolded anyway, as after any commit elsewhere).
        if self.cache.get(definition.session_id) is None:
            opened = SessionDefinition.from_body(jsonio.loads_stored(payload)["session"])
            self.cache.put(definition.session_id, SessionState(definition=opened))
        reply = {**session_summary({**row, "closed_us": None}), "opened_by": definition.opened_by}
        return Opened(definition, True, reply)

    async def _open_locked(self, definition: SessionDefinition, row: dict[str, Any],
                           payload: str) -> str | None:
        """The open as one transaction of statements: None when it wrote the session,
        else the `open_fingerprint` of the session that has the id."""
        try:
            async with self.db.write() as conn:
                existing = (await conn.execute(
                    sa.select(sessions.c.open_fingerprint)
                    .where(sessions.c.session_id == definition.session_id)
                )).first()
                if existing is not None:
                    self.db.wrote_nothing()
                    return str(existing.open_fingerprint)
                await conn.execute(sessions.insert().values(**row))
                if definition.labels:
                    await conn.execute(session_labels.insert(), label_rows(definition))
                await _insert_event(conn, {
                    "session_id": definition.session_id,
                    "type": SESSION_OPENED,
                    "payload": payload,
                    "recorded_us": row["created_us"],
                })
        except IntegrityError:
            # A concurrent open of the same id won the race: answer as a repeat.
            async with self.db.read() as conn:
                return str((await session_row(conn, definition.session_id))["open_fingerprint"])
        return None

    async def _opened_as(self, session_id: str) -> SessionDefinition | None:
        """The definition a session was opened with, from its `session_opened` event (one
        read; no fold), for naming what a conflicting open changed; None when it cannot
        be read (the 409 then names the body as a whole)."""
        try:
            async with self.db.read() as conn:
                payload = (await conn.execute(
                    sa.select(events.c.payload)
                    .where(events.c.session_id == session_id)
                    .where(events.c.type == SESSION_OPENED))).scalar()
            if payload is None:
                return None
            return SessionDefinition.from_body(jsonio.loads_stored(payload)["session"])
        except Exception:  # the 409 stands whatever this read meets
            log.warning("could not read a session's open to name a conflict",
                        session_id=session_id, exc_info=True)
            return None

    async def definition(self, session_id: str) -> SessionDefinition:
        """The session as opened (from the state cache when it holds it)."""
        return await self._definition(session_id)

    async def _definition(self, session_id: str) -> SessionDefinition:
        cached = self.cache.get(session_id)
        if cached is not None:
            return cached.definition
        async with self.db.read() as conn:
            row = await session_row(conn, session_id)
            return (await load_state(conn, self.cache, row)).definition

    async def append_turn(self, session_id: str, raw: Any, offload: bool = False,
                          prompt: np.ndarray | None = None) -> Written:
        """Validate, attach and record one turn. With `offload` (a large body) the
        CPU-heavy steps, parsing and the heavy part of encoding, run on a worker thread
        in one trip (`parse_prepared`). `prompt`: the
        record's `input_ids` as `token_array` already validated them (the gateway
        does so while the upstream generates), not converted again."""
        definition = await self._definition(session_id)
        if not offload:
            return await self.append_parsed(session_id, definition,
                                            parse_turn(raw, definition, None, prompt))
        body, prepared = await run(True, parse_prepared, raw, definition, prompt)
        return await self.append_parsed(session_id, definition, body, True, prepared)

    def cached_definition(self, session_id: str) -> SessionDefinition | None:
        """The session as opened if the state cache holds it (no I/O): a caller that
        has it may validate a turn (`parse_turn`) before `append_parsed`."""
        cached = self.cache.get(session_id)
        return None if cached is None else cached.definition

    async def append_parsed(self, session_id: str, definition: SessionDefinition,
                            body: TurnBody, offload: bool = False,
                            prepared: PreparedTurn | None = None) -> Written:
        """`append_turn` for a turn already validated against `definition`; `prepared`:
        its encoding's heavy part, done with the validation (`parse_prepared`)."""
        if self.db.one_trip_appends:
            written = await self._append_one_trip(session_id, body, offload, prepared)
            if written is not None:
                return written
        return await self._append_locked(session_id, definition, body, offload, prepared)

    @staticmethod
    async def _encode(body: TurnBody, attachment: Attachment, num_layers: int | None,
                      offload: bool, prepared: PreparedTurn | None) -> StoredTurn:
        """The stored parts of a turn: from its prepared parts on the loop when they are
        small (a worker-thread trip would cost more), else on a worker thread if `offload`."""
        if prepared is None:
            return await run(offload, encode_turn, body, attachment, num_layers)
        inline = prepared.head is not None and len(prepared.head) <= _INLINE_JSON
        return await run(offload and not inline, encode_prepared, body, attachment, prepared)

    async def _append_one_trip(
        self, session_id: str, body: TurnBody, offload: bool,
        prepared: PreparedTurn | None = None,
    ) -> Written | None:
        """Attach against the cached state, then lock, check and write in one call
        (`app/store/append/fastpath.py`, `sqlite_path.py`). None when the general path must decide:
        no cached state, a repeat or a refusal (judged again under the lock, against
        the log, which a stale cache could misjudge), or the session moved on.

        The call writes only if the session row still has the cached state's turn
        count and is open — the same check `load_state` makes under the lock — so
        what it writes is exactly what the general path would have written.
        """
        state = self.cache.get(session_id)
        if state is None or state.closed or body.event_id in state.event_ids:
            return None
        num_nodes = len(state.nodes)
        try:
            attachment = state.attach(body, self.max_nodes)
        except DomainError:
            return None
        stored = await self._encode(body, attachment, state.definition.num_layers, offload,
                                    prepared)
        if len(state.nodes) != num_nodes:
            return None  # another append of this session committed meanwhile
        node = state.new_node(attachment.seq, attachment.parent, body.event_id, body.facts,
                              attachment.prompt_lcp)
        recorded = now_us()
        nrow = node_row(session_id, node, 0, recorded)
        if self.db.dialect == "sqlite":
            position = await sqlite_path.append(self.db, session_id, num_nodes, attachment.seq,
                                                body.event_id, stored, recorded, nrow,
                                                session_head(state, node))
        else:
            args = fastpath.append_args(session_id, num_nodes, attachment.seq, body.event_id,
                                        stored, recorded, nrow, session_head(state, node))
            position = await fastpath.append(await self.one_trip_via(), args)
        if position is None:
            return None
        nrow["position"] = position
        if len(state.nodes) == node.seq:
            state.add_node(node)
        return Written(turn_reply(session_id, nrow), created=True,
                       r3_bytes=0 if stored.patch is None else len(stored.patch.data))

    async def _append_locked(self, session_id: str, definition: SessionDefinition,
                             body: TurnBody, offload: bool,
                             prepared: PreparedTurn | None = None) -> Written:
        """The general path: lock the session row, fold what the cache lacks, decide
        (repeat, refusal or a new node) and write, in one transaction."""
        async with self.db.write() as conn:
            row = await session_row(conn, session_id, lock=True)
            state = await load_state(conn, self.cache, row)
            seen = state.event_ids.get(body.event_id)
            if seen is not None:
                return Written(await self._repeat(conn, state, seen, body, offload),
                               created=False)
            attachment = state.attach(body, self.max_nodes)
            stored = await self._encode(body, attachment, definition.num_layers, offload,
                                        prepared)
            recorded = now_us()
            position = await _insert_event(conn, {
                "session_id": session_id,
                "seq": attachment.seq,
                "type": TURN_RECORDED,
                "event_id": body.event_id,
                "payload": stored.payload,
                "prompt_lcp": stored.prompt_lcp,
                "prompt_delta": stored.prompt_delta,
                "recorded_us": recorded,
            })
            if stored.patch is not None:
                await conn.execute(r3_patches.insert().values(
                    **patch_row(session_id, attachment.seq, stored.patch)))
            # The cached state only takes the node once the transaction has committed.
            node = state.new_node(attachment.seq, attachment.parent, body.event_id, body.facts,
                                  attachment.prompt_lcp)
            nrow = node_row(session_id, node, position, recorded)
            await conn.execute(nodes.insert().values(**nrow))
            await conn.execute(
                sessions.update().where(sessions.c.session_id == session_id)
                .values(**session_head(state, node))
            )
        if len(state.nodes) == node.seq:
            state.add_node(node)
        return Written(turn_reply(session_id, nrow), created=True,
                       r3_bytes=0 if stored.patch is None else len(stored.patch.data))

    async def _repeat(
        self, conn: AsyncConnection, state: SessionState, seq: int, body: TurnBody,
        offload: bool = False,
    ) -> dict[str, Any]:
        """The original reply if `body` is the turn first sent with its event_id, else 409.

        Compared against the log itself, so the append path pays nothing for it.
        """
        session_id = state.definition.session_id
        event = (await conn.execute(
            sa.select(events.c.payload).where(events.c.session_id == session_id)
            .where(events.c.seq == seq)
        )).one()
        patch = (await load_patches(conn, session_id, [seq])).get(seq)
        # R3 retention may have freed the patch since: the rest of the turn decides.
        freed = patch is not None and patch.freed
        b64 = None if patch is None or freed else patch.base64()
        prompt = state.nodes[seq].prompt

        def same() -> bool:
            first = stored_content(jsonio.loads_stored(event.payload), body.event_id, prompt, b64)
            sent = body.content()
            if freed:
                first["record"], sent["record"] = (without_r3(first["record"]),
                                                   without_r3(sent["record"]))
            return jsonio.strict_equal(first, sent)

        if not await run(offload, same):
            raise IdempotencyConflict(
                f"event_id {body.event_id!r} was already recorded with other content",
                field="event_id", expected="the content first sent with this event_id",
                actual="different content",
            )
        node = (await conn.execute(
            sa.select(nodes).where(nodes.c.session_id == session_id).where(nodes.c.seq == seq)
        )).mappings().one()
        return turn_reply(session_id, node)

    async def close_session(self, session_id: str, raw: Any) -> bool:
        """Record the close and write the samples projection; False for a repeat."""
        close = parse_close(raw)
        fingerprint = jsonio.fingerprint(close.body())
        async with self.db.write() as conn:
            row = await session_row(conn, session_id, lock=True)
            if row["status"] == "closed":
                if row["close_fingerprint"] != fingerprint:
                    raise SessionClosed(
                        f"session {session_id!r} was already closed with another body",
                        field="body", expected="the body the session was closed with",
                        actual="a different body",
                    )
                self.db.wrote_nothing()
                return False
            state = await load_state(conn, self.cache, row)
            closed = SessionState(definition=state.definition, nodes=state.nodes,
                                  topk=state.topk,
                                  close=close, event_ids=state.event_ids)
            result = build_samples(closed, close)
            recorded = now_us()
            await _insert_event(conn, {
                "session_id": session_id,
                "type": SESSION_CLOSED,
                "payload": jsonio.dumps({"close": close.body()}),
                "recorded_us": recorded,
            })
            rows = [sample_row(session_id, sample) for sample in result.samples]
            if rows:
                await conn.execute(samples.insert(), rows)
            head = closed_head(closed, result, recorded)
            await enqueue_closed(conn, session_id, state.definition.labels, recorded,
                                 rewarded=head["rewarded"])
            await conn.execute(
                sessions.update().where(sessions.c.session_id == session_id)
                .values(**head)
            )
        if len(state.nodes) == row["num_nodes"] and not state.closed:
            state.apply_close(close)
        return True

    async def record_reward(self, session_id: str, raw: Any) -> Written:
        """Record a reward of a closed session and bring its samples' rewards up to date.

        The same transaction shape as an append: parse, lock the session row,
        fold, idempotency, the domain's rules, insert the event, update the
        projections (the changed `samples` rows and the head), hand a session
        that has just become fully rewarded to the groups waiting for that.
        """
        body = parse_reward(raw)
        async with self.db.write() as conn:
            row = await session_row(conn, session_id, lock=True)
            state = await load_state(conn, self.cache, row)
            if body.event_id in state.rewards or body.event_id in state.event_ids:
                self.db.wrote_nothing()
                return Written(await self._reward_repeat(conn, session_id, body), created=False)
            if state.close is None:
                raise SessionOpen(f"session {session_id!r} is still open; rewards come after "
                                  "the close", field="session_id", expected="a closed session",
                                  actual="open")
            stored = (await conn.execute(
                sa.select(samples.c.sample_index, samples.c.leaf, samples.c.reward,
                          samples.c.reward_source)
                .where(samples.c.session_id == session_id).order_by(samples.c.sample_index)
            )).all()
            response_ids = [state.node(r.leaf).facts.response_id for r in stored]
            targets(body, response_ids)  # 404 for a sample or response_id no sample has
            rewards = [*state.rewards.values(), body]
            chosen = latest_rewards(state.close.reward, response_ids, rewards)
            recorded = now_us()
            position = await _insert_event(conn, {
                "session_id": session_id,
                "type": REWARD_RECORDED,
                "event_id": body.event_id,
                "payload": jsonio.dumps({"reward": body.body()}),
                "recorded_us": recorded,
            })
            for old, new in zip(stored, chosen, strict=True):
                reward = None if new.reward is None else jsonio.dumps(new.reward)
                if (old.reward, old.reward_source) != (reward, new.source):
                    await conn.execute(
                        samples.update().where(samples.c.session_id == session_id)
                        .where(samples.c.sample_index == old.sample_index)
                        .values(reward=reward, reward_source=new.source))
            rewarded = all_rewarded(pick.reward for pick in chosen)
            await conn.execute(
                sessions.update().where(sessions.c.session_id == session_id)
                .values(num_rewards=len(rewards), rewarded=rewarded))
            if rewarded and not row["rewarded"]:
                await enqueue_rewarded(conn, session_id, state.definition.labels,
                                       row["closed_us"])
        # The cached state only takes the reward once the transaction has committed.
        if len(state.rewards) == len(rewards) - 1:
            state.apply_reward(body)
        return Written(reward_reply(position, recorded, body), created=True)

    @staticmethod
    async def _reward_repeat(conn: AsyncConnection, session_id: str,
                             body: RewardBody) -> dict[str, Any]:
        """The original reply if `body` is the reward first sent with its event_id, else 409."""
        event = (await conn.execute(
            sa.select(events.c.position, events.c.type, events.c.payload, events.c.recorded_us)
            .where(events.c.session_id == session_id)
            .where(events.c.event_id == body.event_id))).one()
        first = jsonio.loads_stored(event.payload).get("reward") \
            if event.type == REWARD_RECORDED else None
        if first is None or not jsonio.strict_equal(first, body.body()):
            raise IdempotencyConflict(
                f"event_id {body.event_id!r} was already recorded with other content",
                field="event_id", expected="the content first sent with this event_id",
                actual="different content",
            )
        return reward_reply(event.position, event.recorded_us, RewardBody.from_body(first))


def reward_reply(position: int, recorded_us: int, body: RewardBody) -> dict[str, Any]:
    """The reward event as `GET …/events` shows it."""
    return {"position": position, "type": REWARD_RECORDED, "seq": None,
            "event_id": body.event_id, "recorded_at": iso_us(recorded_us),
            "reward": body.body()}
