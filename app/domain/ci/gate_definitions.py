"""Gate definitions (the wire's "gate specs"): `{metric, steps, constraint}`
parsed, defaulted and keyed.

Owns the definition half of `POST /v1/gates/evaluate` and `turnlog gate
check`: the `GATE_DEFAULTS` table filling what a definition omits, parsing and validating
steps and constraints, the normalized `Constraint` (and the band it spans
around a reference), and the canonical `steps_key` / `constraint_key`.

The keys are canonical JSON of the literals *as written* (or of the
`GATE_DEFAULTS` literal a definition relied on), never of the normalized form, so
`{"rel_up": 1}` and `{"rel_up": 1.0}` are different coordinates and a code
change to normalization can never silently re-key a history.

Refuses to own judging: step selection, baselines, statuses, the verdict and
baseline rows are `gates.py`'s. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from app.domain.ci.metric_history import (
    STEP_MAX,
    RunCoordinate,
    parse_coordinate,
    parse_metric_key,
    parse_run_id,
)
from app.domain.errors import InvalidRequest
from app.domain.wire.jsonio import canonical
from app.domain.wire.validate import (
    describe,
    finite_float,
    is_int,
    reject_unknown,
    require_bool,
    require_object,
)

GATE_FIELDS = frozenset({"metric", "steps", "constraint"})
CONSTRAINT_PARAMS = ("rel_up", "abs_floor_up", "rel_down", "abs_floor_down")


@dataclass(frozen=True)
class GateDefault:
    steps: str
    constraint: Mapping[str, float]


def _default(steps: str, **constraint: float) -> GateDefault:
    return GateDefault(steps=steps, constraint=MappingProxyType(constraint))


_TRAIN_KL = _default("all", rel_up=0.5, abs_floor_up=0.02, rel_down=0.8, abs_floor_down=0.02)
_TITO_TEXT = _default("last", rel_up=1.0, abs_floor_up=0.1, rel_down=1.0)

# Editing a literal here re-keys every gate relying on it: its baselines cold-start.
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
class GateDefinition:
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


def _param(value: Any, field_name: str) -> float:
    number = finite_float(value)
    if number is None or number < 0:
        raise InvalidRequest(f"{field_name} must be a finite number >= 0", field=field_name,
                             expected="finite number >= 0", actual=describe(value))
    return number


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


def parse_gate_definition(raw: Any, field_name: str = "spec") -> GateDefinition:
    body = require_object(raw, field_name)
    reject_unknown(body, GATE_FIELDS, field_name)
    metric = parse_metric_key(body.get("metric"), f"{field_name}.metric")
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
    return GateDefinition(
        metric=metric,
        steps=parse_steps(literals["steps"], f"{field_name}.steps"),
        constraint=parse_constraint(literals["constraint"], f"{field_name}.constraint"),
        steps_key=canonical(literals["steps"]),
        constraint_key=canonical(literals["constraint"]),
    )


def parse_gate_definitions(raw: Any, field_name: str = "specs") -> tuple[GateDefinition, ...]:
    """A list of definitions; a repeat of an earlier (metric, steps_key, constraint_key) is
    dropped."""
    if not isinstance(raw, list):
        raise InvalidRequest(f"{field_name} must be a list of gate specs", field=field_name,
                             expected="array of {metric, steps?, constraint?}",
                             actual=describe(raw))
    gates: dict[tuple[str, str, str], GateDefinition] = {}
    for i, item in enumerate(raw):
        gate = parse_gate_definition(item, f"{field_name}[{i}]")
        gates.setdefault((gate.metric, gate.steps_key, gate.constraint_key), gate)
    return tuple(gates.values())


def default_gates(metrics: Iterable[str] | None = None) -> tuple[GateDefinition, ...]:
    """The defaulted definition of every `GATE_DEFAULTS` metric (or of the given ones)."""
    names = sorted(GATE_DEFAULTS) if metrics is None else list(metrics)
    return parse_gate_definitions([{"metric": name} for name in names])


EVALUATE_FIELDS = frozenset({"coordinate", "run_id", "specs", "record"})


@dataclass(frozen=True)
class GateCheck:
    """What `evaluate` was asked: the run, its gates and whether to record its rows."""

    coordinate: RunCoordinate
    run_id: str
    gates: tuple[GateDefinition, ...]
    record: bool = True


def parse_check(raw: Any) -> GateCheck:
    """The `POST /v1/gates/evaluate` body; `specs` omitted = every default gate."""
    body = require_object(raw, "body")
    reject_unknown(body, EVALUATE_FIELDS, "")
    run_id = parse_run_id(body.get("run_id"))
    record = require_bool(body.get("record", True), "record")
    specs = body.get("specs")
    return GateCheck(
        coordinate=parse_coordinate(body.get("coordinate")),
        run_id=run_id,
        gates=default_gates() if specs is None else parse_gate_definitions(specs),
        record=record,
    )
