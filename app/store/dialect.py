"""The only dialect-specific SQL of the store.

PostgreSQL's feed fence: a reader takes only events whose writing transaction
id is below the oldest transaction still running in its snapshot
(`pg_snapshot_xmin(pg_current_snapshot())`), so an insert that commits after
a later one was read can never be skipped. SQLite has a single writer and its
rowid order is commit order, so it needs no fence.

The horizon is read by a statement of its own, before the page query, and
bound as a value. On a single PostgreSQL that changes nothing (a transaction
below the horizon committed before it was read, so the page's later snapshot
sees it). On Citus it is what makes the fence valid at all: transaction ids
are per node, and a function in a query over distributed tables runs on the
workers, against the workers' own ids. turnlog's rows carry the
*coordinator's* transaction id (the column default is evaluated on the
coordinator, where every insert is planned), and the horizon must be the
coordinator's too. It holds because every write transaction of turnlog
touches one session, so one worker: Citus commits such a transaction on the
worker (one-phase commit) before the coordinator's own commit ends it, so
once the coordinator no longer sees it running, its rows are visible on the
worker. (A transaction spanning two workers would use two-phase commit,
whose COMMIT PREPARED follows the coordinator's commit; turnlog has none.)
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from app.store.schema import events

PG_XMIN = "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint"


async def feed_fence(
    conn: AsyncConnection, xid: ColumnElement[int] = events.c.xid
) -> ColumnElement[bool] | None:
    """Rows of transactions that can no longer commit behind a reader (PG only)."""
    if conn.dialect.name != "postgresql":
        return None
    horizon = int((await conn.execute(sa.text(PG_XMIN))).scalar_one())
    return xid < horizon


async def fence_lag_seconds(conn: AsyncConnection) -> float:
    """Age of the oldest running transaction that holds the feed fence back."""
    if conn.dialect.name != "postgresql":
        return 0.0
    value = (await conn.execute(sa.text(
        "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(xact_start)), 0) "
        "FROM pg_stat_activity WHERE backend_xid IS NOT NULL"
    ))).scalar()
    return float(value or 0.0)
