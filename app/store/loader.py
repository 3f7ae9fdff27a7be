"""Folding a session's events from the database into `SessionState`, with a cache.

Events are immutable and a session's turn seqs are dense, so a cached state
with `n` nodes is exactly the fold of the first `n` turn events: validating
the cache needs only the session row's `num_nodes` and status, and a stale
entry is brought up to date by folding just the missing events. The cache
is per process and purely an optimization; a miss folds from the log.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.domain import jsonio
from app.domain.errors import UnknownSession
from app.domain.events import (
    SESSION_CLOSED,
    SESSION_OPENED,
    TURN_RECORDED,
    restore_prompt,
    stored_facts,
)
from app.domain.session import SESSION_ID_RE, SessionSpec, parse_close
from app.domain.tree import SessionState
from app.store.schema import events, r3_patches, sessions


class StateCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._states: OrderedDict[str, SessionState] = OrderedDict()

    def get(self, session_id: str) -> SessionState | None:
        state = self._states.get(session_id)
        if state is not None:
            self._states.move_to_end(session_id)
        return state

    def put(self, session_id: str, state: SessionState) -> None:
        if self.capacity <= 0:
            return
        self._states[session_id] = state
        self._states.move_to_end(session_id)
        while len(self._states) > self.capacity:
            self._states.popitem(last=False)

    def forget(self, session_id: str) -> None:
        self._states.pop(session_id, None)

    def clear(self) -> None:
        self._states.clear()


async def session_row(conn: AsyncConnection, session_id: str, *, lock: bool = False) -> Any:
    if not SESSION_ID_RE.match(session_id):
        # No session can have such an id: unknown, and never sent to the database.
        raise UnknownSession(f"no session {session_id[:80]!r}", field="session_id",
                             expected="an opened session id ([A-Za-z0-9._:-]{1,128})",
                             actual=session_id[:80])
    query = sa.select(sessions).where(sessions.c.session_id == session_id)
    if lock and conn.dialect.name == "postgresql":
        # NO KEY UPDATE: serializes appends without blocking inserts that only
        # reference the session row (foreign keys take KEY SHARE locks).
        query = query.with_for_update(key_share=True)
    row = (await conn.execute(query)).mappings().first()
    if row is None:
        raise UnknownSession(f"no session {session_id!r}", field="session_id",
                             expected="an opened session id", actual=session_id)
    return row


@dataclass
class FoldLog:
    """Where each folded event sits in the log (what projection rows need besides state)."""

    opened_us: int = 0
    closed_us: int | None = None
    turns: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq → (position, us)


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
    geometry = {
        row.seq: (row.start_row, row.topk)
        for row in await conn.execute(
            sa.select(r3_patches.c.seq, r3_patches.c.start_row, r3_patches.c.topk)
            .where(r3_patches.c.session_id == session_id)
            .where(r3_patches.c.seq >= from_seq)
        )
    }
    # Fetch everything first, then fold without awaiting: another task may advance
    # the same cached state while we wait on the database, and folding must not
    # interleave with it (turns it already holds are skipped).
    rows = (await conn.execute(query)).all()
    return fold_rows(state, session_id, rows, geometry, log)


def fold_rows(
    state: SessionState | None,
    session_id: str,
    rows: Iterable[Any],
    geometry: Mapping[int, tuple[int, int]],
    log: FoldLog | None = None,
) -> SessionState:
    """Fold one session's event rows (in position order) into `state`; no I/O.

    `geometry` maps a turn's seq to its stored patch's `(start_row, topk)`.
    """
    for row in rows:
        payload = jsonio.loads_stored(row.payload)
        if row.type == SESSION_OPENED:
            if log is not None:
                log.opened_us = row.recorded_us
            if state is None:
                state = SessionState(spec=SessionSpec.from_body(payload["session"]))
        elif row.type == TURN_RECORDED:
            assert state is not None
            if log is not None:
                log.turns[row.seq] = (row.position, row.recorded_us)
            if row.seq < len(state.nodes):
                continue
            parent = payload["parent"]
            parent_tokens = None if parent is None else state.nodes[parent].tokens
            prompt = restore_prompt(parent_tokens, row.prompt_lcp, row.prompt_delta)
            facts = stored_facts(state.spec, payload, prompt, geometry.get(row.seq))
            state.apply_turn(row.seq, parent, row.event_id, facts)
        elif row.type == SESSION_CLOSED and state is not None:
            if log is not None:
                log.closed_us = row.recorded_us
            state.apply_close(parse_close(payload["close"]))
    if state is None:
        raise UnknownSession(f"no session {session_id!r}", field="session_id",
                             expected="an opened session id", actual=session_id)
    return state


async def load_state(
    conn: AsyncConnection, cache: StateCache, row: Any
) -> SessionState:
    """The folded state of the session in `row` (a `sessions` row read in this txn)."""
    session_id = row["session_id"]
    closed = row["status"] == "closed"
    state = cache.get(session_id)
    if state is not None and len(state.nodes) == row["num_nodes"] and state.closed == closed:
        return state
    if state is None or len(state.nodes) > row["num_nodes"] or state.closed and not closed:
        state = await fold_events(conn, None, session_id, 0)
    else:
        # Stale but a prefix of the truth: fold only what is missing.
        state = await fold_events(conn, state, session_id, len(state.nodes))
    cache.put(session_id, state)
    return state
