"""The samples projection (docs/api.md §2) on small hand-built sessions.

User/template token ids are below 1000 and model output ids from 1000 on, so
each expected array can be read off the token lists.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from app.domain.body.session import SessionClose
from app.domain.errors import Alignment, R3Gap, UnknownSample
from app.domain.log.tree import SessionState
from app.domain.projection.samples import SamplesResult, build_samples
from app.domain.projection.samples_merge import align
from app.sim.simulator import SessionSimulator, SimConfig, fold_in_memory

P0 = [1, 2, 3]


def session(version: str = "v2", *, mode: str = "retract", r3: bool = False,
            trim: int = 0, speculative: bool = False) -> SessionSimulator:
    config = SimConfig(session_id="s", version=version, pause_generation_mode=mode,
                       num_layers=2 if r3 else None, speculative=speculative, max_trim_tokens=trim)
    return SessionSimulator(config, random.Random(0))


def fold(sim: SessionSimulator, bodies: list[dict[str, Any]]) -> SessionState:
    return fold_in_memory(sim.open_body(), bodies)[0]


def samples(sim: SessionSimulator, bodies: list[dict[str, Any]], max_seq_len: int | None = None,
            metadata: dict[str, Any] | None = None) -> SamplesResult:
    return build_samples(fold(sim, bodies), SessionClose(max_seq_len, metadata or {}))


def leaves(result: SamplesResult) -> list[int]:
    return [sample.leaf for sample in result.samples]


def two_turns(sim: SessionSimulator, finish: str | None = "stop") -> list[dict[str, Any]]:
    """tokens [1 2 3 | 1001 1002 | 4 5 | 1003]; response = the last five."""
    return [
        sim.turn(None, prompt=P0, output=[1001, 1002], logprobs=[-0.1, -0.2],
                 weight_version="7"),
        sim.turn(0, prompt=[*P0, 1001, 1002, 4, 5], output=[1003], logprobs=[-0.3],
                 weight_version="8", finish_reason=finish),
    ]


# -- which leaves ---------------------------------------------------------------------


def test_v1_returns_the_path_to_the_most_recently_committed_node() -> None:
    sim = session("v1")
    bodies = [sim.turn(None), sim.turn(0), sim.turn(1), sim.turn(0)]  # 3 rolls back to 0
    result = samples(sim, bodies)
    assert [(s.index, s.leaf, s.path) for s in result.samples] == [(0, 3, [0, 3])]


def test_v2_returns_one_sample_per_leaf() -> None:
    sim = session()
    bodies = [sim.turn(None), sim.turn(0), sim.turn(1), sim.turn(0)]
    assert leaves(samples(sim, bodies)) == [2, 3]


def test_v2_drops_a_leaf_whose_parent_was_extended_later() -> None:
    sim = session()
    root = sim.turn(None)
    first = sim.turn(0)
    retry = sim.turn(0, prompt=sim.nodes[1].prompt)
    assert leaves(samples(sim, [root, first, retry])) == [2]


def test_v2_never_drops_a_root() -> None:
    sim = session()
    bodies = [sim.turn(None, prompt=P0), sim.turn(None, prompt=P0)]
    assert leaves(samples(sim, bodies)) == [1, 0]


def test_v2_orders_by_path_length_then_leaf_seq_descending() -> None:
    sim = session()
    bodies = [sim.turn(None), sim.turn(0), sim.turn(1),  # leaf 2, length 3
              sim.turn(None),                             # leaf 3, length 1
              sim.turn(None), sim.turn(4),                # leaf 5, length 2
              sim.turn(None)]                             # leaf 6, length 1
    result = samples(sim, bodies)
    assert [(s.index, s.leaf) for s in result.samples] == [(0, 2), (1, 5), (2, 6), (3, 3)]


# -- merge ----------------------------------------------------------------------------


def test_merge_masks_kept_outputs_and_zeroes_the_tokens_between() -> None:
    sim = session()
    (sample,) = samples(sim, two_turns(sim)).samples
    assert sample.tokens == [1, 2, 3, 1001, 1002, 4, 5, 1003]
    assert sample.response_length == 5
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert sample.status == "completed"
    assert sample.turns == [0, 1]


def test_weight_versions_are_each_kept_turns_version() -> None:
    sim = session()
    (sample,) = samples(sim, two_turns(sim)).samples
    assert sample.weight_versions == ["7", "8"]


def test_a_turn_that_sent_null_reports_null_and_one_without_the_key_reports_nothing() -> None:
    """A helper's finding: an explicit `"weight_version": null` was left out of the
    list. miles appends the value whenever `meta_info` has the key, null included."""
    sim = session()
    bodies = two_turns(sim)
    bodies[0]["record"]["response"]["choices"][0]["meta_info"]["weight_version"] = None
    (sample,) = samples(sim, bodies).samples
    assert sample.weight_versions == [None, "8"]
    del bodies[0]["record"]["response"]["choices"][0]["meta_info"]["weight_version"]
    (sample,) = samples(sim, bodies).samples
    assert sample.weight_versions == ["8"]


def test_a_trim_up_to_max_trim_tokens_on_a_non_final_turn_is_cut_from_the_sample() -> None:
    sim = session(trim=1)
    bodies = [
        sim.turn(None, prompt=P0, output=[1001, 1002], logprobs=[-0.1, -0.2]),
        sim.turn(0, prompt=[*P0, 1001, 4, 5], output=[1003], logprobs=[-0.3]),
    ]
    (sample,) = samples(sim, bodies).samples
    assert sample.tokens == [1, 2, 3, 1001, 4, 5, 1003]
    assert sample.loss_mask == [1, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.1, 0.0, 0.0, -0.3]


@pytest.mark.parametrize(("max_trim", "trimmed"), [(0, 1), (1, 2)])
def test_a_trim_beyond_max_trim_tokens_leaves_the_sample_out(max_trim: int,
                                                              trimmed: int) -> None:
    sim = session(trim=max_trim)
    output = [1001, 1002, 1003]
    bodies = [sim.turn(None, prompt=P0, output=output),
              sim.turn(0, prompt=[*P0, *output[:3 - trimmed], 4], output=[1004])]
    result = samples(sim, bodies)
    assert result.samples == []
    assert result.empty_reason == "assembly_error"
    (error,) = result.errors
    assert error["leaf"] == 1 and error["type"] == "alignment"
    assert "turn 0" in error["detail"]


def test_the_final_turn_may_not_be_trimmed() -> None:
    sim = session(trim=2)
    state = fold(sim, [sim.turn(None, prompt=P0, output=[1001, 1002])])
    # A leaf whose accumulated ids miss its own last output token (possible
    # only for a v1-style checkpoint) is refused even within max_trim_tokens.
    leaf = dataclasses.replace(state.nodes[0], num_tokens=state.nodes[0].num_tokens - 1)
    with pytest.raises(Alignment) as excinfo:
        align([leaf], max_trim_tokens=2)
    assert excinfo.value.field == "path[0]"


def test_where_two_outputs_overlap_the_later_turns_log_prob_wins() -> None:
    # Turn 1 re-generated the token turn 0 ended with; greedy alignment keeps
    # both, and the final context is turn 1's.
    sim = session()
    bodies = [sim.turn(None, prompt=P0, output=[1001, 1002], logprobs=[-0.1, -0.2]),
              sim.turn(0, prompt=[*P0, 1001], output=[1002, 1003], logprobs=[-0.7, -0.8])]
    (sample,) = samples(sim, bodies).samples
    assert sample.tokens == [1, 2, 3, 1001, 1002, 1003]
    assert sample.loss_mask == [1, 1, 1]
    assert sample.rollout_log_probs == [-0.1, -0.7, -0.8]


def test_a_path_whose_prompts_shrink_cannot_be_assembled() -> None:
    sim = session()
    bodies = [sim.turn(None, prompt=[1, 2, 3, 4, 5], output=[]),
              sim.turn(0, prompt=[9], output=[1001])]
    result = samples(sim, bodies)
    assert result.samples == []
    assert [(e["leaf"], e["type"]) for e in result.errors] == [(1, "alignment")]


def test_an_unalignable_path_does_not_block_the_other_samples() -> None:
    sim = session()
    bodies = [sim.turn(None, prompt=P0, output=[1001, 1002]),
              sim.turn(0, prompt=[*P0, 1001, 4], output=[1003]),  # trims 1002: refused
              sim.turn(None, prompt=[7], output=[1005])]
    result = samples(sim, bodies)
    assert leaves(result) == [2]
    assert [error["leaf"] for error in result.errors] == [1]
    assert result.empty_reason is None


# -- truncation -----------------------------------------------------------------------


def test_truncation_cuts_the_overshoot_from_the_first_turn_over_the_limit() -> None:
    sim = session()
    bodies = [sim.turn(None, prompt=P0, output=[1001, 1002]),
              sim.turn(0, prompt=[*P0, 1001, 1002, 4, 5], output=[1003, 1004, 1005]),
              sim.turn(1, new_tokens=1)]
    (sample,) = samples(sim, bodies, max_seq_len=8).samples
    assert sample.tokens == [1, 2, 3, 1001, 1002, 4, 5, 1003]
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.status == "truncated"
    assert sample.turns == [0, 1] and sample.path == [0, 1, 2]


def test_truncation_drops_a_turn_left_without_output() -> None:
    sim = session()
    (sample,) = samples(sim, two_turns(sim), max_seq_len=7).samples
    assert sample.tokens == [1, 2, 3, 1001, 1002]
    assert sample.turns == [0]
    assert sample.status == "truncated"


def test_a_sample_exactly_at_the_limit_is_not_truncated() -> None:
    sim = session()
    (sample,) = samples(sim, two_turns(sim), max_seq_len=8).samples
    assert sample.status == "completed"


def test_all_truncated_when_no_sample_keeps_a_turn() -> None:
    sim = session()
    result = samples(sim, [*two_turns(sim), sim.turn(None, prompt=[9, 9, 9, 9])], max_seq_len=2)
    assert result.samples == [] and result.errors == []
    assert result.empty_reason == "all_truncated"


def test_no_turns_when_the_session_has_no_nodes() -> None:
    sim = session()
    result = samples(sim, [])
    assert result.samples == [] and result.empty_reason == "no_turns"


def test_errors_win_over_truncation_when_no_sample_remains() -> None:
    sim = session()
    bodies = [sim.turn(None, prompt=P0, output=[1001, 1002]),
              sim.turn(0, prompt=[*P0, 1001, 4], output=[1003]),
              sim.turn(None, prompt=[7, 7, 7, 7, 7, 7, 7, 7, 7, 7])]
    result = samples(sim, bodies, max_seq_len=9)
    assert result.samples == [] and result.empty_reason == "assembly_error"


# -- status ---------------------------------------------------------------------------


@pytest.mark.parametrize(("finish", "status"), [
    ("stop", "completed"), ("tool_calls", "completed"), ("length", "truncated"),
    ("abort", "aborted"), (None, "pending"), ("content_filter", "pending"),
])
def test_status_follows_the_last_kept_turns_finish_reason(finish: str | None,
                                                          status: str) -> None:
    sim = session()
    (sample,) = samples(sim, two_turns(sim, finish)).samples
    assert sample.status == status


def test_merging_stops_after_the_first_turn_that_is_not_completed() -> None:
    sim = session()
    bodies = [sim.turn(None, weight_version="1"),
              sim.turn(0, finish_reason="abort", weight_version="2"),
              sim.turn(1, weight_version="3")]
    state = fold(sim, bodies)
    (sample,) = build_samples(state, SessionClose(None, {})).samples
    assert sample.turns == [0, 1] and sample.path == [0, 1, 2]
    assert sample.tokens == state.nodes[1].tokens.tolist()
    assert sample.status == "aborted"
    assert sample.weight_versions == ["1", "2"]


def test_truncation_after_the_merge_stop_still_marks_the_sample_truncated() -> None:
    # docs/api.md §2.4 step 4: "truncated if step 3 removed anything", even when
    # the merge stop would have left the removed turn out anyway.
    sim = session()
    bodies = [sim.turn(None, prompt=P0, output=[1001], finish_reason="abort"),
              sim.turn(0, prompt=[*P0, 1001, 4], output=[1002, 1003])]
    (sample,) = samples(sim, bodies, max_seq_len=6).samples
    assert sample.turns == [0]
    assert sample.status == "truncated"


# -- v2 loss ownership ----------------------------------------------------------------


def test_a_shared_completion_trains_only_in_the_sample_with_the_smallest_leaf_seq() -> None:
    sim = session()
    bodies = [sim.turn(None, prompt=P0, output=[1001], logprobs=[-0.5]),
              sim.turn(0, output_tokens=1), sim.turn(1, output_tokens=1),  # leaf 2
              sim.turn(0, output_tokens=1), sim.turn(3, output_tokens=1)]  # leaf 4
    result = samples(sim, bodies)
    first, second = result.samples
    assert (first.leaf, second.leaf) == (4, 2)  # same length: leaf seq descending
    # Node 0's completion sits at response position 0 of both samples.
    assert second.loss_mask[0] == 1
    assert first.loss_mask[0] == 0
    assert first.rollout_log_probs[0] == second.rollout_log_probs[0] == -0.5
    # Completions each sample alone keeps still train.
    assert sum(first.loss_mask) == 2 and sum(second.loss_mask) == 3


def test_a_dropped_retry_owns_nothing() -> None:
    sim = session()
    bodies = [sim.turn(None, prompt=P0, output=[1001]),
              sim.turn(0, prompt=[*P0, 1001, 4]),
              sim.turn(0, prompt=[*P0, 1001, 4])]
    (sample,) = samples(sim, bodies).samples
    assert sample.leaf == 2 and sample.loss_mask[0] == 1


def test_v1_keeps_every_completion_in_its_one_sample() -> None:
    sim = session("v1")
    (sample,) = samples(sim, two_turns(sim)).samples
    assert sample.loss_mask == [1, 1, 0, 0, 1]


# -- reward, metadata, SpecInfo ---------------------------------------------------------


def test_reward_comes_from_the_close_metadata() -> None:
    sim = session()
    bodies = two_turns(sim)
    assert samples(sim, bodies, metadata={"reward": 0.25}).samples[0].reward == 0.25
    assert samples(sim, bodies).samples[0].reward is None


def test_tito_mismatch_is_the_leaf_turns_value_only() -> None:
    sim = session()
    mismatch = [{"type": "assistant_text", "segment_index": 3}]
    bodies = [sim.turn(None, mismatch=[{"type": "special_token_type"}]),
              sim.turn(0, mismatch=mismatch),
              sim.turn(None, mismatch=[{"type": "special_token_type"}]),
              sim.turn(2)]
    by_leaf = {s.leaf: s for s in samples(sim, bodies).samples}
    assert by_leaf[1].metadata == {"tito_session_mismatch": mismatch}
    assert by_leaf[3].metadata == {}


def test_tito_mismatch_of_a_leaf_cut_by_truncation_still_applies() -> None:
    sim = session()
    bodies = [sim.turn(None, prompt=P0, output=[1001]),
              sim.turn(0, prompt=[*P0, 1001, 4], output=[1002], mismatch=[])]
    (sample,) = samples(sim, bodies, max_seq_len=4).samples
    assert sample.turns == [0]
    assert sample.metadata == {"tito_session_mismatch": []}


def test_samples_sum_their_kept_turns_while_the_carrier_counts_every_node_once() -> None:
    """miles' count_every_tree_node_once: shared nodes once, retries and cut turns too."""
    sim = session(speculative=True)

    def spec(correct: int, proposed: int, verify: int) -> dict[str, int]:
        return {"spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed,
                "spec_verify_ct": verify}

    bodies = [
        sim.turn(None, prompt=P0, output_tokens=1, spec_info=spec(4, 10, 1)),        # 0 shared
        sim.turn(0, new_tokens=1, output_tokens=1, spec_info=spec(50, 50, 1)),       # 1 retried
        sim.turn(0, new_tokens=1, output_tokens=1, spec_info=spec(5, 10, 1)),        # 2
        sim.turn(2, new_tokens=1, output_tokens=5, spec_info=spec(9, 9, 0)),         # 3 guarded
        sim.turn(0, new_tokens=1, output_tokens=1, spec_info=spec(5, 10, 1)),        # 4
        sim.turn(None, prompt=[7] * 20, output_tokens=2, spec_info=spec(40, 50, 2)),  # 5 cut away
    ]
    result = samples(sim, bodies, max_seq_len=12)
    assert leaves(result) == [3, 4]
    per_leaf = {"spec_num_correct_drafts": 9, "spec_num_proposed_drafts": 20,
                "spec_verify_ct": 2, "completion_tokens": 2}
    assert [s.spec_info for s in result.samples] == [per_leaf, per_leaf]
    assert result.session_metrics == {
        "session_id": "s",
        "metrics": {"spec_info": {"spec_num_correct_drafts": 104,
                                  "spec_num_proposed_drafts": 130,
                                  "spec_verify_ct": 6, "completion_tokens": 6}},
    }


def test_session_metrics_is_null_without_spec() -> None:
    sim = session()
    assert samples(sim, two_turns(sim)).session_metrics is None


# -- R3 -------------------------------------------------------------------------------


def test_a_full_mode_sample_has_the_shape_of_its_tokens() -> None:
    sim = session(r3=True)
    (sample,) = samples(sim, two_turns(sim)).samples
    assert sample.r3 == {"shape": [7, 2, 2], "dtype": "int32"}
    assert sample.read_plan().rows == 7


def test_no_r3_without_r3_on_the_session() -> None:
    sim = session()
    (sample,) = samples(sim, two_turns(sim)).samples
    assert sample.r3 is None
    with pytest.raises(UnknownSample):
        sample.read_plan()


def test_full_mode_last_kept_turn_without_r3_has_no_r3() -> None:
    sim = session(r3=True)
    bodies = [sim.turn(None), sim.turn(0, with_r3=False)]
    (sample,) = samples(sim, bodies).samples
    assert sample.r3 is None
    with pytest.raises(UnknownSample) as excinfo:
        sample.read_plan()
    assert excinfo.value.http_status == 404


def test_an_addition_gap_is_served_and_fails_only_the_tensor_read() -> None:
    sim = session(mode="in_place", r3=True)
    bodies = [sim.turn(None, with_r3=False), sim.turn(0)]
    (sample,) = samples(sim, bodies).samples
    assert sample.r3 is not None and sample.r3["shape"][0] == len(sample.tokens) - 1
    assert sample.tokens and sample.loss_mask
    with pytest.raises(R3Gap) as excinfo:
        sample.read_plan()
    assert excinfo.value.http_status == 422
    assert excinfo.value.field == "path[0]"


# -- JSON -----------------------------------------------------------------------------


SAMPLE_KEYS = ["index", "leaf", "path", "tokens", "response_length", "loss_mask",
               "rollout_log_probs", "status", "weight_versions", "spec_info", "reward",
               "reward_source", "metadata", "r3"]


def test_sample_json_has_exactly_the_documented_keys() -> None:
    sim = session(r3=True)
    result = samples(sim, two_turns(sim), metadata={"reward": 1.0})
    body = result.to_json(arrays=True)
    assert list(body) == ["session_id", "version", "empty_reason", "errors", "samples",
                          "session_metrics"]
    assert list(body["samples"][0]) == SAMPLE_KEYS
    assert body["samples"][0]["path"] == [0, 1]


def test_sample_json_without_arrays_omits_tokens_loss_mask_and_log_probs() -> None:
    sim = session()
    (sample,) = samples(sim, two_turns(sim)).samples
    keys = list(sample.to_json(arrays=False))
    assert keys == [k for k in SAMPLE_KEYS
                    if k not in ("tokens", "loss_mask", "rollout_log_probs")]


def test_an_unknown_sample_index_is_a_404() -> None:
    sim = session()
    result = samples(sim, two_turns(sim))
    assert result.sample(0).leaf == 1
    with pytest.raises(UnknownSample):
        result.sample(1)
