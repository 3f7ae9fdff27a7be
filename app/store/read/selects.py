"""SELECT helpers shared by the store's readers: label filters and abbreviated
session ids.

Owns building these clauses and reply shapes once, so the readers (`reads.py`,
`browse.py`), the consumer groups (`consumers.py`), analytics and the CLI
compose them instead of importing one another. Refuses to run a transaction of
its own (except `sessions_with_prefix`, which the caller's connection runs) and
any write.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.domain.body.labels import LabelFilters
from app.store.engine.schema import session_labels, sessions


def label_filter(
    filters: LabelFilters,
    session_id: sa.ColumnElement[Any] = sessions.c.session_id,
) -> list[sa.ColumnElement[bool]]:
    """EXISTS clauses, one per filter, correlated to `session_id` (any table's column)."""
    return [sa.exists().where(
        session_labels.c.session_id == session_id,
        session_labels.c.key == key,
        session_labels.c.value_text == value,
    ) for key, value in filters]


async def sessions_with_prefix(conn: AsyncConnection, prefix: str, limit: int) -> list[str]:
    """Session ids starting with `prefix` (the exact id first), at most `limit` of them:
    how a person's abbreviated id (the demo prints suffixes) becomes a session."""
    # substr, not LIKE: SQLite's LIKE ignores case, and `_`/`%` would need escaping.
    exact = (await conn.execute(sa.select(sessions.c.session_id)
                                .where(sessions.c.session_id == prefix))).scalars().all()
    rows = (await conn.execute(
        sa.select(sessions.c.session_id)
        .where(sa.func.substr(sessions.c.session_id, 1, len(prefix)) == prefix)
        .order_by(sessions.c.session_id).limit(limit))).scalars().all()
    return list(dict.fromkeys([*exact, *rows]))
