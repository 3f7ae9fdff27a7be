"""Rebuild: drop every projection row of a session and recompute it from the log.

The rows come from `app.domain.projection.rows.project_session`, the same
functions the inline writers use, so a rebuild reproduces them bit for bit.
A checksum per projection before and after proves it. Sessions are rebuilt
in batches (in `sessions.id` order): one short write transaction per batch
(its sessions locked like an append, so a rebuild can run next to a live
server), one query for the batch's events and one for its patches, bulk
deletes and inserts. Next to a live writer the rebuilt rows are exact, but
the before/after checksums are not comparable (the writer changed the
projections between them): the report then counts the events written
meanwhile (`changed`) and the command says it needs a quiet store to prove
equality. A batch is the unit of progress: `start_after` and
`on_batch` let a caller persist where it stands and resume there. Every row of the log and
the projections must belong to a session that exists: rows whose session
was deleted behind the server's back are reported (they cannot be rebuilt,
and equal checksums would otherwise hide them).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.domain.projection.rows import checksum, project_session
from app.store.engine.db import Database
from app.store.engine.dialect import bulk_insert, lock_sessions, single_writer
from app.store.engine.schema import (
    events,
    metadata,
    nodes,
    r3_patches,
    samples,
    session_labels,
    sessions,
)
from app.store.fold.loader import FoldLog, fold_events, fold_rows, session_row

BATCH_SESSIONS = 200
PARALLEL_BATCHES = 2

PROJECTIONS: dict[str, sa.Table] = {
    "sessions": sessions,
    "session_labels": session_labels,
    "nodes": nodes,
    "samples": samples,
}


def _columns(table: sa.Table) -> list[sa.Column[Any]]:
    # `sessions.id` and `.xid` place the row in the list's order (its cursor), they are
    # not values projected from events; `.r3_pruned_bytes` is retention's mark, written
    # with its `r3_pruned` event and never rewritten by a rebuild.
    return [c for c in table.columns
            if not (table is sessions and c.name in ("id", "xid", "r3_pruned_bytes"))]


async def projection_rows(
    conn: AsyncConnection, name: str, session_ids: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    table = PROJECTIONS[name]
    columns = _columns(table)
    query = sa.select(*columns)
    if session_ids is not None:
        query = query.where(table.c.session_id.in_(session_ids))
    # Plain tuples zipped with the names: a third of the cost of SQLAlchemy's mappings.
    keys = [c.name for c in columns]
    return [dict(zip(keys, row, strict=True)) for row in (await conn.execute(query)).all()]


async def checksums(db: Database, session_ids: Sequence[str] | None = None) -> dict[str, str]:
    ids = None if session_ids is None else list(session_ids)
    out: dict[str, str] = {}
    async with db.read() as conn:
        for name in PROJECTIONS:
            if ids is None:
                rows = await projection_rows(conn, name)
            else:
                # Chunk the IN list: SQLite caps bound parameters per statement.
                rows = []
                for i in range(0, len(ids), 500):
                    rows += await projection_rows(conn, name, ids[i:i + 500])
            out[name] = checksum(rows)
    return out


async def log_mark(db: Database, session_ids: Sequence[str] | None = None) -> int:
    """The events of the log, or of some sessions' part of it: events are only ever
    added (appends, opens, closes, retention marks), so a change means a writer."""
    query = sa.select(sa.func.count()).select_from(events)
    if session_ids is not None:
        query = query.where(events.c.session_id.in_(list(session_ids)))
    async with db.read() as conn:
        return int((await conn.execute(query)).scalar_one())


async def all_session_ids(db: Database) -> list[str]:
    return [sid for _id, sid in await session_keys(db)]


async def session_keys(db: Database, after_id: int | None = None) -> list[tuple[int, str]]:
    """`(sessions.id, session_id)` in id order, optionally after an id (resume)."""
    query = sa.select(sessions.c.id, sessions.c.session_id).order_by(sessions.c.id)
    if after_id is not None:
        query = query.where(sessions.c.id > after_id)
    async with db.read() as conn:
        return [(int(row.id), row.session_id) for row in await conn.execute(query)]


async def computed_rows(conn: AsyncConnection, session_id: str) -> dict[str, list[dict[str, Any]]]:
    """What the projections of `session_id` must hold, folded from its events."""
    log = FoldLog()
    state = await fold_events(conn, None, session_id, 0, log)
    return project_session(state, log.opened_us, log.closed_us, log.turns)


async def rebuild_batch(db: Database, session_ids: Sequence[str]) -> None:
    """Rebuild the projections of several sessions in one transaction."""
    ids = list(session_ids)
    async with db.write() as conn:
        # Each session row as an append locks it, in id order like every batch, so two
        # rebuilds cannot deadlock.
        await lock_sessions(conn, ids)
        rows_by_session: dict[str, list[Any]] = defaultdict(list)
        for row in await conn.execute(
            sa.select(events.c.session_id, events.c.type, events.c.seq, events.c.event_id,
                      events.c.payload, events.c.prompt_lcp, events.c.prompt_delta,
                      events.c.position, events.c.recorded_us)
            .where(events.c.session_id.in_(ids)).order_by(events.c.position)
        ):
            rows_by_session[row.session_id].append(row)
        geometry: dict[str, dict[int, tuple[int, int]]] = defaultdict(dict)
        for patch in await conn.execute(
            sa.select(r3_patches.c.session_id, r3_patches.c.seq, r3_patches.c.start_row,
                      r3_patches.c.topk).where(r3_patches.c.session_id.in_(ids))
        ):
            geometry[patch.session_id][patch.seq] = (patch.start_row, patch.topk)
        computed: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for sid in ids:
            log = FoldLog()
            # Stored turns were validated when appended: the trusted fold skips it.
            state = fold_rows(None, sid, rows_by_session.get(sid, ()), geometry[sid], log,
                              trusted=True)
            for name, rows in project_session(state, log.opened_us, log.closed_us,
                                              log.turns).items():
                computed[name] += rows
        for name in ("samples", "nodes", "session_labels"):
            table = PROJECTIONS[name]
            await conn.execute(table.delete().where(table.c.session_id.in_(ids)))
            await bulk_insert(conn, table, computed[name])
        # One executemany per shape of row (open and closed heads differ in keys).
        shapes: dict[tuple[str, ...], list[dict[str, Any]]] = defaultdict(list)
        for head in computed["sessions"]:
            # The key is not rewritten (Citus refuses any SET of the distribution column).
            values = {k: v for k, v in head.items() if k != "session_id"}
            shapes[tuple(values)].append({**values, "b_session_id": head["session_id"]})
        for heads in shapes.values():
            await conn.execute(
                sessions.update().where(sessions.c.session_id == sa.bindparam("b_session_id")),
                heads)


@dataclass
class RebuildReport:
    sessions: int
    before: dict[str, str]
    after: dict[str, str]
    mismatched: list[str] = field(default_factory=list)
    # Rows whose session has no `sessions` row (deleted behind the server's back):
    # {table: {session_id: rows}}. A rebuild cannot account for them.
    orphans: dict[str, dict[str, int]] = field(default_factory=dict)
    # Events appended (or retention marks) in the rebuild's scope while it ran: a live
    # writer changed the projections between the two checksums, so `before` and `after`
    # cannot be compared. The rebuilt rows are still exact (each batch under the append
    # lock); only the proof needs a quiet store.
    changed: int = 0

    @property
    def equal(self) -> bool:
        return self.before == self.after

    @property
    def accounted(self) -> bool:
        return not self.orphans

    @property
    def ok(self) -> bool:
        return self.equal and self.accounted


# Every table whose rows belong to a session; each must find its `sessions` row.
OWNED = ("events", "r3_patches", "session_labels", "nodes", "samples")


async def orphaned_rows(db: Database, session_id: str | None = None) -> dict[str, dict[str, int]]:
    """Per table, the session ids (and row counts) with no `sessions` row."""
    out: dict[str, dict[str, int]] = {}
    async with db.read() as conn:
        for name in OWNED:
            table = metadata.tables[name]
            query = (sa.select(table.c.session_id, sa.func.count())
                     .where(~sa.exists().where(sessions.c.session_id == table.c.session_id))
                     .group_by(table.c.session_id).order_by(table.c.session_id))
            if session_id is not None:
                query = query.where(table.c.session_id == session_id)
            found = {row[0]: int(row[1]) for row in await conn.execute(query)}
            if found:
                out[name] = found
    return out


async def rebuild(
    db: Database,
    session_id: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    *,
    start_after: int | None = None,
    before: dict[str, str] | None = None,
    mark: int | None = None,
    on_batch: Callable[[int, dict[str, str], int], None] | None = None,
    batch_sessions: int = BATCH_SESSIONS,
    parallel: int = PARALLEL_BATCHES,
) -> RebuildReport:
    """Rebuild every session (or one), checksummed before and after.

    Resuming: `start_after` is the last `sessions.id` already rebuilt, `before`
    the checksums and `mark` the count of events (`log_mark`) taken when the
    interrupted run began; `on_batch(last_id, before, mark)` is called once every
    batch up to `last_id` has committed, so a caller can persist them. Events
    appended while the run was interrupted are then counted in `changed`. On
    PostgreSQL `parallel` batches run at once, each on its own connection (their
    sessions are disjoint; while one batch waits for the server another folds);
    SQLite has one writer and runs them one by one.
    """
    if session_id is not None:
        async with db.read() as conn:
            row = await session_row(conn, session_id)
        keys = [(int(row["id"]), session_id)]
        scope: list[str] | None = [session_id]
    else:
        keys = await session_keys(db)
        scope = None
    total = len(keys)
    if mark is None or before is None:  # a run from the start (or an old checkpoint)
        mark = await log_mark(db, scope)
    if before is None:
        before = await checksums(db, scope)
    todo = keys if start_after is None else [k for k in keys if k[0] > start_after]
    done = total - len(todo)
    if progress is not None:
        progress(done, total)
    width = 1 if single_writer(db.url) else max(1, parallel)
    batches = [todo[i:i + batch_sessions] for i in range(0, len(todo), batch_sessions)]
    for w in range(0, len(batches), width):
        # A wave of batches; the checkpoint only moves once the whole wave committed.
        wave = batches[w:w + width]
        await asyncio.gather(*(rebuild_batch(db, [sid for _id, sid in batch])
                               for batch in wave))
        done += sum(map(len, wave))
        if on_batch is not None:
            on_batch(wave[-1][-1][0], before, mark)
        if progress is not None:
            progress(done, total)
    after = await checksums(db, scope)
    changed = await log_mark(db, scope) - mark
    mismatched = [name for name in PROJECTIONS if before[name] != after[name]]
    orphans = await orphaned_rows(db, session_id)
    return RebuildReport(total, before, after, mismatched, orphans, changed)
