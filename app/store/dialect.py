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


async def fence_lag_seconds(conn: AsyncConnection) -> float:
    """Age of the oldest running transaction that holds the feed fence back."""
    if conn.dialect.name != "postgresql":
        return 0.0
    value = (await conn.execute(sa.text(
        "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(xact_start)), 0) "
        "FROM pg_stat_activity WHERE backend_xid IS NOT NULL"
    ))).scalar()
    return float(value or 0.0)
