"""Regression gates: gate specs, step selection, corridors and the run verdict.

Owns the rules of `POST /v1/gates/evaluate` and `turnlog gate check`: a
spec `{metric, steps, constraint}` with `GATE_DEFAULTS` filling what it
omits; the canonical `steps_key` / `constraint_key`; picking the judged
value(s) from a merged series; the corridor around a baseline; the
per-coordinate status (PASS / FAIL / INACTIVE / ERROR), the run verdict and
its exit code; and the baseline rows a run contributes.

The keys are canonical JSON of the literals *as written* (or of the
`GATE_DEFAULTS` literal a spec relied on), never of the normalized form, so
`{"rel_up": 1}` and `{"rel_up": 1.0}` are different coordinates and a code
change to normalization can never silently re-key a history.

Refuses to own: reading or writing baselines (the caller supplies the trusted
values newest-first and stores the rows), parsing submissions
(`metric_history.py`). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from app.domain.errors import InvalidRequest
from app.domain.jsonio import canonical
from app.domain.metric_history import (
    MAX_METRIC,
    STEP_MAX,
    RunCoordinate,
    SeriesPoint,
    encode_value,
)
from app.domain.session import describe, is_int, is_text_safe, reject_unknown, require_object

BASELINE_WINDOW = 20
LAST_STEP = -1
SPEC_FIELDS = frozenset({"metric", "steps", "constraint"})
CONSTRAINT_PARAMS = ("rel_up", "abs_floor_up", "rel_down", "abs_floor_down")


@dataclass(frozen=True)
class GateDefault:
    steps: str
    constraint: Mapping[str, float]


def _default(steps: str, **constraint: float) -> GateDefault:
    return GateDefault(steps=steps, constraint=MappingProxyType(constraint))


_TRAIN_KL = _default("all", rel_up=0.5, abs_floor_up=0.02, rel_down=0.8, abs_floor_down=0.02)
_TITO_TEXT = _default("last", rel_up=1.0, abs_floor_up=0.1, rel_down=1.0)

# Editing a literal here re-keys every spec relying on it: its baselines cold-start.
GATE_DEFAULTS: Mapping[str, GateDefault] = MappingProxyType({
    "train/grad_norm": _default("all", rel_up=0.5, abs_floor_up=0.1, rel_down=0.8,
                                abs_floor_down=0.1),
    "train/ppo_kl": _TRAIN_KL,
    "train/train_rollout_logprob_abs_diff": _TRAIN_KL,
    "train/train_rollout_kl": _TRAIN_KL,
    "rollout/raw_reward": _default("all", rel_up=0.5, abs_floor_up=0.05, rel_down=0.2,
                                   abs_floor_down=0.05),
    "rollout/tito_session_mismatch_rate/v1/assistant_text": _TITO_TEXT,
    "rollout/tito_session_mismatch_rate/v2/assistant_text": _TITO_TEXT,
})


class GateStatus(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    INACTIVE = "INACTIVE"
    ERROR = "ERROR"


class SelectionError(ValueError):
    """The judged value(s) cannot be picked; `step` names the offending one if any."""

    def __init__(self, detail: str, step: int | None = None,
                 value: float | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.step = step
        self.value = value


@dataclass(frozen=True)
class Constraint:
    """Normalized corridor parameters: omitted ones are 0."""

    rel_up: float = 0.0
    abs_floor_up: float = 0.0
    rel_down: float = 0.0
    abs_floor_down: float = 0.0

    def corridor(self, ref: float) -> tuple[float, float]:
        """`(lo, hi)`; each band scales from the reference only, never from the value."""
        hi = ref + max(self.rel_up * abs(ref), self.abs_floor_up)
        lo = ref - max(self.rel_down * abs(ref), self.abs_floor_down)
        return lo, hi

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in CONSTRAINT_PARAMS}


@dataclass(frozen=True)
class GateSpec:
    metric: str
    steps: str | tuple[int, ...]
    constraint: Constraint
    steps_key: str
    constraint_key: str

    @property
    def steps_literal(self) -> str | list[int]:
        return self.steps if isinstance(self.steps, str) else list(self.steps)

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "steps": self.steps_literal, "steps_key": self.steps_key,
                "constraint": self.constraint.as_dict(), "constraint_key": self.constraint_key}


@dataclass(frozen=True, order=True)
class GateCoordinate:
    """The exact identity a baseline is kept under."""

    test_path: str
    backend: str
    suite: str
    metric: str
    steps_key: str
    constraint_key: str
    step: int


@dataclass(frozen=True)
class BaselineRow:
    """One value a run contributes to the history of one coordinate."""

    coordinate: GateCoordinate
    run_id: str
    value: float
    trusted: bool


def _json_number(value: float | None) -> float | str | None:
    # A corridor around a huge reference can overflow to ±inf; JSON gets the marker.
    return None if value is None else encode_value(value)


@dataclass(frozen=True)
class CoordinateResult:
    """One judged coordinate; `step` is null only for an ERROR not tied to a step."""

    spec: GateSpec
    step: int | None
    at_step: int | None
    status: GateStatus
    value: float | None
    baseline: float | None = None
    baseline_n: int = 0
    lo: float | None = None
    hi: float | None = None
    detail: str = ""

    @property
    def trusted(self) -> bool:
        return self.status in (GateStatus.PASS, GateStatus.INACTIVE)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.spec.as_dict(), "step": self.step, "at_step": self.at_step,
            "status": self.status.value, "value": _json_number(self.value),
            "baseline": _json_number(self.baseline), "baseline_n": self.baseline_n,
            "lo": _json_number(self.lo), "hi": _json_number(self.hi), "detail": self.detail,
        }


@dataclass(frozen=True)
class Verdict:
    coordinate: RunCoordinate
    results: tuple[CoordinateResult, ...]

    @property
    def trusted(self) -> bool:
        """Every coordinate PASS or INACTIVE; no specs is vacuously trusted."""
        return all(r.trusted for r in self.results)

    @property
    def exit_code(self) -> int:
        """`turnlog gate check`: 2 if any ERROR, else 1 if any FAIL, else 0."""
        statuses = {r.status for r in self.results}
        if GateStatus.ERROR in statuses:
            return 2
        return 1 if GateStatus.FAIL in statuses else 0

    @property
    def outcome(self) -> str:
        return ("trusted", "failed", "error")[self.exit_code]

    def as_dict(self) -> dict[str, Any]:
        return {"coordinate": self.coordinate.as_dict(), "trusted": self.trusted,
                "outcome": self.outcome, "results": [r.as_dict() for r in self.results]}


def _finite_number(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float64
        return False


def _param(value: Any, field_name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not _finite_number(value) or value < 0:
        raise InvalidRequest(f"{field_name} must be a finite number >= 0", field=field_name,
                             expected="finite number >= 0", actual=describe(value))
    return float(value)


def parse_constraint(raw: Any, field_name: str = "constraint") -> Constraint:
    """Unknown keys rejected; each side needs one of its params written; omitted are 0."""
    body = require_object(raw, field_name)
    reject_unknown(body, frozenset(CONSTRAINT_PARAMS), field_name)
    for side in ("up", "down"):
        names = (f"rel_{side}", f"abs_floor_{side}")
        if not any(name in body for name in names):
            raise InvalidRequest(f"{field_name} needs at least one {side} band parameter",
                                 field=field_name, expected=f"one of {list(names)}",
                                 actual=sorted(body))
    return Constraint(**{name: _param(body[name], f"{field_name}.{name}")
                         for name in CONSTRAINT_PARAMS if name in body})


def parse_steps(raw: Any, field_name: str = "steps") -> str | tuple[int, ...]:
    """`"last"`, `"all"`, or a non-empty list of distinct steps >= 0 (order kept)."""
    if raw in ("last", "all") and isinstance(raw, str):
        return raw
    expected = '"last" | "all" | non-empty array of distinct integers >= 0'
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest(f"{field_name} must be \"last\", \"all\" or a list of steps",
                             field=field_name, expected=expected, actual=describe(raw))
    seen: set[int] = set()
    for i, step in enumerate(raw):
        if not is_int(step) or not 0 <= step <= STEP_MAX or step in seen:
            raise InvalidRequest(f"{field_name}[{i}] must be a new integer step >= 0",
                                 field=f"{field_name}[{i}]", expected=expected,
                                 actual=describe(step))
        seen.add(step)
    return tuple(raw)


def parse_gate_spec(raw: Any, field_name: str = "spec") -> GateSpec:
    body = require_object(raw, field_name)
    reject_unknown(body, SPEC_FIELDS, field_name)
    metric_raw = body.get("metric")
    if (not isinstance(metric_raw, str) or not 1 <= len(metric_raw) <= MAX_METRIC
            or not is_text_safe(metric_raw)):
        raise InvalidRequest(f"{field_name}.metric must be a metric key",
                             field=f"{field_name}.metric",
                             expected=f"UTF-8 text of 1-{MAX_METRIC} characters without NUL",
                             actual=describe(metric_raw))
    metric = metric_raw
    default = GATE_DEFAULTS.get(metric)
    literals: dict[str, Any] = {}
    for name in ("steps", "constraint"):
        if body.get(name) is not None:
            literals[name] = body[name]
        elif default is not None:
            literals[name] = (default.steps if name == "steps" else dict(default.constraint))
        else:
            raise InvalidRequest(f"{field_name}.{name} is required: {metric!r} has no default",
                                 field=f"{field_name}.{name}",
                                 expected=f"{name}, or a metric among {sorted(GATE_DEFAULTS)}",
                                 actual=None)
    return GateSpec(
        metric=metric,
        steps=parse_steps(literals["steps"], f"{field_name}.steps"),
        constraint=parse_constraint(literals["constraint"], f"{field_name}.constraint"),
        steps_key=canonical(literals["steps"]),
        constraint_key=canonical(literals["constraint"]),
    )


def parse_gate_specs(raw: Any, field_name: str = "specs") -> tuple[GateSpec, ...]:
    """A list of specs; a repeat of an earlier (metric, steps_key, constraint_key) is dropped."""
    if not isinstance(raw, list):
        raise InvalidRequest(f"{field_name} must be a list of gate specs", field=field_name,
                             expected="array of {metric, steps?, constraint?}",
                             actual=describe(raw))
    specs: dict[tuple[str, str, str], GateSpec] = {}
    for i, item in enumerate(raw):
        spec = parse_gate_spec(item, f"{field_name}[{i}]")
        specs.setdefault((spec.metric, spec.steps_key, spec.constraint_key), spec)
    return tuple(specs.values())


def default_specs(metrics: Iterable[str] | None = None) -> tuple[GateSpec, ...]:
    """The defaulted spec of every `GATE_DEFAULTS` metric (or of the given ones)."""
    names = sorted(GATE_DEFAULTS) if metrics is None else list(metrics)
    return parse_gate_specs([{"metric": name} for name in names])


def _finite(step: int | None, value: float) -> float:
    if not math.isfinite(value):
        raise SelectionError(f"non-finite value {encode_value(value)} at step {step}",
                             step=step, value=value)
    return value


def select(series: Sequence[SeriesPoint],
           steps: str | Sequence[int]) -> list[tuple[int, int | None, float]]:
    """The judged values as `(coordinate_step, at_step, value)`; raises `SelectionError`.

    `"last"`: the series' last point, at coordinate step -1. `"all"`: every
    point, one coordinate per step, ascending (a step-less or repeated step
    is an error). A list: each listed step, in the listed order (a missing or
    repeated step is an error; step-less points are ignored). Every picked
    value must be finite.
    """
    if not series:
        raise SelectionError("empty series")
    if steps == "last":
        at_step, value = series[-1]
        return [(LAST_STEP, at_step, _finite(at_step, value))]
    by_step: dict[int, list[float]] = {}
    for step, value in series:
        if step is not None:
            by_step.setdefault(step, []).append(value)
        elif steps == "all":
            raise SelectionError("a point without a step cannot be judged per step")
    if isinstance(steps, str):
        if steps != "all":
            raise SelectionError(f"unknown steps {steps!r}")
        wanted = sorted(by_step)
    else:
        wanted = list(steps)
    picked: list[tuple[int, int | None, float]] = []
    for step in wanted:
        values = by_step.get(step, [])
        if not values:
            raise SelectionError(f"step {step} is missing", step=step)
        if len(values) > 1:
            raise SelectionError(f"step {step} appears {len(values)} times", step=step)
        picked.append((step, step, _finite(step, values[0])))
    return picked


def baseline_of(values: Sequence[float], window: int = BASELINE_WINDOW) -> tuple[float, int] | None:
    """Mean of the first `window` finite values (given newest-first) and how many; None if none."""
    recent = [v for v in values if math.isfinite(v)][:window]
    if not recent:
        return None
    return math.fsum(recent) / len(recent), len(recent)


BaselineSource = Callable[[GateCoordinate], Sequence[float]] | Mapping[GateCoordinate,
                                                                       Sequence[float]]


def _coordinate(run: RunCoordinate, spec: GateSpec, step: int) -> GateCoordinate:
    return GateCoordinate(run.test_path, run.backend, run.suite, spec.metric, spec.steps_key,
                          spec.constraint_key, step)


def _pick(spec: GateSpec, series: Mapping[str, Sequence[SeriesPoint]],
          ) -> list[tuple[int, int | None, float]]:
    if spec.metric not in series:
        raise SelectionError(f"metric {spec.metric!r} is missing from the run")
    return select(series[spec.metric], spec.steps)


def _judged(run: RunCoordinate, specs: Iterable[GateSpec],
            series: Mapping[str, Sequence[SeriesPoint]]) -> dict[GateCoordinate, float]:
    """Each coordinate whose value can be picked, once, with its value (first spec wins)."""
    judged: dict[GateCoordinate, float] = {}
    for spec in specs:
        try:
            picks = _pick(spec, series)
        except SelectionError:
            continue
        for step, _, value in picks:
            judged.setdefault(_coordinate(run, spec, step), value)
    return judged


def coordinates(run: RunCoordinate, specs: Iterable[GateSpec],
                series: Mapping[str, Sequence[SeriesPoint]]) -> list[GateCoordinate]:
    """Every coordinate the run can be judged at: what to fetch baselines for."""
    return list(_judged(run, specs, series))


def _history(baselines: BaselineSource, coordinate: GateCoordinate) -> Sequence[float]:
    if isinstance(baselines, Mapping):
        return baselines.get(coordinate, ())
    return baselines(coordinate)


def evaluate(
    run: RunCoordinate,
    specs: Iterable[GateSpec],
    series: Mapping[str, Sequence[SeriesPoint]],
    baselines: BaselineSource,
    window: int = BASELINE_WINDOW,
) -> Verdict:
    """Judge a run's merged series against trusted history.

    `baselines` gives, per coordinate, the trusted values of *earlier* runs
    newest-first (the current run not yet recorded); an unknown coordinate
    means no history. A spec whose selection fails yields one ERROR row
    (step = the offending step, or null).
    """
    results: list[CoordinateResult] = []
    for spec in specs:
        try:
            picks = _pick(spec, series)
        except SelectionError as err:
            results.append(CoordinateResult(spec, err.step, err.step, GateStatus.ERROR,
                                            err.value, detail=err.detail))
            continue
        for step, at_step, value in picks:
            found = baseline_of(_history(baselines, _coordinate(run, spec, step)), window)
            if found is None:
                results.append(CoordinateResult(spec, step, at_step, GateStatus.INACTIVE, value,
                                                detail="no trusted baseline (cold start)"))
                continue
            ref, n = found
            lo, hi = spec.constraint.corridor(ref)
            ok = lo <= value <= hi
            results.append(CoordinateResult(
                spec, step, at_step, GateStatus.PASS if ok else GateStatus.FAIL, value, ref, n,
                lo, hi, "within the corridor" if ok else
                f"{value!r} outside [{lo!r}, {hi!r}] around the mean {ref!r} of {n}"))
    return Verdict(coordinate=run, results=tuple(results))


def baseline_rows(
    run: RunCoordinate,
    run_id: str,
    specs: Iterable[GateSpec],
    series: Mapping[str, Sequence[SeriesPoint]],
    trusted: bool,
) -> list[BaselineRow]:
    """The rows a run contributes: one per coordinate whose value could be picked.

    Specs whose selection fails contribute nothing (a missing or non-finite
    value is never a baseline); a coordinate shared by several specs gets
    one row. `trusted` is the caller's decision (see `row_trust`).
    """
    return [BaselineRow(coordinate, run_id, value, trusted)
            for coordinate, value in _judged(run, specs, series).items()]


def row_trust(submitted: bool, verdict: Verdict) -> bool:
    """A run's rows count as baseline only if it was submitted trusted and passed its gates."""
    return submitted and verdict.trusted
