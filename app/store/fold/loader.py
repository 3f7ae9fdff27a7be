"""Folding a session's events from the database into `SessionState`, with a cache.

Events are immutable and a session's turn seqs are dense, so a cached state
with `n` nodes is exactly the fold of the first `n` turn events: validating
the cache needs only the session row's `num_nodes`, status and `num_rewards`
(rewards come after the close, in commit order), and a stale
entry is brought up to date by folding just the missing events. The cache
is per process and purely an optimization; a miss folds from the log.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.domain.body.rewards import RewardBody
from app.domain.body.session import SessionDefinition, parse_close
from app.domain.errors import UnknownSession
from app.domain.log.events import (
    R3_PRUNED,
    REWARD_RECORDED,
    SESSION_CLOSED,
    SESSION_OPENED,
    TURN_RECORDED,
    restore_prompt,
    stored_facts,
)
from app.domain.log.tree import SessionState
from app.domain.wire import jsonio
from app.domain.wire.r3 import Patch
from app.domain.wire.validate import SESSION_ID
from app.store.engine.dialect import lock_for_append, queue_for_session
from app.store.engine.schema import events, patch_from_row, r3_patches, sessions


class StateCache:
    """Folded states by session, least recently used first out.

    Bounded by count and by bytes (`SessionState.nbytes`: token deltas and
    log-probs). A state grows in place when an append commits, so its size is
    measured again whenever it is handed out or put back. A single state
    larger than the whole budget is not kept: it is folded per request.
    """

    def __init__(self, capacity: int, max_bytes: int | None = None) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._states: OrderedDict[str, SessionState] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._states)

    def _measure(self, session_id: str, state: SessionState) -> None:
        size = state.nbytes
        self.nbytes += size - self._sizes.get(session_id, 0)
        self._sizes[session_id] = size

    def _evict(self) -> None:
        while self._states and (len(self._states) > self.capacity or (
                self.max_bytes is not None and self.nbytes > self.max_bytes)):
            old, _ = self._states.popitem(last=False)
            self.nbytes -= self._sizes.pop(old, 0)

    def get(self, session_id: str) -> SessionState | None:
        state = self._states.get(session_id)
        if state is not None:
            self._states.move_to_end(session_id)
            self._measure(session_id, state)
            self._evict()
        return state

    def put(self, session_id: str, state: SessionState) -> None:
        if self.capacity <= 0:
            return
        self._states[session_id] = state
        self._states.move_to_end(session_id)
        self._measure(session_id, state)
        self._evict()

    def forget(self, session_id: str) -> None:
        self._states.pop(session_id, None)
        self.nbytes -= self._sizes.pop(session_id, 0)

    def clear(self) -> None:
        self._states.clear()
        self._sizes.clear()
        self.nbytes = 0


def _unknown(session_id: str) -> UnknownSession:
    return UnknownSession(f"no session {session_id!r}", field="session_id",
                          expected="an opened session id", actual=session_id)


async def session_row(conn: AsyncConnection, session_id: str, *, lock: bool = False) -> Any:
    if not SESSION_ID.matches(session_id):
        # No session can have such an id: unknown, and never sent to the database.
        raise UnknownSession(f"no session {session_id[:80]!r}", field="session_id",
                             expected="an opened session id ([A-Za-z0-9._:-]{1,128})",
                             actual=session_id[:80])
    query = sa.select(sessions).where(sessions.c.session_id == session_id)
    if lock:
        await queue_for_session(conn, session_id)
        query = lock_for_append(conn, query)
    row = (await conn.execute(query)).mappings().first()
    if row is None:
        raise _unknown(session_id)
    return row


@dataclass
class FoldLog:
    """Where each folded event sits in the log (what projection rows need besides state)."""

    opened_us: int = 0
    closed_us: int | None = None
    turns: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq → (position, us)


async def load_patches(
    conn: AsyncConnection, session_id: str, seqs: Iterable[int]
) -> dict[int, Patch]:
    """The stored R3 patches of the given turns, by seq (a turn without one is absent)."""
    wanted = list(seqs)
    if not wanted:
        return {}
    rows = await conn.execute(
        sa.select(r3_patches).where(r3_patches.c.session_id == session_id)
        .where(r3_patches.c.seq.in_(wanted))
    )
    return {row.seq: patch_from_row(row) for row in rows}


async def r3_freed(conn: AsyncConnection, session_id: str) -> bool:
    """Whether the log holds an `r3_pruned` event of the session (its R3 freed by
    retention: its samples say so)."""
    found = await conn.scalar(
        sa.select(events.c.position).where(events.c.session_id == session_id)
        .where(events.c.type == R3_PRUNED).limit(1))
    return found is not None


async def fold_events(
    conn: AsyncConnection,
    state: SessionState | None,
    session_id: str,
    from_seq: int = 0,
    log: FoldLog | None = None,
) -> SessionState:
    """Fold turn events with seq >= from_seq (and the open/close events) into `state`."""
    query = (
        sa.select(events.c.type, events.c.seq, events.c.event_id, events.c.payload,
                  events.c.prompt_lcp, events.c.prompt_delta, events.c.position,
                  events.c.recorded_us)
        .where(events.c.session_id == session_id)
        .where(sa.or_(events.c.seq.is_(None), events.c.seq >= from_seq))
        .order_by(events.c.position)
    )
    # The events first, then their patches' geometry. Outside the session's lock (a
    # read, `Writer._definition`) each statement of PostgreSQL's READ COMMITTED sees
    # the commits made before it began: read the other way round, a turn committed
    # (by another worker) between the two statements was folded without its patch —
    # as a turn of R3 rows with no payload, refused as 422 `invalid-r3` to a client
    # whose own turn was valid. This way a patch is read for every event read (one
    # transaction wrote both), and a patch of a later event is not looked at.
    rows = (await conn.execute(query)).all()
    geometry = {
        row.seq: (row.start_row, row.topk)
        for row in await conn.execute(
            sa.select(r3_patches.c.seq, r3_patches.c.start_row, r3_patches.c.topk)
            .where(r3_patches.c.session_id == session_id)
            .where(r3_patches.c.seq >= from_seq)
        )
    }
    # Everything fetched first, then folded without awaiting: another task may advance
    # the same cached state while we wait on the database, and folding must not
    # interleave with it (turns it already holds are skipped).
    return fold_rows(state, session_id, rows, geometry, log)


def fold_rows(
    state: SessionState | None,
    session_id: str,
    rows: Iterable[Any],
    geometry: Mapping[int, tuple[int, int]],
    log: FoldLog | None = None,
    *,
    trusted: bool = False,
) -> SessionState:
    """Fold one session's event rows (in position order) into `state`; no I/O.

    `geometry` maps a turn's seq to its stored patch's `(start_row, topk)`.
    `trusted`: take each stored turn's facts without validating it again (it
    was validated when appended); the same fold, the same state.
    """
    # Full tokens of the node folded last: in a chain it is the next one's parent,
    # so the delta-kept tokens need not be rebuilt from the ancestors.
    last: tuple[int, np.ndarray] | None = None
    for row in rows:
        payload = jsonio.loads_stored(row.payload)
        if row.type == SESSION_OPENED:
            if log is not None:
                log.opened_us = row.recorded_us
            if state is None:
                state = SessionState(definition=SessionDefinition.from_body(payload["session"]))
        elif row.type == TURN_RECORDED:
            assert state is not None
            if log is not None:
                log.turns[row.seq] = (row.position, row.recorded_us)
            if row.seq < len(state.nodes):
                continue
            parent = payload["parent"]
            if parent is None:
                parent_tokens = None
            elif last is not None and last[0] == parent:
                parent_tokens = last[1]
            else:
                parent_tokens = state.nodes[parent].head(row.prompt_lcp)
            prompt = restore_prompt(parent_tokens, row.prompt_lcp, row.prompt_delta)
            facts = stored_facts(state.definition, payload, prompt, geometry.get(row.seq),
                                 trusted=trusted)
            state.apply_turn(row.seq, parent, row.event_id, facts, row.prompt_lcp)
            last = (row.seq, facts.tokens)
        elif row.type == SESSION_CLOSED and state is not None:
            if log is not None:
                log.closed_us = row.recorded_us
            state.apply_close(parse_close(payload["close"]))
        elif row.type == REWARD_RECORDED and state is not None:
            state.apply_reward(RewardBody.from_body(payload["reward"]))
    if state is None:
        raise _unknown(session_id)
    return state


async def load_state(
    conn: AsyncConnection, cache: StateCache, row: Any
) -> SessionState:
    """The folded state of the session in `row` (a `sessions` row read in this txn)."""
    session_id = row["session_id"]
    closed = row["status"] == "closed"
    rewards = row["num_rewards"]
    state = cache.get(session_id)
    if state is not None and len(state.nodes) == row["num_nodes"] and state.closed == closed \
            and len(state.rewards) == rewards:
        return state
    if state is None or len(state.nodes) > row["num_nodes"] or state.closed and not closed \
            or len(state.rewards) > rewards:
        state = await fold_events(conn, None, session_id, 0)
    else:
        # Stale but a prefix of the truth: fold only what is missing.
        state = await fold_events(conn, state, session_id, len(state.nodes))
    cache.put(session_id, state)
    return state
