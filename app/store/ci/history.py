"""CI metric history: storing submissions and reading a run's merged series.

Owns the rows of `metric_submissions` / `metric_points`: a submission is
stored once (a repeat with the same normalized body within the same run
attempt is a no-op, so CI can retry blindly), keeping only whitelisted
points, in submission order; a non-finite value is stored as its marker
(`non_finite`) because SQLite cannot hold NaN. Reading a run folds its
submissions into one series per attempt (submissions in commit order) and
merges the attempts with `merge_attempts`. Also records a rollout's metrics
(`GET /v1/metrics/rollout`) as the points of one step. Refuses to own the
submission rules, the whitelist default and the merge order
(`app/domain/ci/metric_history.py`) and anything about gates (`gates.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from app.domain.ci.metric_history import (
    DEFAULT_METRIC_KEYS,
    NON_FINITE,
    HistorySubmission,
    MetricPoint,
    RolloutRecord,
    RunCoordinate,
    Series,
    encode_series,
    encode_value,
    keep_whitelisted,
    merge_attempts,
    rollout_dropped,
)
from app.domain.wire import jsonio
from app.store.engine.db import Database, now_us
from app.store.engine.schema import metric_points, metric_submissions
from app.store.read.analytics import Analytics


def metric_keys(configured: Iterable[str]) -> frozenset[str]:
    """The whitelist from the setting (a list, parsed by app.settings); empty means the
    default list."""
    return frozenset(configured) or DEFAULT_METRIC_KEYS


def run_key(coordinate: RunCoordinate, run_id: str) -> str:
    return jsonio.fingerprint({"coordinate": coordinate.as_dict(), "run_id": run_id})


def point_row(submission_id: int, ord_: int, point: MetricPoint) -> dict[str, Any]:
    finite = math.isfinite(point.value)
    return {"submission_id": submission_id, "ord": ord_, "metric": point.metric,
            "step": point.step, "value": point.value if finite else None,
            "non_finite": None if finite else encode_value(point.value)}


def point_value(value: float | None, non_finite: str | None) -> float:
    if non_finite is not None:
        return NON_FINITE[non_finite]
    assert value is not None
    return float(value)


@dataclass(frozen=True)
class RunHistory:
    """A run's merged series; `trusted` only if every submission of it said so."""

    coordinate: RunCoordinate
    run_id: str
    attempts: tuple[int, ...] = ()
    submissions: int = 0
    trusted: bool = False
    series: Mapping[str, Series] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "coordinate": self.coordinate.as_dict(),
            "run_id": self.run_id,
            "attempts": list(self.attempts),
            "submissions": self.submissions,
            "trusted": self.trusted,
            "series": {metric: encode_series(points) for metric, points in self.series.items()},
        }


async def load_run(conn: AsyncConnection, coordinate: RunCoordinate, run_id: str) -> RunHistory:
    """Every attempt of the run merged (`merge_attempts`); an unknown run is empty."""
    subs = (await conn.execute(
        sa.select(metric_submissions.c.id, metric_submissions.c.attempt,
                  metric_submissions.c.trusted)
        .where(metric_submissions.c.run_key == run_key(coordinate, run_id))
        .order_by(metric_submissions.c.attempt, metric_submissions.c.id)
    )).all()
    if not subs:
        return RunHistory(coordinate, run_id)
    per_attempt: dict[int, dict[str, Series]] = {sub.attempt: {} for sub in subs}
    attempt_of = {sub.id: sub.attempt for sub in subs}
    points = await conn.execute(
        sa.select(metric_points.c.submission_id, metric_points.c.metric, metric_points.c.step,
                  metric_points.c.value, metric_points.c.non_finite)
        .join(metric_submissions, metric_submissions.c.id == metric_points.c.submission_id)
        .where(metric_submissions.c.run_key == run_key(coordinate, run_id))
        .order_by(metric_submissions.c.attempt, metric_points.c.submission_id,
                  metric_points.c.ord)
    )
    for row in points:
        series = per_attempt[attempt_of[row.submission_id]]
        series.setdefault(row.metric, []).append(
            (row.step, point_value(row.value, row.non_finite)))
    return RunHistory(
        coordinate=coordinate,
        run_id=run_id,
        attempts=tuple(per_attempt),
        submissions=len(subs),
        trusted=all(bool(sub.trusted) for sub in subs),
        series=merge_attempts(per_attempt[attempt] for attempt in sorted(per_attempt)),
    )


class History:
    def __init__(self, db: Database, keys: Iterable[str] = DEFAULT_METRIC_KEYS) -> None:
        self.db = db
        self.keys = frozenset(keys)

    async def submit(self, submission: HistorySubmission) -> tuple[dict[str, Any], bool]:
        """`POST /v1/metric-history` (parsed by `parse_submission`): the run's merged
        history after this submission."""
        kept = keep_whitelisted(submission.points, self.keys)
        key = run_key(submission.coordinate, submission.run_id)
        fingerprint = jsonio.fingerprint(submission.body())
        try:
            async with self.db.write() as conn:
                created = await self._insert(conn, submission, key, fingerprint, kept)
        except IntegrityError:
            # The same body committed concurrently (PostgreSQL): answer as a repeat.
            created = False
        run = await self.run(submission.coordinate, submission.run_id)
        dropped = sorted({p.metric for p in submission.points} - {p.metric for p in kept})
        return {**run.as_dict(), "attempt": submission.attempt, "kept": len(kept),
                "dropped": dropped}, created

    @staticmethod
    async def _insert(conn: AsyncConnection, submission: HistorySubmission, key: str,
                      fingerprint: str, kept: tuple[MetricPoint, ...]) -> bool:
        """Insert the submission and its kept points; False if it is already stored."""
        existing = (await conn.execute(
            sa.select(metric_submissions.c.id)
            .where(metric_submissions.c.run_key == key)
            .where(metric_submissions.c.attempt == submission.attempt)
            .where(metric_submissions.c.fingerprint == fingerprint)
        )).first()
        if existing is not None:
            return False
        submission_id = (await conn.execute(
            metric_submissions.insert().values(
                run_key=key, run_id=submission.run_id, attempt=submission.attempt,
                trusted=submission.trusted, fingerprint=fingerprint,
                recorded_us=now_us(), **submission.coordinate.as_dict(),
            ).returning(metric_submissions.c.id)
        )).scalar_one()
        if kept:
            await conn.execute(metric_points.insert(), [
                point_row(submission_id, i, point) for i, point in enumerate(kept)])
        return True

    async def run(self, coordinate: RunCoordinate, run_id: str) -> RunHistory:
        async with self.db.read() as conn:
            return await load_run(conn, coordinate, run_id)

    async def record_rollout(self, record: RolloutRecord,
                             analytics: Analytics) -> tuple[dict[str, Any], bool]:
        """`POST /v1/metric-history/rollout` (parsed by `parse_rollout_record`): the
        rollout metrics of the sessions `record.labels` selects, as the points of
        one step."""
        metrics = await analytics.rollout(record.labels)
        reply, created = await self.submit(record.submission(metrics, self.keys))
        # The submission holds the whitelisted metrics only: the rest is named here.
        return {**reply, "dropped": rollout_dropped(metrics, self.keys),
                "metrics": metrics}, created
