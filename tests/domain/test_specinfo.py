"""SpecInfo (docs/api.md §3): the guard, sums before rates, and the session carrier."""

from __future__ import annotations

import random

import numpy as np

from app.domain.body.specinfo import SpecInfo, sum_turns
from app.domain.projection.samples import session_carrier
from app.sim.simulator import SessionSimulator, SimConfig, fold_in_memory


def counters(correct: int, proposed: int, verify: int, completion: int) -> SpecInfo:
    return SpecInfo(spec_num_correct_drafts=correct, spec_num_proposed_drafts=proposed,
                    spec_verify_ct=verify, completion_tokens=completion)


def test_a_turn_with_verify_steps_adds_all_four_counters() -> None:
    info = sum_turns([counters(3, 5, 2, 7)])
    assert info.as_dict() == {"spec_num_correct_drafts": 3, "spec_num_proposed_drafts": 5,
                              "spec_verify_ct": 2, "completion_tokens": 7}


def test_a_turn_without_verify_steps_adds_nothing_at_all() -> None:
    info = sum_turns([counters(3, 5, 0, 7)])
    assert info == SpecInfo()
    assert not counters(3, 5, 0, 7).contributes


def test_rates_divide_the_sums_never_average_the_ratios() -> None:
    info = sum_turns([counters(1, 2, 1, 1), counters(9, 10, 1, 9)])
    assert info.accept_rate == 10 / 12
    assert info.accept_length == 10 / 2


def test_rates_are_zero_when_the_denominator_is_zero() -> None:
    assert SpecInfo().accept_rate == 0.0
    assert SpecInfo().accept_length == 0.0
    assert SpecInfo(spec_num_correct_drafts=4, completion_tokens=9).accept_rate == 0.0


def test_rates_are_float64_division_of_the_integer_sums() -> None:
    big = 2 ** 53 + 1
    info = SpecInfo(spec_num_correct_drafts=big, spec_num_proposed_drafts=3)
    assert info.accept_rate == float(np.float64(big) / np.float64(3))


def test_a_guarded_turn_does_not_dilute_the_accept_length() -> None:
    info = sum_turns([counters(2, 4, 2, 6), counters(0, 0, 0, 50)])
    assert info.accept_length == 3.0


def test_addition_sums_field_by_field() -> None:
    total = SpecInfo(1, 2, 3, 4) + SpecInfo(10, 20, 30, 40)
    assert total == SpecInfo(11, 22, 33, 44)
    assert sum([SpecInfo(1, 1, 1, 1)] * 3, SpecInfo()) == SpecInfo(3, 3, 3, 3)


def test_from_dict_reads_back_as_dict() -> None:
    info = SpecInfo(5, 6, 7, 8)
    assert SpecInfo.from_dict(info.as_dict()) == info


def _session(speculative: bool) -> SessionSimulator:
    config = SimConfig(session_id="carrier", speculative=speculative, num_layers=None)
    return SessionSimulator(config, random.Random(0))


def test_carrier_is_none_without_spec() -> None:
    sim = _session(speculative=False)
    state, _ = fold_in_memory(sim.open_body(), [sim.turn(None, spec_info={"spec_verify_ct": 1})])
    assert session_carrier(state) is None


def test_carrier_counts_every_node_once_retries_and_branches_included() -> None:
    sim = _session(speculative=True)
    counters = [
        {"spec_verify_ct": 1, "spec_num_correct_drafts": 4, "spec_num_proposed_drafts": 10},
        {"spec_verify_ct": 2, "spec_num_correct_drafts": 50, "spec_num_proposed_drafts": 60},
        {"spec_verify_ct": 1, "spec_num_correct_drafts": 5, "spec_num_proposed_drafts": 10},
        {"spec_verify_ct": 0, "spec_num_correct_drafts": 99, "spec_num_proposed_drafts": 99},
    ]
    bodies = [
        sim.turn(None, output_tokens=1, spec_info=counters[0]),
        sim.turn(0, output_tokens=2, spec_info=counters[1]),  # retried below: no sample keeps it
        sim.turn(0, output_tokens=1, spec_info=counters[2]),
        sim.turn(2, output_tokens=5, spec_info=counters[3]),  # guard: adds nothing
    ]
    state, _ = fold_in_memory(sim.open_body(), bodies)
    assert session_carrier(state) == {
        "session_id": "carrier",
        "metrics": {"spec_info": {"spec_num_correct_drafts": 59,
                                  "spec_num_proposed_drafts": 80,
                                  "spec_verify_ct": 4, "completion_tokens": 4}},
    }
