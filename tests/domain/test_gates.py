"""Specification of gate specs, step selection, corridors, verdicts and baseline rows."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.domain.ci.gate_definitions import (
    GATE_DEFAULTS,
    Constraint,
    GateDefinition,
    default_gates,
    parse_constraint,
    parse_gate_definition,
    parse_gate_definitions,
)
from app.domain.ci.gates import (
    BaselineRow,
    GateCoordinate,
    GateStatus,
    SelectionError,
    baseline_of,
    baseline_rows,
    coordinates,
    evaluate,
    row_trust,
    select,
)
from app.domain.ci.metric_history import RunCoordinate
from app.domain.errors import InvalidRequest
from app.domain.wire.jsonio import dumps

RUN = RunCoordinate("tests/e2e/test_grpo.py", "cuda", "stage-c")
V1_TEXT = "rollout/tito_session_mismatch_rate/v1/assistant_text"
V2_TEXT = "rollout/tito_session_mismatch_rate/v2/assistant_text"
TIGHT = {"rel_up": 0.1, "rel_down": 0.1}


def gate(metric: str = "train/ppo_kl", steps: Any = "all",
         constraint: Any = None) -> GateDefinition:
    return parse_gate_definition({"metric": metric, "steps": steps,
                            "constraint": TIGHT if constraint is None else constraint})


def coord(s: GateDefinition, step: int, run: RunCoordinate = RUN) -> GateCoordinate:
    return GateCoordinate(run.test_path, run.backend, run.suite, s.metric, s.steps_key,
                          s.constraint_key, step)


def rejected_field(raw: Any) -> str | None:
    with pytest.raises(InvalidRequest) as info:
        parse_gate_definitions(raw)
    return info.value.field


# --- specs and defaults --------------------------------------------------------------


def test_gate_defaults_are_the_table_of_the_issue() -> None:
    kl = {"rel_up": 0.5, "abs_floor_up": 0.02, "rel_down": 0.8, "abs_floor_down": 0.02}
    tito = {"rel_up": 1.0, "abs_floor_up": 0.1, "rel_down": 1.0}
    expected = {
        "train/grad_norm": ("all", {"rel_up": 0.5, "abs_floor_up": 0.1, "rel_down": 0.8,
                                    "abs_floor_down": 0.1}),
        "train/ppo_kl": ("all", kl),
        "train/train_rollout_logprob_abs_diff": ("all", kl),
        "train/train_rollout_kl": ("all", kl),
        "rollout/raw_reward": ("all", {"rel_up": 0.5, "abs_floor_up": 0.05, "rel_down": 0.2,
                                       "abs_floor_down": 0.05}),
        V1_TEXT: ("last", tito),
        V2_TEXT: ("last", tito),
    }
    assert {k: (d.steps, dict(d.constraint)) for k, d in GATE_DEFAULTS.items()} == expected


def test_an_omitted_steps_and_constraint_come_from_the_defaults() -> None:
    s = parse_gate_definition({"metric": V1_TEXT})
    assert s.steps == "last"
    assert s.constraint == Constraint(rel_up=1.0, abs_floor_up=0.1, rel_down=1.0)
    assert s.steps_key == '"last"'
    assert s.constraint_key == '{"abs_floor_up":0.1,"rel_down":1.0,"rel_up":1.0}'


def test_a_written_literal_wins_over_the_default() -> None:
    s = parse_gate_definition({"metric": "train/grad_norm", "steps": [3, 1]})
    assert s.steps == (3, 1)
    assert s.constraint == Constraint(0.5, 0.1, 0.8, 0.1)


def test_keys_are_canonical_json_of_the_literal_as_written() -> None:
    s = parse_gate_definition({"metric": "m", "steps": [5, 0],
                         "constraint": {"rel_down": 1, "abs_floor_up": 0.5}})
    assert s.steps_key == "[5,0]"
    assert s.constraint_key == '{"abs_floor_up":0.5,"rel_down":1}'


def test_an_integer_and_a_float_literal_are_different_coordinates() -> None:
    a = parse_gate_definition({"metric": "m", "steps": "all", "constraint": {"rel_up": 1,
                                                                        "rel_down": 1}})
    b = parse_gate_definition({"metric": "m", "steps": "all", "constraint": {"rel_up": 1.0,
                                                                        "rel_down": 1.0}})
    assert a.constraint == b.constraint
    assert a.constraint_key != b.constraint_key


def test_a_metric_without_defaults_must_write_steps_and_constraint() -> None:
    assert rejected_field([{"metric": "perf/x", "constraint": TIGHT}]) == "specs[0].steps"
    assert rejected_field([{"metric": "perf/x", "steps": "all"}]) == "specs[0].constraint"


def test_unknown_spec_fields_are_rejected() -> None:
    assert rejected_field([{"metric": "train/ppo_kl", "enforce": True}]) == "specs[0].enforce"


@pytest.mark.parametrize(("steps", "field"), [
    ("first", "specs[0].steps"), ([], "specs[0].steps"), ([1, 1], "specs[0].steps[1]"),
    ([-1], "specs[0].steps[0]"), ([True], "specs[0].steps[0]"), (3, "specs[0].steps"),
])
def test_steps_are_last_all_or_a_list_of_distinct_non_negative_steps(steps: Any,
                                                                      field: str) -> None:
    assert rejected_field([{"metric": "train/ppo_kl", "steps": steps}]) == field


def test_omitted_constraint_parameters_are_zero() -> None:
    assert parse_constraint({"abs_floor_up": 0.3, "rel_down": 0.2}) == Constraint(
        rel_up=0.0, abs_floor_up=0.3, rel_down=0.2, abs_floor_down=0.0)


@pytest.mark.parametrize("raw", [{"rel_down": 0.1}, {"abs_floor_down": 0.1}])
def test_a_constraint_needs_an_upper_parameter(raw: dict[str, float]) -> None:
    with pytest.raises(InvalidRequest, match="up band"):
        parse_constraint(raw)


@pytest.mark.parametrize("raw", [{"rel_up": 0.1}, {"abs_floor_up": 0.1}])
def test_a_constraint_needs_a_lower_parameter(raw: dict[str, float]) -> None:
    with pytest.raises(InvalidRequest, match="down band"):
        parse_constraint(raw)


def test_an_explicit_zero_counts_as_a_written_parameter() -> None:
    assert parse_constraint({"rel_up": 0, "rel_down": 0}) == Constraint()


def test_unknown_constraint_keys_are_rejected() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_constraint({"rel_up": 0.1, "rel_down": 0.1, "direction": "two_sided"})
    assert info.value.field == "constraint.direction"


@pytest.mark.parametrize("value", [-0.1, True, "0.1", None, math.inf, math.nan])
def test_constraint_parameters_are_finite_non_negative_numbers(value: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_constraint({"rel_up": value, "rel_down": 0.1})
    assert info.value.field == "constraint.rel_up"


def test_a_repeated_spec_is_kept_once() -> None:
    specs = parse_gate_definitions([{"metric": "train/ppo_kl"}, {"metric": "train/ppo_kl"},
                              {"metric": "train/ppo_kl", "steps": "last"}])
    assert [s.steps for s in specs] == ["all", "last"]


def test_default_gates_cover_every_default_metric() -> None:
    assert sorted(s.metric for s in default_gates()) == sorted(GATE_DEFAULTS)


# --- selection -----------------------------------------------------------------------


def test_last_picks_the_final_point_at_coordinate_step_minus_one() -> None:
    assert select([(0, 1.0), (7, 2.0)], "last") == [(-1, 7, 2.0)]


def test_all_picks_one_coordinate_per_step() -> None:
    assert select([(0, 1.0), (1, 2.0)], "all") == [(0, 0, 1.0), (1, 1, 2.0)]


def test_all_rejects_a_repeated_step() -> None:
    with pytest.raises(SelectionError, match="appears 2 times"):
        select([(0, 1.0), (0, 2.0)], "all")


def test_all_rejects_a_step_less_point() -> None:
    with pytest.raises(SelectionError, match="without a step"):
        select([(0, 1.0), (None, 2.0)], "all")


def test_a_step_list_picks_the_listed_steps_in_listed_order() -> None:
    assert select([(0, 1.0), (1, 2.0), (2, 3.0)], (2, 0)) == [(2, 2, 3.0), (0, 0, 1.0)]


def test_a_step_list_rejects_a_missing_step() -> None:
    with pytest.raises(SelectionError, match="step 4 is missing") as info:
        select([(0, 1.0)], (0, 4))
    assert info.value.step == 4


@pytest.mark.parametrize("steps", ["last", "all", (0,)])
def test_a_non_finite_picked_value_is_an_error(steps: Any) -> None:
    with pytest.raises(SelectionError, match="non-finite"):
        select([(0, math.nan)], steps)


def test_an_empty_series_is_an_error() -> None:
    with pytest.raises(SelectionError, match="empty"):
        select([], "last")


# --- corridor and baseline -----------------------------------------------------------


def test_the_corridor_is_the_larger_of_relative_and_floor_band_per_side() -> None:
    c = Constraint(rel_up=0.5, abs_floor_up=0.1, rel_down=0.8, abs_floor_down=0.1)
    assert c.corridor(2.0) == (pytest.approx(0.4), pytest.approx(3.0))
    assert c.corridor(0.0) == (pytest.approx(-0.1), pytest.approx(0.1))


def test_the_corridor_scales_with_the_magnitude_of_a_negative_reference() -> None:
    assert Constraint(rel_up=0.5, rel_down=0.5).corridor(-2.0) == (-3.0, -1.0)


small = st.integers(-1000, 1000)
eighths = st.integers(0, 16).map(lambda n: n / 8)


@given(small, small, eighths, eighths)
def test_a_symmetric_corridor_treats_equal_deviations_alike(ref: int, dev: int, rel: float,
                                                            floor: float) -> None:
    c = Constraint(rel_up=rel, abs_floor_up=floor, rel_down=rel, abs_floor_down=floor)
    lo, hi = c.corridor(float(ref))
    above = lo <= ref + abs(dev) <= hi
    below = lo <= ref - abs(dev) <= hi
    assert above == below
    assert above == (abs(dev) <= max(rel * abs(ref), floor))


@given(st.floats(-1e300, 1e300), eighths, eighths, eighths, eighths)
def test_the_reference_itself_always_passes(ref: float, a: float, b: float, c: float,
                                            d: float) -> None:
    lo, hi = Constraint(a, b, c, d).corridor(ref)
    assert lo <= ref <= hi


def test_the_baseline_is_the_mean_of_the_twenty_newest_values() -> None:
    assert baseline_of([1.0] * 20 + [100.0] * 5) == (1.0, 20)
    assert baseline_of([1.0, 3.0]) == (2.0, 2)


def test_a_baseline_of_values_near_the_float64_limit_is_their_mean() -> None:
    """Their sum is past float64 (fsum raised OverflowError: a 500 on evaluate)."""
    top = 1.7976931348623157e308
    mean, n = baseline_of([top, top, top])  # type: ignore[misc]
    assert n == 3 and mean == pytest.approx(top, rel=1e-15) and math.isfinite(mean)
    assert baseline_of([top, -top, top]) == (top / 3, 3)


def test_no_values_means_no_baseline() -> None:
    assert baseline_of([]) is None


@given(st.lists(st.floats(-1e6, 1e6), min_size=20, max_size=20),
       st.lists(st.floats(-1e6, 1e6), max_size=10))
def test_values_older_than_the_window_never_move_the_baseline(newest: list[float],
                                                              older: list[float]) -> None:
    assert baseline_of(newest + older) == baseline_of(newest)


# --- evaluation ----------------------------------------------------------------------


def test_a_coordinate_without_history_is_inactive_and_trusted() -> None:
    verdict = evaluate(RUN, [gate()], {"train/ppo_kl": [(0, 0.1)]}, {})
    assert [r.status for r in verdict.results] == [GateStatus.INACTIVE]
    assert verdict.trusted and verdict.exit_code == 0


def test_a_value_inside_the_corridor_passes() -> None:
    s = gate()
    verdict = evaluate(RUN, [s], {"train/ppo_kl": [(0, 1.05)]}, {coord(s, 0): [1.0]})
    (result,) = verdict.results
    assert (result.status, result.baseline, result.baseline_n) == (GateStatus.PASS, 1.0, 1)
    assert (result.lo, result.hi) == (pytest.approx(0.9), pytest.approx(1.1))
    assert verdict.trusted and verdict.exit_code == 0


def test_a_value_outside_the_corridor_fails_the_run() -> None:
    s = gate()
    verdict = evaluate(RUN, [s], {"train/ppo_kl": [(0, 1.05), (1, 5.0)]},
                       {coord(s, 0): [1.0], coord(s, 1): [1.0]})
    assert [r.status for r in verdict.results] == [GateStatus.PASS, GateStatus.FAIL]
    assert not verdict.trusted and verdict.exit_code == 1 and verdict.outcome == "failed"


def test_a_missing_metric_is_an_error() -> None:
    verdict = evaluate(RUN, [gate()], {}, {})
    (result,) = verdict.results
    assert result.status == GateStatus.ERROR and result.step is None
    assert "missing" in result.detail
    assert not verdict.trusted and verdict.exit_code == 2


def test_a_selection_error_is_an_error_naming_the_step() -> None:
    verdict = evaluate(RUN, [gate(steps=[0, 3])], {"train/ppo_kl": [(0, 1.0)]}, {})
    (result,) = verdict.results
    assert (result.status, result.step) == (GateStatus.ERROR, 3)


def test_an_error_outranks_a_failure_in_the_exit_code() -> None:
    s = gate()
    verdict = evaluate(RUN, [s, gate("train/grad_norm")], {"train/ppo_kl": [(0, 9.0)]},
                       {coord(s, 0): [1.0]})
    assert {r.status for r in verdict.results} == {GateStatus.FAIL, GateStatus.ERROR}
    assert verdict.exit_code == 2 and verdict.outcome == "error"


def test_no_specs_is_vacuously_trusted() -> None:
    verdict = evaluate(RUN, [], {"train/ppo_kl": [(0, 1.0)]}, {})
    assert verdict.results == () and verdict.trusted and verdict.exit_code == 0


def test_history_is_looked_up_at_exactly_the_same_coordinate() -> None:
    s = gate()
    other_suite = RunCoordinate(RUN.test_path, RUN.backend, "stage-b")
    other_rule = gate(constraint={"rel_up": 0.2, "rel_down": 0.1})
    history = {coord(s, 0, other_suite): [1.0], coord(other_rule, 0): [1.0],
               coord(s, 1): [1.0]}
    verdict = evaluate(RUN, [s], {"train/ppo_kl": [(0, 9.0)]}, history)
    assert [r.status for r in verdict.results] == [GateStatus.INACTIVE]


def test_last_is_judged_at_step_minus_one_whatever_step_it_landed_on() -> None:
    s = gate(V2_TEXT, steps="last")
    verdict = evaluate(RUN, [s], {V2_TEXT: [(0, 0.5), (9, 0.2)]}, {coord(s, -1): [0.2]})
    (result,) = verdict.results
    assert (result.step, result.at_step, result.status) == (-1, 9, GateStatus.PASS)


def test_baselines_may_be_a_callable_given_each_coordinate() -> None:
    s = gate()
    asked: list[GateCoordinate] = []

    def history(c: GateCoordinate) -> list[float]:
        asked.append(c)
        return [1.0]

    evaluate(RUN, [s], {"train/ppo_kl": [(0, 1.0), (1, 1.0)]}, history)
    assert asked == [coord(s, 0), coord(s, 1)]


def test_the_verdict_lists_every_coordinate_as_strict_json() -> None:
    s = gate()
    verdict = evaluate(RUN, [s, gate(V1_TEXT, steps=[0])],
                       {"train/ppo_kl": [(0, 1.0)], V1_TEXT: [(0, math.nan)]},
                       {coord(s, 0): [1.0]})
    body = verdict.as_dict()
    dumps(body)
    assert body["trusted"] is False
    first, second = body["results"]
    assert {k: first[k] for k in ("metric", "step", "status", "value", "baseline")} == {
        "metric": "train/ppo_kl", "step": 0, "status": "PASS", "value": 1.0, "baseline": 1.0}
    assert (first["lo"], first["hi"]) == (pytest.approx(0.9), pytest.approx(1.1))
    assert (second["status"], second["value"]) == ("ERROR", "NaN")


# --- baseline rows -------------------------------------------------------------------


def test_a_run_contributes_one_row_per_pickable_coordinate() -> None:
    s, broken = gate(), gate("train/grad_norm")
    rows = baseline_rows(RUN, "run-7", [s, broken, s], {"train/ppo_kl": [(0, 1.0), (1, 2.0)]},
                         trusted=True)
    assert rows == [BaselineRow(coord(s, 0), "run-7", 1.0, True),
                    BaselineRow(coord(s, 1), "run-7", 2.0, True)]


def test_a_non_finite_value_never_becomes_a_baseline_row() -> None:
    rows = baseline_rows(RUN, "r", [gate(steps="last")], {"train/ppo_kl": [(0, math.inf)]},
                         trusted=True)
    assert rows == []


def test_the_coordinates_to_fetch_are_those_of_the_rows() -> None:
    s = gate()
    series = {"train/ppo_kl": [(0, 1.0), (1, 2.0)]}
    assert coordinates(RUN, [s], series) == [r.coordinate for r in
                                             baseline_rows(RUN, "r", [s], series, False)]


def test_rows_count_as_baseline_only_for_a_trusted_run_that_passed() -> None:
    s = gate()
    passed = evaluate(RUN, [s], {"train/ppo_kl": [(0, 1.0)]}, {})
    failed = evaluate(RUN, [s], {"train/ppo_kl": [(0, 9.0)]}, {coord(s, 0): [1.0]})
    assert row_trust(True, passed) and not row_trust(False, passed)
    assert not row_trust(True, failed)
