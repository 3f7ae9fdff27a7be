"""Read paths: session summaries and trees, the session's events, resume state,
the session list and the global feed.

Small rows come from the projections; token ids and records are restored
from the log through the folded state. Readers never write.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from app.domain import jsonio
from app.domain.errors import InvalidRequest
from app.domain.events import TURN_RECORDED, restore_record, without_r3
from app.domain.projections import iso_us, tree_entry
from app.domain.r3 import Patch
from app.domain.session import LABEL_KEY_RE, describe, require_text, uses_addition_r3
from app.store import cursor
from app.store.db import Database
from app.store.dialect import feed_fence
from app.store.loader import StateCache, load_state, session_row
from app.store.schema import events, r3_patches, session_labels, sessions

MAX_FEED_LIMIT = 1000
MAX_WAIT = 30.0


def summary(row: Any) -> dict[str, Any]:
    """A session as opened plus its status: the reply of open and list."""
    layers = row["num_layers"]
    closed_us = row["closed_us"]
    return {
        "session_id": row["session_id"],
        "version": row["version"],
        "pause_generation_mode": row["pause_generation_mode"],
        "use_addition_r3": uses_addition_r3(row["pause_generation_mode"]),
        "r3": None if layers is None else {"num_layers": layers},
        "spec": bool(row["spec"]),
        "max_trim_tokens": row["max_trim_tokens"],
        "labels": jsonio.loads(row["labels"]),
        "status": row["status"],
        "num_nodes": row["num_nodes"],
        "created_at": iso_us(row["created_us"]),
        "closed_at": None if closed_us is None else iso_us(closed_us),
    }


def check_limit(limit: int | None, default: int, maximum: int) -> int:
    """A page size: absent → default; above the maximum → the maximum ("at most")."""
    if limit is None:
        return default
    if limit < 1:
        raise InvalidRequest(f"limit must be between 1 and {maximum}", field="limit",
                             expected=f"integer in [1, {maximum}]", actual=limit)
    return min(limit, maximum)


def label_filter(
    filters: Mapping[str, str],
    session_id: sa.ColumnElement[Any] = sessions.c.session_id,
) -> list[sa.ColumnElement[bool]]:
    """EXISTS clauses, one per filter, correlated to `session_id` (any table's column)."""
    clauses: list[sa.ColumnElement[bool]] = []
    for key, value in filters.items():
        if not LABEL_KEY_RE.match(key):
            raise InvalidRequest("label filter names are 1-64 characters of [A-Za-z0-9._:-]",
                                 field=key, expected="[A-Za-z0-9._:-]{1,64}",
                                 actual=describe(key))
        require_text(value, key)
        clauses.append(sa.exists().where(
            session_labels.c.session_id == session_id,
            session_labels.c.key == key,
            session_labels.c.value_text == value,
        ))
    return clauses


class Reader:
    def __init__(self, db: Database, cache: StateCache) -> None:
        self.db = db
        self.cache = cache
        self.new_events = asyncio.Event()

    def notify(self) -> None:
        """Wake long-polling feed readers in this process (a hint, never data)."""
        self.new_events.set()
        self.new_events = asyncio.Event()

    async def session(self, session_id: str) -> dict[str, Any]:
        async with self.db.read() as conn:
            row = await session_row(conn, session_id)
            state = await load_state(conn, self.cache, row)
        body = summary(row)
        body["num_nodes"] = len(state.nodes)
        body["tree"] = [tree_entry(node) for node in state.nodes]
        return body

    async def summary(self, session_id: str) -> dict[str, Any]:
        async with self.db.read() as conn:
            return summary(await session_row(conn, session_id))

    async def state(self, session_id: str, leaf: int | None) -> dict[str, Any]:
        async with self.db.read() as conn:
            row = await session_row(conn, session_id)
            state = await load_state(conn, self.cache, row)
        return state.resume(leaf)

    async def session_events(
        self, session_id: str, after: int | None, limit: int | None, include_r3: bool,
        r3_raw: bool = False,
    ) -> list[dict[str, Any]]:
        """The page of events; `r3_raw` gives R3 payloads as int32 bytes, not base64."""
        limit = check_limit(limit, 1000, 100_000)
        async with self.db.read() as conn:
            row = await session_row(conn, session_id)
            state = await load_state(conn, self.cache, row)
            query = (sa.select(events).where(events.c.session_id == session_id)
                     .order_by(events.c.position).limit(limit))
            if after is not None:
                query = query.where(events.c.position > after)
            rows = (await conn.execute(query)).mappings().all()
            patches: dict[int, Patch] = {}
            seqs = [r["seq"] for r in rows if r["seq"] is not None]
            if include_r3 and seqs:
                for p in await conn.execute(
                    sa.select(r3_patches).where(r3_patches.c.session_id == session_id)
                    .where(r3_patches.c.seq.in_(seqs))
                ):
                    patches[p.seq] = Patch(start=p.start_row, end=p.end_row,
                                           num_layers=p.num_layers, topk=p.topk,
                                           dtype=p.dtype, data=p.data)
        return [self._event(r, state, patches, include_r3, r3_raw) for r in rows
                if r["seq"] is None or r["seq"] < len(state.nodes)]

    @staticmethod
    def _event(row: Any, state: Any, patches: dict[int, Patch],
               include_r3: bool = True, r3_raw: bool = False) -> dict[str, Any]:
        payload = jsonio.loads_stored(row["payload"])
        out: dict[str, Any] = {
            "position": row["position"],
            "type": row["type"],
            "seq": row["seq"],
            "event_id": row["event_id"],
            "recorded_at": iso_us(row["recorded_us"]),
        }
        if row["type"] == TURN_RECORDED:
            node = state.nodes[row["seq"]]
            patch = patches.get(row["seq"])
            out["parent"] = payload["parent"]
            r3 = None if patch is None else patch.raw() if r3_raw else patch.base64()
            record = restore_record(payload, node.facts.prompt, r3)
            # A payload that was never moved to a patch row (`""`, null) is
            # still in the stored JSON: `include_r3=false` leaves it out too.
            out["record"] = record if include_r3 else without_r3(record)
            out["metadata"] = payload.get("metadata")
        else:
            out.update(payload)
        return out

    async def list_sessions(
        self, status: str | None, after: str | None, limit: int | None,
        filters: Mapping[str, str],
    ) -> dict[str, Any]:
        """Sessions in the order their opens committed, behind the feed's fence, so a
        tailing reader never skips an open that committed late."""
        limit = check_limit(limit, 100, 1000)
        start = cursor.decode(after, 2)
        if status not in (None, "open", "closed"):
            raise InvalidRequest("status must be open or closed", field="status",
                                 expected='"open" | "closed"', actual=describe(status))
        query = (sa.select(sessions)
                 .where(sa.tuple_(sessions.c.xid, sessions.c.id) > sa.tuple_(*start))
                 .where(*label_filter(filters))
                 .order_by(sessions.c.xid, sessions.c.id).limit(limit))
        if status is not None:
            query = query.where(sessions.c.status == status)
        async with self.db.read() as conn:
            fence = feed_fence(conn, sessions.c.xid)
            if fence is not None:
                query = query.where(fence)
            rows = (await conn.execute(query)).mappings().all()
        if rows:
            next_cursor = cursor.encode(rows[-1]["xid"], rows[-1]["id"])
        else:
            next_cursor = after or cursor.encode(*start)
        return {"sessions": [summary(r) for r in rows], "next": next_cursor}

    async def _feed_page(self, after: tuple[int, ...], limit: int) -> list[Any]:
        async with self.db.read() as conn:
            query = (
                sa.select(events.c.position, events.c.session_id, events.c.seq, events.c.type,
                          events.c.recorded_us, events.c.xid)
                .where(sa.tuple_(events.c.xid, events.c.position) > sa.tuple_(*after))
                .order_by(events.c.xid, events.c.position)
                .limit(limit)
            )
            fence = feed_fence(conn)
            if fence is not None:
                query = query.where(fence)
            return list(await conn.execute(query))

    async def feed(
        self, after: str | None, limit: int | None, wait: float | None
    ) -> dict[str, Any]:
        limit = check_limit(limit, 100, MAX_FEED_LIMIT)
        if wait is not None and not wait >= 0:  # NaN fails this too
            raise InvalidRequest(f"wait must be between 0 and {MAX_WAIT} seconds", field="wait",
                                 expected=f"number in [0, {MAX_WAIT}]", actual=wait)
        wait = None if wait is None else min(wait, MAX_WAIT)
        start = cursor.decode(after, 2)
        deadline = time.monotonic() + (wait or 0.0)
        while True:
            wakeup = self.new_events
            rows = await self._feed_page(start, limit)
            remaining = deadline - time.monotonic()
            if rows or remaining <= 0:
                break
            # Local appends wake us at once; other writers are seen by polling.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), timeout=min(remaining, 0.25))
        if rows:
            last = rows[-1]
            next_cursor = cursor.encode(last.xid, last.position)
        else:
            next_cursor = after or cursor.encode(*start)
        return {
            "events": [
                {"position": r.position, "session_id": r.session_id, "seq": r.seq,
                 "type": r.type, "recorded_at": iso_us(r.recorded_us)}
                for r in rows
            ],
            "next": next_cursor,
        }
