"""Read paths: session summaries and trees, the session's events, resume state,
the session list and the global feed.

Small rows come from the projections; token ids and records are restored
from the log through the folded state. Readers never write.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.domain.body.labels import LabelFilters
from app.domain.body.session import SessionClose
from app.domain.log.events import (
    SESSION_OPENED,
    TURN_RECORDED,
    inline_r3_as_bin,
    restore_record,
    without_r3,
)
from app.domain.projection.rows import iso_us, session_summary, tree_entry
from app.domain.wire import jsonio
from app.domain.wire.r3 import Patch
from app.store.engine.db import Database
from app.store.engine.dialect import feed_fence
from app.store.engine.schema import events, sessions
from app.store.fold.loader import StateCache, load_patches, load_state, session_row
from app.store.read import cursor
from app.store.read.selects import label_filter


async def opened_by(conn: AsyncConnection, session_ids: list[str]) -> dict[str, str | None]:
    """Who opened each session (`opened_by` of its open body; None when not named).

    Not a `sessions` column: read from the `session_opened` events, one query a page.
    """
    if not session_ids:
        return {}
    rows = (await conn.execute(
        sa.select(events.c.session_id, events.c.payload)
        .where(events.c.type == SESSION_OPENED)
        .where(events.c.session_id.in_(session_ids)))).all()
    return {row.session_id: jsonio.loads_stored(row.payload)["session"].get("opened_by")
            for row in rows}


NEWEST_PAGE = 1000  # sessions a query of `newest_sessions` reads (and names in one IN)


class EventsPage:
    """A page of `GET …/events`: rows in hand, each event rendered on demand, so
    a 100,000-event reply never exists as Python objects all at once."""

    def __init__(self, rows: list[Any], state: Any, patches: dict[int, Patch],
                 include_r3: bool, pruned: bool = False, r3_raw: bool = False) -> None:
        self.rows = rows
        self.r3_raw = r3_raw  # R3 payloads as int32 bytes (MessagePack bin), not base64
        self.state = state
        self.patches = patches
        self.include_r3 = include_r3
        self.pruned = pruned  # the session's R3 was freed by retention

    def __len__(self) -> int:
        return len(self.rows)

    def event(self, index: int) -> dict[str, Any]:
        event = Reader._event(self.rows[index], self.state, self.patches, self.include_r3,
                              self.r3_raw)
        if self.pruned and event["type"] == TURN_RECORDED:
            event["r3_pruned"] = True
        return event

    def encoded(self, start: int, stop: int) -> bytes:
        """Events `[start, stop)` as JSON array members, comma-separated (no brackets)."""
        return b",".join(jsonio.dumps_bytes(self.event(i))
                         for i in range(start, min(stop, len(self.rows))))


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
        body = session_summary(row)
        body["opened_by"] = state.definition.opened_by
        body["num_nodes"] = len(state.nodes)
        body["tree"] = [tree_entry(node) for node in state.nodes]
        return body

    async def close_of(self, session_id: str) -> SessionClose | None:
        """The close a session was closed with (None: still open)."""
        async with self.db.read() as conn:
            state = await load_state(conn, self.cache, await session_row(conn, session_id))
        return state.close

    async def summary(self, session_id: str) -> dict[str, Any]:
        async with self.db.read() as conn:
            body = session_summary(await session_row(conn, session_id))
            body["opened_by"] = (await opened_by(conn, [session_id])).get(session_id)
            return body

    async def state(self, session_id: str, leaf: int | None) -> dict[str, Any]:
        async with self.db.read() as conn:
            row = await session_row(conn, session_id)
            state = await load_state(conn, self.cache, row)
        return state.resume(leaf)

    async def session_events(
        self, session_id: str, after: int | None, limit: int, include_r3: bool,
        r3_raw: bool = False,
    ) -> list[dict[str, Any]]:
        """Events after position `after`, at most `limit` (a parsed `EVENTS_PAGE`);
        `r3_raw` gives R3 payloads as int32 bytes, not base64."""
        page = await self.session_events_page(session_id, after, limit, include_r3, r3_raw)
        return [page.event(i) for i in range(len(page))]

    async def session_events_page(
        self, session_id: str, after: int | None, limit: int, include_r3: bool,
        r3_raw: bool = False,
    ) -> EventsPage:
        """The rows of a page of the session's events, read in one snapshot; the
        events themselves (token ids restored) are built one by one as they are sent."""
        async with self.db.read() as conn:
            row = await session_row(conn, session_id)
            state = await load_state(conn, self.cache, row)
            query = (sa.select(events).where(events.c.session_id == session_id)
                     .order_by(events.c.position).limit(limit))
            if after is not None:
                query = query.where(events.c.position > after)
            rows = (await conn.execute(query)).mappings().all()
            patches: dict[int, Patch] = {}
            # Freed by retention: turns read back as with include_r3=false, marked.
            pruned = row["r3_pruned_bytes"] is not None
            include_r3 = include_r3 and not pruned
            if include_r3:
                patches = await load_patches(
                    conn, session_id, (r["seq"] for r in rows if r["seq"] is not None))
                # On PostgreSQL each statement has its own snapshot (READ COMMITTED):
                # retention may have emptied the patches after the session row was
                # read. The page is then a pruned one, decided before a byte is sent.
                if any(patch.freed for patch in patches.values()):
                    pruned, include_r3, patches = True, False, {}
        kept = [r for r in rows if r["seq"] is None or r["seq"] < len(state.nodes)]
        return EventsPage(kept, state, patches, include_r3, pruned, r3_raw)

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
            record = restore_record(payload, node.prompt, r3)
            if r3_raw and patch is None:
                record = inline_r3_as_bin(record)
            # A payload that was never moved to a patch row (`""`, null) is
            # still in the stored JSON: `include_r3=false` leaves it out too.
            out["record"] = record if include_r3 else without_r3(record)
            out["metadata"] = payload.get("metadata")
        else:
            out.update(payload)
        return out

    async def list_sessions(
        self, status: str | None, after: str | None, limit: int, filters: LabelFilters,
    ) -> dict[str, Any]:
        """Sessions in the order their opens committed, behind the feed's fence, so a
        tailing reader never skips an open that committed late."""
        start = cursor.decode(after, 2)
        rows = await self._summaries(
            sa.select(sessions)
            .where(sa.tuple_(sessions.c.xid, sessions.c.id) > sa.tuple_(*start))
            .order_by(sessions.c.xid, sessions.c.id).limit(limit), status, filters)
        if rows:
            last, _summary = rows[-1]
            next_cursor = cursor.encode(last["xid"], last["id"])
        else:
            next_cursor = after or cursor.encode(*start)
        return {"sessions": [summary for _row, summary in rows], "next": next_cursor}

    async def _summaries(self, query: Any, status: str | None,
                         filters: LabelFilters) -> list[tuple[Any, dict[str, Any]]]:
        """The session rows `query` selects with the status and label filters, behind
        the feed's fence, each with its summary (`opened_by` included)."""
        query = query.where(*label_filter(filters))
        if status is not None:
            query = query.where(sessions.c.status == status)
        async with self.db.read() as conn:
            fence = await feed_fence(conn, sessions.c.xid)
            if fence is not None:
                query = query.where(fence)
            rows = (await conn.execute(query)).mappings().all()
            openers = await opened_by(conn, [r["session_id"] for r in rows])
        return [(r, {**session_summary(r), "opened_by": openers.get(r["session_id"])})
                for r in rows]

    async def newest_sessions(self, status: str | None, limit: int,
                              filters: LabelFilters) -> dict[str, Any]:
        """The last `limit` sessions of `list_sessions`' order (the newest opens), in
        that order, and whether older ones match too (`more`); read newest first, a
        page of at most NEWEST_PAGE rows at a time."""
        found: list[dict[str, Any]] = []
        before: tuple[Any, Any] | None = None
        while True:
            query = sa.select(sessions).order_by(sessions.c.xid.desc(), sessions.c.id.desc())
            if before is not None:
                query = query.where(sa.tuple_(sessions.c.xid, sessions.c.id)
                                    < sa.tuple_(*before))
            want = min(NEWEST_PAGE, limit + 1 - len(found))
            rows = await self._summaries(query.limit(want), status, filters)
            found += [summary for _row, summary in rows]
            if len(rows) < want or len(found) > limit:
                return {"sessions": found[:limit][::-1], "more": len(found) > limit}
            last, _summary = rows[-1]
            before = (last["xid"], last["id"])

    async def _feed_page(self, after: tuple[int, ...], limit: int) -> list[Any]:
        async with self.db.read() as conn:
            query = (
                sa.select(events.c.position, events.c.session_id, events.c.seq, events.c.type,
                          events.c.recorded_us, events.c.xid)
                .where(sa.tuple_(events.c.xid, events.c.position) > sa.tuple_(*after))
                .order_by(events.c.xid, events.c.position)
                .limit(limit)
            )
            fence = await feed_fence(conn)
            if fence is not None:
                query = query.where(fence)
            return list(await conn.execute(query))

    async def _names_an_event(self, at: tuple[int, ...]) -> bool:
        """A feed cursor names the last event of a page this server gave: an event row
        (events are never deleted), or the start."""
        async with self.db.read() as conn:
            found = (await conn.execute(
                sa.select(events.c.position)
                .where(events.c.position == at[1], events.c.xid == at[0]))).first()
        return found is not None

    async def feed_end(self) -> str:
        """The cursor after the last event a reader can see now (`tail` starts there)."""
        async with self.db.read() as conn:
            query = (sa.select(events.c.xid, events.c.position)
                     .order_by(events.c.xid.desc(), events.c.position.desc()).limit(1))
            fence = await feed_fence(conn)
            if fence is not None:
                query = query.where(fence)
            last = (await conn.execute(query)).first()
        return cursor.encode(*(last if last is not None else cursor.decode(None, 2)))

    async def feed(
        self, after: str | None, limit: int, wait: float | None,
        closing: asyncio.Event | None = None,
    ) -> dict[str, Any]:
        """At most `limit` events after the cursor, waiting up to `wait` seconds for one
        (both parsed: `FEED_PAGE`, `parse_wait`), or until `closing` is set (the server
        is shutting down: the page as it stands)."""
        start = cursor.decode(after, 2)
        if after and start != cursor.START and not await self._names_an_event(start):
            # Well formed but made up (or another store's): its page would stay empty
            # for ever, and a reader that saved it would wait for ever.
            raise cursor.not_issued(after)
        deadline = time.monotonic() + (wait or 0.0)
        while True:
            wakeup = self.new_events
            rows = await self._feed_page(start, limit)
            remaining = deadline - time.monotonic()
            if rows or remaining <= 0 or (closing is not None and closing.is_set()):
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
