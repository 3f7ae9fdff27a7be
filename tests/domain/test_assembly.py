"""R3 planning and assembly for one sample (docs/api.md §2.4 step 6)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from app.domain.errors import R3Gap
from app.domain.projection.assembly import (
    PlanSlice,
    R3Plan,
    TurnSpan,
    assemble,
    plan_r3,
    plan_shape,
    take,
)
from app.domain.wire.r3 import Patch, narrow
from app.sim.simulator import SessionSimulator, SimConfig, fold_in_memory, route

L, K = 2, 2


def span(seq: int, start: int, end: int) -> TurnSpan:
    return TurnSpan(seq, (start, end))


def no_r3(seq: int) -> TurnSpan:
    return TurnSpan(seq, None)


def full(kept: list[TurnSpan], rows: int) -> R3Plan | None:
    return plan_r3(kept, rows, addition=False, num_layers=L, topk=K)


def addition(kept: list[TurnSpan], rows: int) -> R3Plan | None:
    return plan_r3(kept, rows, addition=True, num_layers=L, topk=K)


def gap(excinfo: pytest.ExceptionInfo[R3Gap]) -> dict[str, object]:
    assert excinfo.value.http_status == 422
    return excinfo.value.problem()


def test_addition_mode_is_a_gap_when_only_a_left_out_turn_of_the_path_carries_r3() -> None:
    # Kept: turn 0 (no R3); the path goes on to turn 1, whose patch the sample
    # does not keep. Null would hide that the sample owes rows [0, 5).
    with pytest.raises(R3Gap) as excinfo:
        plan_r3([no_r3(0)], 5, addition=True, num_layers=L, topk=K,
                path=[no_r3(0), span(1, 5, 7)])
    assert gap(excinfo)["field"] == "path[0]"
    assert plan_r3([no_r3(0)], 5, addition=True, num_layers=L, topk=K,
                   path=[no_r3(0), no_r3(1)]) is None


# -- full (retract) mode ------------------------------------------------------------


def test_full_mode_reads_only_the_last_kept_turns_payload() -> None:
    plan = full([span(0, 0, 5), span(3, 0, 11)], rows=11)
    assert plan is not None and plan.slices == (PlanSlice(3, 0, 11),)


def test_full_mode_cuts_the_last_payload_to_the_sample_rows() -> None:
    plan = full([span(0, 0, 5), span(3, 0, 11)], rows=7)
    assert plan is not None and plan.slices == (PlanSlice(3, 0, 7),)
    assert plan_shape(plan) == (7, L, K)


def test_full_mode_has_no_r3_when_the_last_kept_turn_carries_none() -> None:
    assert full([span(0, 0, 5), no_r3(1)], rows=9) is None


def test_full_mode_too_few_rows_is_a_422_gap_naming_the_turn() -> None:
    with pytest.raises(R3Gap) as excinfo:
        full([span(4, 0, 5)], rows=8)
    problem = gap(excinfo)
    assert problem["field"] == "path[0]"
    assert problem["seq"] == 4
    assert problem["rows"] == [5, 8]


def test_full_mode_zero_rows_is_an_empty_plan() -> None:
    plan = full([span(0, 0, 0)], rows=0)
    assert plan is not None and plan.slices == () and plan_shape(plan) == (0, L, K)


# -- addition (in_place) mode -------------------------------------------------------


def test_addition_concatenates_contiguous_patches_in_path_order() -> None:
    plan = addition([span(0, 0, 8), span(2, 8, 14), span(5, 14, 20)], rows=20)
    assert plan is not None
    assert plan.slices == (PlanSlice(0, 0, 8), PlanSlice(2, 0, 6), PlanSlice(5, 0, 6))


def test_addition_stops_once_rows_are_covered_and_cuts_to_rows() -> None:
    plan = addition([span(0, 0, 8), span(2, 8, 14), no_r3(5)], rows=10)
    assert plan is not None
    assert plan.slices == (PlanSlice(0, 0, 8), PlanSlice(2, 0, 2))
    assert plan.rows == 10


def test_addition_has_no_r3_when_no_kept_turn_carries_any() -> None:
    assert addition([no_r3(0), no_r3(1)], rows=6) is None


def test_addition_kept_turn_without_r3_before_coverage_is_a_gap() -> None:
    with pytest.raises(R3Gap) as excinfo:
        addition([span(0, 0, 8), no_r3(2), span(5, 14, 20)], rows=20)
    problem = gap(excinfo)
    assert problem["field"] == "path[1]"
    assert problem["seq"] == 2
    assert problem["rows"] == [8, 20]


def test_addition_refuses_a_gap_between_patches() -> None:
    with pytest.raises(R3Gap) as excinfo:
        addition([span(0, 0, 8), span(2, 9, 14)], rows=14)
    problem = gap(excinfo)
    assert (problem["expected"], problem["actual"]) == (8, 9)


def test_addition_refuses_overlapping_patches() -> None:
    with pytest.raises(R3Gap) as excinfo:
        addition([span(0, 0, 8), span(2, 7, 14)], rows=14)
    problem = gap(excinfo)
    assert (problem["expected"], problem["actual"]) == (8, 7)


def test_addition_too_few_rows_in_total_is_a_gap() -> None:
    with pytest.raises(R3Gap) as excinfo:
        addition([span(0, 0, 8), span(2, 8, 12)], rows=14)
    problem = gap(excinfo)
    assert (problem["expected"], problem["actual"]) == (14, 12)


def test_addition_skips_empty_patches() -> None:
    plan = addition([span(0, 0, 4), span(1, 4, 4), span(2, 4, 9)], rows=9)
    assert plan is not None
    assert plan.slices == (PlanSlice(0, 0, 4), PlanSlice(2, 0, 5))


def test_addition_zero_rows_is_an_empty_plan_whatever_follows() -> None:
    plan = addition([span(0, 0, 0), no_r3(1)], rows=0)
    assert plan is not None and plan.slices == ()


# -- applying a plan ------------------------------------------------------------------


def patch(start: int, values: np.ndarray) -> Patch:
    dtype, data = narrow(values.reshape(-1))
    return Patch(start=start, end=start + values.shape[0], num_layers=values.shape[1],
                 topk=values.shape[2], dtype=dtype, data=data)


def test_assemble_concatenates_the_planned_rows() -> None:
    oracle = route(np.arange(21), L, K, 16)
    patches = {0: patch(0, oracle[:8]), 2: patch(8, oracle[8:14]), 5: patch(14, oracle[14:20])}
    plan = addition([span(0, 0, 8), span(2, 8, 14), span(5, 14, 20)], rows=17)
    assert plan is not None
    out = assemble(plan, patches)
    assert out.dtype == np.dtype("<i4") and out.flags.c_contiguous
    assert out.tobytes() == oracle[:17].tobytes()


def test_assemble_of_an_empty_plan_has_the_plan_shape() -> None:
    out = assemble(R3Plan(num_layers=L, topk=K, slices=()), {})
    assert out.shape == (0, L, K) and out.dtype == np.dtype("<i4")


def test_a_missing_patch_is_a_422_gap() -> None:
    plan = R3Plan(num_layers=L, topk=K, slices=(PlanSlice(3, 0, 2),))
    with pytest.raises(R3Gap) as excinfo:
        assemble(plan, {})
    assert gap(excinfo)["seq"] == 3


def test_take_refuses_a_slice_past_the_patch() -> None:
    plan = R3Plan(num_layers=L, topk=K, slices=(PlanSlice(0, 0, 5),))
    with pytest.raises(R3Gap):
        take(plan.slices[0], patch(0, np.zeros((3, L, K), np.int32)), plan)


def test_take_refuses_a_patch_of_another_geometry() -> None:
    plan = R3Plan(num_layers=L, topk=K, slices=(PlanSlice(0, 0, 1),))
    with pytest.raises(R3Gap):
        take(plan.slices[0], patch(0, np.zeros((3, L, K + 1), np.int32)), plan)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_stored_patches_of_a_linear_session_replay_a_full_forward(mode: str) -> None:
    config = SimConfig(pause_generation_mode=mode, num_layers=L, topk=K, num_experts=16)
    sim = SessionSimulator(config, random.Random(7))
    bodies = [sim.turn(None, new_tokens=5)]
    for seq in range(3):
        bodies.append(sim.turn(seq, new_tokens=2))
    state, patches = fold_in_memory(sim.open_body(), bodies)
    tokens = state.nodes[-1].tokens
    for rows in (0, 5, tokens.size - 1):
        plan = plan_r3(state.path(3), rows, addition=mode == "in_place", num_layers=L,
                       topk=K)
        assert plan is not None
        expected = route(tokens[:rows + 1], L, K, 16)
        assert assemble(plan, patches).tobytes() == expected.tobytes()
