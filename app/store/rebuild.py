"""Rebuild: drop every projection row of a session and recompute it from the log.

The rows come from `app.domain.projections.project_session`, the same
functions the inline writers use, so a rebuild reproduces them bit for bit.
A checksum per projection before and after proves it, and every row of the
log and the projections must belong to a session that exists: rows whose
session was deleted behind the server's back are reported (they cannot be
rebuilt, and equal checksums would otherwise hide them). One short write
transaction per session (locked like an append), so a rebuild can run next
to a live server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.domain.projections import checksum, project_session
from app.store.db import Database
from app.store.loader import FoldLog, fold_events, session_row
from app.store.schema import metadata, nodes, samples, session_labels, sessions

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
    query = sa.select(*_columns(table))
    if session_ids is not None:
        query = query.where(table.c.session_id.in_(session_ids))
    return [dict(row) for row in (await conn.execute(query)).mappings()]


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


async def all_session_ids(db: Database) -> list[str]:
    async with db.read() as conn:
        return list((await conn.execute(
            sa.select(sessions.c.session_id).order_by(sessions.c.id))).scalars())


async def computed_rows(conn: AsyncConnection, session_id: str) -> dict[str, list[dict[str, Any]]]:
    """What the projections of `session_id` must hold, folded from its events."""
    log = FoldLog()
    state = await fold_events(conn, None, session_id, 0, log)
    return project_session(state, log.opened_us, log.closed_us, log.turns)


async def rebuild_session(db: Database, session_id: str) -> None:
    async with db.write() as conn:
        await session_row(conn, session_id, lock=True)
        rows = await computed_rows(conn, session_id)
        for name in ("samples", "nodes", "session_labels"):
            table = PROJECTIONS[name]
            await conn.execute(table.delete().where(table.c.session_id == session_id))
            if rows[name]:
                await conn.execute(table.insert(), rows[name])
        # The key is not rewritten (Citus refuses any SET of the distribution column).
        head = {k: v for k, v in rows["sessions"][0].items() if k != "session_id"}
        await conn.execute(sessions.update().where(sessions.c.session_id == session_id)
                           .values(**head))


@dataclass
class RebuildReport:
    sessions: int
    before: dict[str, str]
    after: dict[str, str]
    mismatched: list[str] = field(default_factory=list)
    # Rows whose session has no `sessions` row (deleted behind the server's back):
    # {table: {session_id: rows}}. A rebuild cannot account for them.
    orphans: dict[str, dict[str, int]] = field(default_factory=dict)

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
) -> RebuildReport:
    ids = [session_id] if session_id is not None else await all_session_ids(db)
    if session_id is not None:
        async with db.read() as conn:
            await session_row(conn, session_id)
    scope = ids if session_id is not None else None
    before = await checksums(db, scope)
    for done, sid in enumerate(ids, start=1):
        await rebuild_session(db, sid)
        if progress is not None:
            progress(done, len(ids))
    after = await checksums(db, scope)
    mismatched = [name for name in PROJECTIONS if before[name] != after[name]]
    orphans = await orphaned_rows(db, session_id)
    return RebuildReport(len(ids), before, after, mismatched, orphans)
