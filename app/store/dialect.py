"""The only dialect-specific SQL of the store.

PostgreSQL's feed fence: a reader takes only events whose writing transaction
id is below the oldest transaction still running in its snapshot
(`pg_snapshot_xmin(pg_current_snapshot())`), so an insert that commits after
a later one was read can never be skipped. SQLite has a single writer and its
rowid order is commit order, so it needs no fence.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from app.store.schema import events

PG_XMIN = "pg_snapshot_xmin(pg_current_snapshot())::text::bigint"


def feed_fence(
    conn: AsyncConnection, xid: ColumnElement[int] = events.c.xid
) -> ColumnElement[bool] | None:
    """Rows of transactions that can no longer commit behind a reader (PG only)."""
    if conn.dialect.name == "postgresql":
        return xid < sa.text(PG_XMIN)
    return None


async def fence_lag_seconds(conn: AsyncConnection, now_us: int) -> float:
    """How far the feed fence holds readers back, in seconds (0.0 on SQLite).

    The larger of: how long the oldest committed event still behind the fence
    has waited (from the events table: needs no grant, sees every role's
    writes), and the age of the oldest running transaction with an xid that
    `pg_stat_activity` shows (without `pg_read_all_stats` only this role's own:
    other roles' `xact_start` reads NULL, which is why the first part exists).
    """
    if conn.dialect.name != "postgresql":
        return 0.0
    held_us = (await conn.execute(
        sa.select(sa.func.min(events.c.recorded_us)).where(events.c.xid >= sa.text(PG_XMIN))
    )).scalar()
    running = (await conn.execute(sa.text(
        "SELECT EXTRACT(EPOCH FROM clock_timestamp() - min(xact_start)) "
        "FROM pg_stat_activity WHERE backend_xid IS NOT NULL"
    ))).scalar()
    held = 0.0 if held_us is None else max(0.0, (now_us - int(held_us)) / 1e6)
    return max(held, float(running or 0.0))
