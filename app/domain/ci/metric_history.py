"""CI metric history: the submission body, value encoding, whitelist and attempt merge.

Owns the rules of `POST /v1/metric-history`: the run coordinate (test path,
backend, suite), run id, attempt, trusted flag and points `{metric, step,
value}`, where a value is a number or one of the strings `"NaN"`,
`"Infinity"`, `"-Infinity"` (anything else is a 422 naming `points[i].value`);
the JSON-safe encoding of non-finite floats; the whitelist of metric keys
kept; merging a run's attempts into one series per metric; turning a
rollout's metrics into points for one step.

Metric keys are compared as exact strings, never normalized: the versioned
TITO keys (`…/v1/assistant_text`, `…/v2/assistant_text`) are distinct keys
and so never merge. Judging values against a baseline is `gates.py`'s job;
storing them is the store's. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.domain.body.labels import LabelFilters, parse_label_filters
from app.domain.errors import InvalidRequest
from app.domain.wire.validate import (
    as_float,
    describe,
    is_int,
    reject_unknown,
    require_bool,
    require_object,
    require_text,
)

DEFAULT_METRIC_KEYS: frozenset[str] = frozenset({
    "train/grad_norm",
    "train/ppo_kl",
    "train/train_rollout_logprob_abs_diff",
    "train/train_rollout_kl",
    "rollout/raw_reward",
    "rollout/tito_session_mismatch_rate/v1/assistant_text",
    "rollout/tito_session_mismatch_rate/v2/assistant_text",
})
NON_FINITE: Mapping[str, float] = {"NaN": math.nan, "Infinity": math.inf,
                                   "-Infinity": -math.inf}
SUBMISSION_FIELDS = frozenset({"coordinate", "run_id", "attempt", "trusted", "points"})
ROLLOUT_FIELDS = frozenset({"coordinate", "run_id", "attempt", "trusted", "step", "labels"})
COORDINATE_FIELDS = frozenset({"test_path", "backend", "suite"})
POINT_FIELDS = frozenset({"metric", "step", "value"})
MAX_METRIC = 256
STEP_MAX = (1 << 63) - 1
ATTEMPT_MAX = (1 << 31) - 1

Step = int | None
SeriesPoint = tuple[Step, float]
Series = list[SeriesPoint]


@dataclass(frozen=True, order=True)
class RunCoordinate:
    """What shares a baseline: runs differing in any field never compare."""

    test_path: str
    backend: str
    suite: str

    def as_dict(self) -> dict[str, str]:
        return {"test_path": self.test_path, "backend": self.backend, "suite": self.suite}


@dataclass(frozen=True)
class MetricPoint:
    metric: str
    step: Step
    value: float

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "step": self.step, "value": encode_value(self.value)}


@dataclass(frozen=True)
class HistorySubmission:
    coordinate: RunCoordinate
    run_id: str
    attempt: int
    trusted: bool
    points: tuple[MetricPoint, ...]

    def series(self) -> dict[str, Series]:
        """This attempt's points grouped by metric, each in submission order."""
        out: dict[str, Series] = {}
        for point in self.points:
            out.setdefault(point.metric, []).append((point.step, point.value))
        return out

    def body(self) -> dict[str, Any]:
        """The normalized body, JSON-safe (the idempotency content)."""
        return {
            "coordinate": self.coordinate.as_dict(),
            "run_id": self.run_id,
            "attempt": self.attempt,
            "trusted": self.trusted,
            "points": [p.as_dict() for p in self.points],
        }


def encode_value(value: float) -> float | str:
    """A float as strict JSON allows it: non-finite values become their marker strings."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def decode_value(raw: Any, field_name: str = "value") -> float:
    """A number or a non-finite marker string as float; anything else is `InvalidRequest`.

    Booleans are not numbers here, although Python makes them ints.
    """
    if isinstance(raw, str) and raw in NON_FINITE:
        return NON_FINITE[raw]
    number = as_float(raw)
    if number is not None:
        return number
    if is_int(raw):
        raise InvalidRequest(f"{field_name} is out of the float64 range", field=field_name,
                             expected="a float64 number", actual="integer too large")
    raise InvalidRequest(
        f"{field_name} must be a number or one of \"NaN\", \"Infinity\", \"-Infinity\"",
        field=field_name,
        expected='number | "NaN" | "Infinity" | "-Infinity"',
        actual=describe(raw),
    )


def encode_series(series: Sequence[SeriesPoint]) -> list[list[Any]]:
    """`[[step, value], …]` with non-finite values as marker strings."""
    return [[step, encode_value(value)] for step, value in series]


def parse_metric_key(value: Any, field_name: str = "metric") -> str:
    """A metric key: exact text, never normalized."""
    return require_text(value, field_name, MAX_METRIC, min_len=1)


def parse_run_id(value: Any, field_name: str = "run_id") -> str:
    return require_text(value, field_name, MAX_METRIC, min_len=1)


def parse_step(value: Any, field_name: str) -> Step:
    # -1 is the coordinate step of `steps="last"`; training steps never go below 0.
    if value is None:
        return None
    if not is_int(value) or not 0 <= value <= STEP_MAX:
        raise InvalidRequest(f"{field_name} must be a non-negative integer or null",
                             field=field_name, expected=f"integer in [0, {STEP_MAX}] | null",
                             actual=describe(value))
    return int(value)


def parse_attempt(value: Any) -> int:
    if not is_int(value) or not 0 <= value <= ATTEMPT_MAX:
        raise InvalidRequest("attempt must be a non-negative integer", field="attempt",
                             expected=f"integer in [0, {ATTEMPT_MAX}]", actual=describe(value))
    return int(value)


def parse_coordinate(raw: Any, field_name: str = "coordinate") -> RunCoordinate:
    body = require_object(raw, field_name)
    reject_unknown(body, COORDINATE_FIELDS, field_name)
    return RunCoordinate(
        test_path=require_text(body.get("test_path"), f"{field_name}.test_path", min_len=1),
        backend=require_text(body.get("backend"), f"{field_name}.backend", min_len=1),
        suite=require_text(body.get("suite"), f"{field_name}.suite", min_len=1),
    )


def parse_point(raw: Any, field_name: str) -> MetricPoint:
    body = require_object(raw, field_name)
    reject_unknown(body, POINT_FIELDS, field_name)
    if "step" not in body:
        raise InvalidRequest(f"{field_name}.step is required (null for a step-less point)",
                             field=f"{field_name}.step", expected="integer | null", actual=None)
    if "value" not in body:
        raise InvalidRequest(f"{field_name}.value is required", field=f"{field_name}.value",
                             expected='number | "NaN" | "Infinity" | "-Infinity"', actual=None)
    return MetricPoint(
        metric=parse_metric_key(body.get("metric"), f"{field_name}.metric"),
        step=parse_step(body["step"], f"{field_name}.step"),
        value=decode_value(body["value"], f"{field_name}.value"),
    )


def _run_attempt(body: dict[str, Any]) -> dict[str, Any]:
    """`attempt`, `trusted`, `coordinate`, `run_id`: what a submission and a rollout
    record share. `trusted` defaults to false: a run becomes a baseline only when
    it says so."""
    return {
        "attempt": parse_attempt(body.get("attempt")),
        "trusted": require_bool(body.get("trusted", False), "trusted"),
        "coordinate": parse_coordinate(body.get("coordinate")),
        "run_id": parse_run_id(body.get("run_id")),
    }


def parse_submission(raw: Any) -> HistorySubmission:
    """Validate a whole `POST /v1/metric-history` body; every point, whitelisted or not."""
    body = require_object(raw, "body")
    reject_unknown(body, SUBMISSION_FIELDS, "")
    run = _run_attempt(body)
    points_raw = body.get("points")
    if not isinstance(points_raw, list):
        raise InvalidRequest("points must be a list", field="points",
                             expected="array of {metric, step, value}",
                             actual=describe(points_raw))
    return HistorySubmission(
        **run, points=tuple(parse_point(p, f"points[{i}]") for i, p in enumerate(points_raw)))


@dataclass(frozen=True)
class RolloutRecord:
    """`POST /v1/metric-history/rollout`: whose rollout metrics, recorded as which step."""

    coordinate: RunCoordinate
    run_id: str
    attempt: int
    trusted: bool
    step: Step
    labels: LabelFilters

    def submission(self, metrics: Mapping[str, Any],
                   keys: Iterable[str] = DEFAULT_METRIC_KEYS) -> HistorySubmission:
        """The rollout's whitelisted numeric `metrics` as this run's points at `step`."""
        return HistorySubmission(coordinate=self.coordinate, run_id=self.run_id,
                                 attempt=self.attempt, trusted=self.trusted,
                                 points=rollout_points(metrics, self.step, keys))


def parse_rollout_record(raw: Any) -> RolloutRecord:
    """The whole body, before anything is read: the sessions are the closed ones whose
    labels match `labels` (values compared as label text, so `{"rollout_id": 12}`
    matches 12)."""
    body = require_object(raw, "body")
    reject_unknown(body, ROLLOUT_FIELDS, "")
    labels = parse_label_filters(require_object(body.get("labels", {}), "labels"))
    if "step" not in body:
        raise InvalidRequest("step is required", field="step",
                             expected="integer >= 0", actual=describe(None))
    return RolloutRecord(**_run_attempt(body), step=parse_step(body["step"], "step"),
                         labels=labels)


def keep_whitelisted(
    points: Iterable[MetricPoint], keys: Iterable[str] = DEFAULT_METRIC_KEYS
) -> tuple[MetricPoint, ...]:
    """The points whose metric is exactly one of `keys`, in their order."""
    allowed = frozenset(keys)
    return tuple(p for p in points if p.metric in allowed)


def _step_order(point: SeriesPoint) -> tuple[bool, int]:
    step = point[0]
    return (step is None, 0 if step is None else step)


def merge_attempts(attempts: Iterable[Mapping[str, Sequence[SeriesPoint]]]) -> dict[str, Series]:
    """One series per metric: the attempts' series concatenated, then stably sorted by step.

    `attempts` are given in attempt order; points sharing a step keep that
    order (no dedupe — the gate reports duplicate steps). Step-less points
    go last. Keys are exact strings, returned sorted.
    """
    joined: dict[str, Series] = {}
    for attempt in attempts:
        for metric, series in attempt.items():
            joined.setdefault(metric, []).extend((step, float(value)) for step, value in series)
    return {metric: sorted(joined[metric], key=_step_order) for metric in sorted(joined)}


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def rollout_points(
    metrics: Mapping[str, Any], step: Step, keys: Iterable[str] = DEFAULT_METRIC_KEYS
) -> tuple[MetricPoint, ...]:
    """A rollout's metrics (e.g. `rollout_metrics(...)`) as points of one step.

    Only whitelisted keys with a numeric value are taken, in key order.
    """
    parse_step(step, "step")
    allowed = frozenset(keys)
    return tuple(MetricPoint(metric=key, step=step, value=float(value))
                 for key, value in sorted(metrics.items())
                 if key in allowed and _numeric(value))


def rollout_dropped(metrics: Mapping[str, Any],
                    keys: Iterable[str] = DEFAULT_METRIC_KEYS) -> list[str]:
    """The rollout's numeric metrics not whitelisted, sorted: the `dropped` of
    `POST /v1/metric-history/rollout`, as `POST /v1/metric-history` names the metrics
    it did not keep."""
    allowed = frozenset(keys)
    return sorted(key for key, value in metrics.items() if key not in allowed and _numeric(value))
