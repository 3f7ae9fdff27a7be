"""What the recording gateway asks the store beyond appends: its open sessions.

`open_sessions_opened_by` finds the open sessions whose open body names an
opener (`"opened_by": "gateway"`), with the time of their last event, so a
gateway that starts again can still close the ones left idle;
`last_event_us` is one session's last event time, so a gateway does not
close for idleness a session another gateway is recording. Read-only.
"""

from __future__ import annotations

import sqlalchemy as sa

from app.domain.log.events import SESSION_OPENED
from app.domain.wire import jsonio
from app.store.engine.db import Database
from app.store.engine.schema import events, sessions


async def open_sessions_opened_by(db: Database, opened_by: str) -> list[tuple[str, int]]:
    """`(session_id, last event's recorded_us)` of each open session opened by `opened_by`."""
    # The stored open body is compact JSON (jsonio.dumps): the pair appears as written
    # here. It may appear in the labels too (a label named "opened_by"): the search only
    # narrows the rows, the open body's own field decides.
    needle = jsonio.dumps({"opened_by": opened_by})[1:-1]
    opened = events.alias("opened")
    latest = (sa.select(sa.func.max(events.c.recorded_us))
              .where(events.c.session_id == sessions.c.session_id)
              .scalar_subquery())
    query = (sa.select(sessions.c.session_id, latest.label("last_us"), opened.c.payload)
             .join(opened, opened.c.session_id == sessions.c.session_id)
             .where(sessions.c.status == "open")
             .where(opened.c.type == SESSION_OPENED)
             .where(opened.c.payload.contains(needle, autoescape=True)))
    async with db.read() as conn:
        rows = (await conn.execute(query)).all()
    return [(row.session_id, int(row.last_us)) for row in rows
            if jsonio.loads_stored(row.payload)["session"].get("opened_by") == opened_by]


async def last_event_us(db: Database, session_id: str) -> int | None:
    """The `recorded_us` of the session's last event (None: no such session)."""
    query = sa.select(sa.func.max(events.c.recorded_us)).where(events.c.session_id == session_id)
    async with db.read() as conn:
        last = (await conn.execute(query)).scalar()
    return None if last is None else int(last)
