"""Analytics reads: SpecInfo rates per group and the metrics of a rollout.

Owns the queries behind `GET /v1/analytics/spec` and `GET /v1/metrics/rollout`.
The spec rates are read from the `spec_turns` view of migration 0002 (the
§3 guard is applied there, once, for SQL users and for the API alike) and
grouped with the same SUM/COUNT as the `spec_rates_by_<key>` views; the
rates are then the domain's (`SpecInfo.accept_rate`/`accept_length`, float64
division of the integer sums, which the views reproduce bit for bit).
Rollout metrics read closed sessions' carriers and sample rows and hand
them to `app/domain/ci/rollout_metrics.py`. Refuses to own any rule: no guard,
ratio or mismatch rate is computed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from app.domain.body.labels import LabelFilters
from app.domain.body.queries import GROUP_BY_VALUES
from app.domain.body.specinfo import SPEC_INFO_COLUMNS, SPEC_INFO_KEYS, SpecInfo
from app.domain.ci.rollout_metrics import SampleRow, SessionRow, check_strict, rollout_metrics
from app.domain.wire import jsonio
from app.store.engine.db import Database
from app.store.engine.dialect import code_point_order
from app.store.engine.schema import samples, sessions
from app.store.read.selects import label_filter

# `group_by` value (`GROUP_BY_VALUES`) → column of the `spec_turns` view.
GROUP_COLUMN: Mapping[str, str] = {
    **{value: value for value in GROUP_BY_VALUES},
    "hour": "record_hour",
    "day": "record_day",
}
assert tuple(GROUP_COLUMN) == GROUP_BY_VALUES

spec_turns = sa.table(
    "spec_turns",
    sa.column("session_id", sa.String),
    *(sa.column(column, sa.Text) for column in GROUP_COLUMN.values()),
    *(sa.column(key, sa.BigInteger) for key in SPEC_INFO_KEYS),
)


def key_order(conn: AsyncConnection, key: ColumnElement[Any]) -> list[ColumnElement[Any]]:
    """Ascending key order, NULL first, text compared by code point on both dialects:
    Python's `sorted(keys, key=lambda k: (k is not None, k or ""))`."""
    return [sa.case((key.is_(None), 0), else_=1), code_point_order(conn, key)]


def spec_group_query(group_by: str, filters: LabelFilters) -> sa.Select[Any]:
    """The grouped SUM/COUNT over `spec_turns`; `filters` match session labels as text."""
    key = spec_turns.c[GROUP_COLUMN[group_by]]
    query = sa.select(
        key.label("key"),
        sa.func.count(sa.distinct(spec_turns.c.session_id)).label("sessions"),
        sa.func.count().label("turns"),
        *(sa.func.sum(spec_turns.c[name]).label(name) for name in SPEC_INFO_KEYS),
    ).group_by(key)
    return query.where(*label_filter(filters, spec_turns.c.session_id))


def spec_group(row: Any) -> dict[str, Any]:
    info = SpecInfo.from_dict(row)
    return {
        "key": row["key"],
        "sessions": int(row["sessions"]),
        "turns": int(row["turns"]),
        **info.as_dict(),
        "accept_rate": info.accept_rate,
        "accept_length": info.accept_length,
    }


class Analytics:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def spec_rates(self, group_by: str, filters: LabelFilters) -> dict[str, Any]:
        """`GET /v1/analytics/spec`: one group per parsed `group_by` key over every turn."""
        query = spec_group_query(group_by, filters)
        async with self.db.read() as conn:
            key = spec_turns.c[GROUP_COLUMN[group_by]]
            rows = (await conn.execute(query.order_by(*key_order(conn, key)))).mappings().all()
        return {"groups": [spec_group(row) for row in rows]}

    async def rollout_sessions(self, filters: LabelFilters) -> list[SessionRow]:
        """The closed sessions matching `filters`, with their carriers and sample rows."""
        clauses = [sessions.c.status == "closed", *label_filter(filters)]
        async with self.db.read() as conn:
            heads = (await conn.execute(
                sa.select(sessions.c.session_id, sessions.c.version, sessions.c.spec,
                          *(sessions.c[column] for column in SPEC_INFO_COLUMNS.values()))
                .where(*clauses).order_by(sessions.c.id)
            )).all()
            sample_rows = (await conn.execute(
                sa.select(samples.c.session_id, samples.c.response_length, samples.c.status,
                          samples.c.sample_metadata)
                .select_from(samples.join(sessions,
                                          sessions.c.session_id == samples.c.session_id))
                .where(*clauses).order_by(samples.c.session_id, samples.c.sample_index)
            )).all()
        by_session: dict[str, list[SampleRow]] = {}
        for row in sample_rows:
            mismatch = jsonio.loads(row.sample_metadata).get("tito_session_mismatch")
            by_session.setdefault(row.session_id, []).append(
                SampleRow(response_length=row.response_length, status=row.status,
                          mismatch=mismatch))
        return [
            SessionRow(
                session_id=head.session_id,
                version=head.version,
                samples=tuple(by_session.get(head.session_id, ())),
                carrier=SpecInfo.from_columns(head._mapping) if head.spec else None,
            )
            for head in heads
        ]

    async def rollout(self, filters: LabelFilters, strict: bool = False
                      ) -> dict[str, float | int]:
        """`GET /v1/metrics/rollout`; with `strict`, a non-zero strict TITO rate is 409."""
        metrics = rollout_metrics(await self.rollout_sessions(filters))
        if strict:
            check_strict(metrics)
        return metrics
