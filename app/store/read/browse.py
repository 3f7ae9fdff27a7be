"""Reads for the web UI: the newest sessions, the feed's head, one session's page data,
one turn's stored record text and the expert usage of a sample's R3.

Everything here reads what the other read paths read (the projections, the
folded state, the stored patches), in the shapes a page needs: newest first,
behind the same visibility fence as the feed, without token arrays where a
page does not show them. Refuses to own any rule (which leaves are samples,
retries, losses are the domain's) and any HTML (`app/ui/`). Readers never write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import sqlalchemy as sa

from app.domain.body.labels import LabelFilters
from app.domain.body.specinfo import SPEC_INFO_KEYS
from app.domain.log.events import TURN_RECORDED
from app.domain.log.tree import SessionState
from app.domain.projection.assembly import R3Plan
from app.domain.projection.overview import SampleFacts
from app.domain.projection.rows import session_summary
from app.domain.wire import jsonio
from app.domain.wire.r3 import Patch
from app.store.engine.db import Database
from app.store.engine.dialect import feed_fence, time_bucket
from app.store.engine.schema import events, samples, sessions
from app.store.fold.loader import StateCache, load_state, session_row
from app.store.read import cursor
from app.store.read.analytics import spec_group
from app.store.read.selects import label_filter

# Rows widened at a time when counting experts: bounds memory for 100k-token samples.
USAGE_CHUNK_ROWS = 4096


@dataclass(frozen=True)
class RecentSessions:
    sessions: list[dict[str, Any]]
    list_cursor: str  # `after` for `GET /v1/sessions`: only sessions newer than these
    feed_cursor: str  # `after` for `GET /v1/events`: only events after this page was read


@dataclass(frozen=True)
class SessionPage:
    summary: dict[str, Any]
    state: SessionState
    samples: list[dict[str, Any]]  # sample rows of a closed session, index order
    errors: list[dict[str, Any]]
    empty_reason: str | None


async def recent_sessions(
    db: Database, status: str | None, filters: LabelFilters, limit: int
) -> RecentSessions:
    """The newest sessions matching the filters (newest first), with the cursors that
    continue the session list and the feed from exactly this moment."""
    """(`status` and `limit` parsed: `parse_status`, `SESSIONS_PAGE`.)"""
    async with db.read() as conn:
        # The feed head first: anything committed after it reaches the page live.
        head = sa.select(events.c.xid, events.c.position).order_by(
            events.c.xid.desc(), events.c.position.desc()).limit(1)
        event_fence = await feed_fence(conn)
        if event_fence is not None:
            head = head.where(event_fence)
        last_event = (await conn.execute(head)).first()
        query = (sa.select(sessions).where(*label_filter(filters))
                 .order_by(sessions.c.xid.desc(), sessions.c.id.desc()).limit(limit))
        if status is not None:
            query = query.where(sessions.c.status == status)
        fence = await feed_fence(conn, sessions.c.xid)
        if fence is not None:
            query = query.where(fence)
        rows = (await conn.execute(query)).mappings().all()
    list_cursor = cursor.encode(rows[0]["xid"], rows[0]["id"]) if rows else \
        cursor.encode(*cursor.START)
    feed_cursor = cursor.encode(last_event.xid, last_event.position) if last_event else \
        cursor.encode(*cursor.START)
    return RecentSessions([session_summary(r) for r in rows], list_cursor, feed_cursor)


def _sample_row(row: Any) -> dict[str, Any]:
    return {
        "index": row.sample_index,
        "leaf": row.leaf,
        "path": jsonio.loads(row.path),
        "status": row.status,
        "num_tokens": row.num_tokens,
        "response_length": row.response_length,
        "weight_versions": jsonio.loads(row.weight_versions),
        "reward": None if row.reward is None else jsonio.loads(row.reward),
        "metadata": jsonio.loads(row.sample_metadata),
        "r3": None if row.r3 is None else jsonio.loads(row.r3),
    }


async def session_page(db: Database, cache: StateCache, session_id: str) -> SessionPage:
    """The folded session (for the tree) and its sample rows (no arrays)."""
    async with db.read() as conn:
        row = await session_row(conn, session_id)
        state = await load_state(conn, cache, row)
        sample_rows = (await conn.execute(
            sa.select(samples).where(samples.c.session_id == session_id)
            .order_by(samples.c.sample_index))).all()
    body = session_summary(row)
    body["num_nodes"] = len(state.nodes)
    errors = jsonio.loads(row["sample_errors"]) if row["sample_errors"] else []
    return SessionPage(body, state, [_sample_row(r) for r in sample_rows], errors,
                       row["empty_reason"])


async def turn_payload(db: Database, session_id: str, seq: int) -> dict[str, Any]:
    """One turn event's stored JSON (the record without input ids and R3 bytes)."""
    async with db.read() as conn:
        await session_row(conn, session_id)
        payload = (await conn.execute(
            sa.select(events.c.payload).where(events.c.session_id == session_id)
            .where(events.c.seq == seq).where(events.c.type == TURN_RECORDED))).scalar()
    return {} if payload is None else dict(jsonio.loads(payload))


def expert_usage(plan: R3Plan, patches: Mapping[int, Patch]) -> np.ndarray:
    """Rows routed to each expert per layer: int64 `[num_layers, num_experts]`.

    Read a bounded block of rows at a time, so a long sample never widens
    its whole tensor at once; the expert count is the largest id seen + 1.
    Lives with the reads because it walks stored patches (a picture's input);
    what the picture means is the UI's.
    """
    layers = plan.num_layers
    counts = np.zeros((layers, 0), dtype=np.int64)
    layer_of = np.arange(layers, dtype=np.int64)[None, :, None]
    for piece in plan.slices:
        patch = patches[piece.seq]
        for lo in range(piece.row_from, piece.row_to, USAGE_CHUNK_ROWS):
            block = patch.rows_array(lo, min(lo + USAGE_CHUNK_ROWS, piece.row_to))
            if block.size == 0:
                continue
            experts = max(int(block.max()) + 1, counts.shape[1])
            if experts > counts.shape[1]:
                counts = np.pad(counts, ((0, 0), (0, experts - counts.shape[1])))
            # A negative id routes nowhere a picture can show: it is left out.
            flat = (layer_of * experts + block.astype(np.int64))[block >= 0]
            counts += np.bincount(flat, minlength=layers * experts).reshape(layers, experts)
    return counts


async def folded(db: Database, cache: StateCache, session_id: str) -> SessionState:
    """The session's folded state (cached like every other read's)."""
    async with db.read() as conn:
        return await load_state(conn, cache, await session_row(conn, session_id))


# Session ids per IN list: well under every backend's bind-parameter limit.
IDS_PER_QUERY = 500
# The `spec_turns` view (migration 0002) with the record's own time, for buckets.
spec_times = sa.table(
    "spec_turns",
    sa.column("session_id", sa.String),
    sa.column("record_ts", sa.Float),
    *(sa.column(key, sa.BigInteger) for key in SPEC_INFO_KEYS),
)


async def sample_facts(db: Database, session_ids: list[str]) -> dict[str, list[SampleFacts]]:
    """Reward, response length and status of every sample of these sessions (the list
    page's overview columns), by session id."""
    found: dict[str, list[SampleFacts]] = {}
    async with db.read() as conn:
        for start in range(0, len(session_ids), IDS_PER_QUERY):
            chunk = session_ids[start:start + IDS_PER_QUERY]
            rows = (await conn.execute(
                sa.select(samples.c.session_id, samples.c.reward, samples.c.response_length,
                          samples.c.status)
                .where(samples.c.session_id.in_(chunk))
                .order_by(samples.c.session_id, samples.c.sample_index))).all()
            for row in rows:
                found.setdefault(row.session_id, []).append(SampleFacts(
                    reward=None if row.reward is None else jsonio.loads(row.reward),
                    response_length=row.response_length, status=row.status))
    return found


async def run_rewards(db: Database, filters: LabelFilters) -> list[tuple[list[Any], Any]]:
    """`(weight_versions, reward)` of every sample of the closed sessions matching
    `filters`: the run view's reward distribution."""
    async with db.read() as conn:
        rows = (await conn.execute(
            sa.select(samples.c.weight_versions, samples.c.reward)
            .select_from(samples.join(sessions, sessions.c.session_id == samples.c.session_id))
            .where(sessions.c.status == "closed", *label_filter(filters))
            .order_by(samples.c.session_id, samples.c.sample_index))).all()
    return [(jsonio.loads(row.weight_versions),
             None if row.reward is None else jsonio.loads(row.reward)) for row in rows]


async def spec_rates_by_bucket(db: Database, filters: LabelFilters,
                               seconds: int) -> list[dict[str, Any]]:
    """The spec rates per `seconds`-long bucket of the records' own time, as
    `GET /v1/analytics/spec` groups (sums first); `key` is the bucket's start in
    seconds since the epoch. For runs too short for hourly points to read."""
    ts = spec_times.c.record_ts
    async with db.read() as conn:
        bucket = time_bucket(conn, ts, seconds)
        query = (sa.select(
            bucket.label("key"),
            sa.func.count(sa.distinct(spec_times.c.session_id)).label("sessions"),
            sa.func.count().label("turns"),
            *(sa.func.sum(spec_times.c[name]).label(name) for name in SPEC_INFO_KEYS))
            .where(ts.is_not(None), *label_filter(filters, spec_times.c.session_id))
            .group_by(bucket).order_by(bucket))
        rows = (await conn.execute(query)).mappings().all()
    return [{**spec_group(row), "key": int(row["key"]) * seconds} for row in rows]
