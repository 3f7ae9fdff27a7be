"""Regression gates against the metric history: `POST /v1/gates/evaluate`, `turnlog gate check`.

Owns the I/O around `app/domain/ci/gates.py` (gates parsed by `gate_definitions.py`):
reading a run's merged series, fetching per coordinate the most recent
trusted baseline values of *other* runs (newest first, at most the window),
and storing the rows the run contributes (`baseline_rows`, trusted per
`row_trust`) in the same transaction, so two evaluations never see half of
each other. A re-evaluated
run replaces its own rows (value and trust) but keeps its original place in
time. Refuses to own any rule: selection, corridor, status and verdict are
the domain's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from app.domain.ci.gate_definitions import GateCheck
from app.domain.ci.gates import (
    BASELINE_WINDOW,
    BaselineRow,
    GateCoordinate,
    Verdict,
    baseline_rows,
    coordinates,
    evaluate,
    row_trust,
)
from app.domain.wire import jsonio
from app.store.ci.history import RunHistory, load_run
from app.store.engine.db import Database, now_us
from app.store.engine.dialect import upsert
from app.store.engine.schema import gate_baselines

CHUNK = 500


def coordinate_key(coordinate: GateCoordinate) -> str:
    return jsonio.fingerprint(dataclasses.asdict(coordinate))


@dataclass(frozen=True)
class GateReport:
    run: RunHistory
    verdict: Verdict
    rows: tuple[BaselineRow, ...]
    baseline: bool
    recorded: bool

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.verdict.as_dict(),
            "run_id": self.run.run_id,
            "run_trusted": self.run.trusted,
            "exit_code": self.exit_code,
            "recorded": {"rows": len(self.rows), "baseline": self.baseline}
            if self.recorded else None,
        }


async def baseline_values(
    conn: AsyncConnection, wanted: Sequence[GateCoordinate], run_id: str,
    window: int = BASELINE_WINDOW,
) -> dict[GateCoordinate, list[float]]:
    """Per coordinate, the trusted values of other runs, newest first, at most `window`."""
    by_key = {coordinate_key(c): c for c in wanted}
    keys = list(by_key)
    found: dict[GateCoordinate, list[float]] = {}
    for start in range(0, len(keys), CHUNK):
        rank = sa.func.row_number().over(
            partition_by=gate_baselines.c.coordinate_key,
            order_by=(gate_baselines.c.recorded_us.desc(), gate_baselines.c.id.desc()),
        ).label("rank")
        recent = (
            sa.select(gate_baselines.c.coordinate_key, gate_baselines.c.value, rank)
            .where(gate_baselines.c.coordinate_key.in_(keys[start:start + CHUNK]))
            .where(gate_baselines.c.trusted.is_(True))
            .where(gate_baselines.c.run_id != run_id)
            .subquery()
        )
        rows = await conn.execute(
            sa.select(recent.c.coordinate_key, recent.c.value)
            .where(recent.c.rank <= window)
            .order_by(recent.c.coordinate_key, recent.c.rank)
        )
        for row in rows:
            found.setdefault(by_key[row.coordinate_key], []).append(float(row.value))
    return found


async def store_rows(conn: AsyncConnection, rows: Sequence[BaselineRow]) -> None:
    recorded_us = now_us()
    values = [{
        "coordinate_key": coordinate_key(row.coordinate),
        **dataclasses.asdict(row.coordinate),
        "run_id": row.run_id,
        "value": row.value,
        "trusted": row.trusted,
        "recorded_us": recorded_us,
    } for row in rows]
    for start in range(0, len(values), CHUNK):
        # A re-evaluated run replaces its value and trust, keeping its place in time.
        await conn.execute(upsert(conn, gate_baselines, values[start:start + CHUNK],
                                  index_elements=("coordinate_key", "run_id"),
                                  update=("value", "trusted")))


class Gates:
    def __init__(self, db: Database, window: int = BASELINE_WINDOW) -> None:
        self.db = db
        self.window = window

    async def evaluate(self, check: GateCheck) -> dict[str, Any]:
        """`POST /v1/gates/evaluate` (parsed by `parse_check`): the verdict with every
        coordinate judged."""
        return (await self.check(check)).as_dict()

    async def check(self, check: GateCheck) -> GateReport:
        if check.record:
            async with self.db.write() as conn:
                return await self._judge(conn, check)
        async with self.db.read() as conn:
            return await self._judge(conn, check)

    async def _judge(self, conn: AsyncConnection, check: GateCheck) -> GateReport:
        run = await load_run(conn, check.coordinate, check.run_id)
        wanted = coordinates(check.coordinate, check.gates, run.series)
        history = await baseline_values(conn, wanted, check.run_id, self.window)
        verdict = evaluate(check.coordinate, check.gates, run.series, history, self.window)
        trusted = row_trust(run.trusted, verdict)
        rows = baseline_rows(check.coordinate, check.run_id, check.gates, run.series, trusted)
        if check.record and rows:
            await store_rows(conn, rows)
        return GateReport(run=run, verdict=verdict, rows=tuple(rows), baseline=trusted,
                          recorded=check.record)
