"""Regression gates: step selection, corridors and the run verdict.

Owns the judging rules of `POST /v1/gates/evaluate` and `turnlog gate
check`: picking the judged value(s) of a parsed `GateDefinition` from a merged
series; the baseline and the corridor around it (`Constraint.corridor`); the
per-coordinate status (PASS / FAIL / INACTIVE / ERROR), the run verdict and
its exit code; and the baseline rows a run contributes.

Refuses to own: gate definitions, their defaults and keys (`gate_definitions.py`),
reading or writing baselines (the caller supplies the trusted values
newest-first and stores the rows), parsing submissions
(`metric_history.py`). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from app.domain.ci.gate_definitions import GateDefinition
from app.domain.ci.metric_history import RunCoordinate, SeriesPoint, encode_value
from app.domain.wire.validate import finite_mean

BASELINE_WINDOW = 20
LAST_STEP = -1


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

    gate: GateDefinition
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
            **self.gate.as_dict(), "step": self.step, "at_step": self.at_step,
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
        """Every coordinate PASS or INACTIVE; no gates is vacuously trusted."""
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
    return finite_mean(recent), len(recent)


BaselineSource = Callable[[GateCoordinate], Sequence[float]] | Mapping[GateCoordinate,
                                                                       Sequence[float]]


def _coordinate(run: RunCoordinate, gate: GateDefinition, step: int) -> GateCoordinate:
    return GateCoordinate(run.test_path, run.backend, run.suite, gate.metric, gate.steps_key,
                          gate.constraint_key, step)


def _pick(gate: GateDefinition, series: Mapping[str, Sequence[SeriesPoint]],
          ) -> list[tuple[int, int | None, float]]:
    if gate.metric not in series:
        raise SelectionError(f"metric {gate.metric!r} is missing from the run")
    return select(series[gate.metric], gate.steps)


def _judged(run: RunCoordinate, gates: Iterable[GateDefinition],
            series: Mapping[str, Sequence[SeriesPoint]]) -> dict[GateCoordinate, float]:
    """Each coordinate whose value can be picked, once, with its value (first gate wins)."""
    judged: dict[GateCoordinate, float] = {}
    for gate in gates:
        try:
            picks = _pick(gate, series)
        except SelectionError:
            continue
        for step, _, value in picks:
            judged.setdefault(_coordinate(run, gate, step), value)
    return judged


def coordinates(run: RunCoordinate, gates: Iterable[GateDefinition],
                series: Mapping[str, Sequence[SeriesPoint]]) -> list[GateCoordinate]:
    """Every coordinate the run can be judged at: what to fetch baselines for."""
    return list(_judged(run, gates, series))


def _history(baselines: BaselineSource, coordinate: GateCoordinate) -> Sequence[float]:
    if isinstance(baselines, Mapping):
        return baselines.get(coordinate, ())
    return baselines(coordinate)


def evaluate(
    run: RunCoordinate,
    gates: Iterable[GateDefinition],
    series: Mapping[str, Sequence[SeriesPoint]],
    baselines: BaselineSource,
    window: int = BASELINE_WINDOW,
) -> Verdict:
    """Judge a run's merged series against trusted history.

    `baselines` gives, per coordinate, the trusted values of *earlier* runs
    newest-first (the current run not yet recorded); an unknown coordinate
    means no history. A gate whose selection fails yields one ERROR row
    (step = the offending step, or null).
    """
    results: list[CoordinateResult] = []
    for gate in gates:
        try:
            picks = _pick(gate, series)
        except SelectionError as err:
            results.append(CoordinateResult(gate, err.step, err.step, GateStatus.ERROR,
                                            err.value, detail=err.detail))
            continue
        for step, at_step, value in picks:
            found = baseline_of(_history(baselines, _coordinate(run, gate, step)), window)
            if found is None:
                results.append(CoordinateResult(gate, step, at_step, GateStatus.INACTIVE, value,
                                                detail="no trusted baseline (cold start)"))
                continue
            ref, n = found
            lo, hi = gate.constraint.corridor(ref)
            ok = lo <= value <= hi
            results.append(CoordinateResult(
                gate, step, at_step, GateStatus.PASS if ok else GateStatus.FAIL, value, ref, n,
                lo, hi, "within the corridor" if ok else
                f"{value!r} outside [{lo!r}, {hi!r}] around the mean {ref!r} of {n}"))
    return Verdict(coordinate=run, results=tuple(results))


def baseline_rows(
    run: RunCoordinate,
    run_id: str,
    gates: Iterable[GateDefinition],
    series: Mapping[str, Sequence[SeriesPoint]],
    trusted: bool,
) -> list[BaselineRow]:
    """The rows a run contributes: one per coordinate whose value could be picked.

    Gates whose selection fails contribute nothing (a missing or non-finite
    value is never a baseline); a coordinate shared by several gates gets
    one row. `trusted` is the caller's decision (see `row_trust`).
    """
    return [BaselineRow(coordinate, run_id, value, trusted)
            for coordinate, value in _judged(run, gates, series).items()]


def row_trust(submitted: bool, verdict: Verdict) -> bool:
    """A run's rows count as baseline only if it was submitted trusted and passed its gates."""
    return submitted and verdict.trusted
