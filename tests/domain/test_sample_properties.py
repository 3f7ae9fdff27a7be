"""Properties of the samples projection over random simulated sessions.

The simulator plays honest TITO sessions (branches, retries, trims within
`max_trim_tokens`, every finish reason, both R3 modes, v1 and v2); this file
recomputes docs/api.md §2 from the simulator's own record of what it sent — an
oracle written independently of `app/domain/samples*.py` — and checks every
sample's R3 against a full forward of the causal router over its tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.body.session import SessionClose
from app.domain.log.tree import SessionState
from app.domain.projection.assembly import assemble
from app.domain.projection.samples import SamplesResult, build_samples
from app.domain.wire.r3 import Patch
from app.sim.simulator import SessionSimulator, SimConfig, SimNode, SimRates, fold_in_memory, route

LAYERS, TOPK, EXPERTS = 2, 2, 16
STATUS = {"stop": "completed", "tool_calls": "completed", "length": "truncated",
          "abort": "aborted"}
PROPERTY = settings(max_examples=100, deadline=None)


@dataclass
class Played:
    sim: SessionSimulator
    bodies: list[dict[str, Any]]
    state: SessionState
    patches: dict[int, Patch]
    result: SamplesResult
    max_seq_len: int | None


@st.composite
def played(draw: st.DrawFn, no_r3: float = 0.0) -> Played:
    config = SimConfig(
        version=draw(st.sampled_from(["v1", "v2"])),
        pause_generation_mode=draw(st.sampled_from(["retract", "in_place"])),
        num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS,
        speculative=True, max_trim_tokens=draw(st.integers(0, 2)),
        router_seed=draw(st.integers(0, 3)),
    )
    rates = SimRates(no_r3=no_r3, omit_parent=draw(st.sampled_from([0.0, 0.5])),
                     retry=draw(st.sampled_from([0.0, 0.3])))
    # A drawn seed, not st.randoms(): recording every random call as a draw
    # makes each example many times slower and the suite must stay fast.
    sim = SessionSimulator(config, random.Random(draw(st.integers(0, 2 ** 32 - 1))), rates)
    bodies = sim.random_session(draw(st.integers(1, 12)))
    max_seq_len = draw(st.none() | st.integers(1, 60))
    state, patches = fold_in_memory(sim.open_body(), bodies)
    result = build_samples(state, SessionClose(max_seq_len, {"reward": 1.0}))
    return Played(sim, bodies, state, patches, result, max_seq_len)


# -- the oracle -------------------------------------------------------------------------


def meta(body: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = body["record"]["response"]["choices"][0]["meta_info"]
    return info


def sim_path(sim: SessionSimulator, leaf: int) -> list[SimNode]:
    path: list[SimNode] = []
    seq: int | None = leaf
    while seq is not None:
        path.append(sim.nodes[seq])
        seq = sim.nodes[seq].parent
    return path[::-1]


def expected_leaves(sim: SessionSimulator) -> list[int]:
    nodes = sim.nodes
    if sim.config.version == "v1":
        return [len(nodes) - 1]
    children: dict[int, list[int]] = {node.seq: [] for node in nodes}
    for node in nodes:
        if node.parent is not None:
            children[node.parent].append(node.seq)
    kept = [node.seq for node in nodes if not children[node.seq]
            and (node.parent is None or max(children[node.parent]) == node.seq)]
    return sorted(kept, key=lambda seq: (len(sim_path(sim, seq)), seq), reverse=True)


@dataclass
class Expected:
    leaf: int
    turns: list[SimNode]
    kept: list[int]
    status: str


def expected_sample(sim: SessionSimulator, leaf: int, max_seq_len: int | None) -> Expected | None:
    path = sim_path(sim, leaf)
    # What the next prompt dropped of a turn's tokens is exactly its trim.
    kept = []
    for node, child in zip(path, [*path[1:], None], strict=True):
        trim = 0
        if child is not None:
            common = next((i for i, (a, b) in enumerate(zip(node.tokens, child.prompt,
                                                                strict=False)) if a != b),
                          min(len(node.tokens), len(child.prompt)))
            trim = len(node.tokens) - common
        kept.append(len(node.output) - trim)
    truncated = False
    if max_seq_len is not None:
        for index, node in enumerate(path):
            over = len(node.prompt) + kept[index] - max_seq_len
            if over > 0:
                truncated = True
                kept[index] -= over
                path, kept = path[:index + 1], kept[:index + 1]
                if kept[index] <= 0:
                    path, kept = path[:index], kept[:index]
                break
    if not path:
        return None
    stop = next((i + 1 for i, node in enumerate(path)
                 if STATUS.get(node.finish_reason or "") != "completed"), len(path))
    path, kept = path[:stop], kept[:stop]
    status = "truncated" if truncated else STATUS.get(path[-1].finish_reason or "", "pending")
    return Expected(leaf, path, kept, status)


def check_against_oracle(game: Played) -> None:
    sim, bodies, result = game.sim, game.bodies, game.result
    expected = [e for leaf in expected_leaves(sim)
                if (e := expected_sample(sim, leaf, game.max_seq_len)) is not None]
    assert result.errors == []
    assert [s.leaf for s in result.samples] == [e.leaf for e in expected]
    assert [s.index for s in result.samples] == list(range(len(expected)))
    assert result.empty_reason == (None if expected else "all_truncated")
    owner: dict[int, int] = {}
    if sim.config.version == "v2":
        for e in expected:
            for node in e.turns:
                owner[node.seq] = min(owner.get(node.seq, e.leaf), e.leaf)
    for sample, e in zip(result.samples, expected, strict=True):
        last = e.turns[-1]
        tokens = list(last.prompt + last.output[:e.kept[-1]])
        start = len(e.turns[0].prompt)
        mask = [0] * (len(tokens) - start)
        logprobs = [0.0] * (len(tokens) - start)
        for node, count in zip(e.turns, e.kept, strict=True):
            entries = meta(bodies[node.seq])["output_token_logprobs"]
            owned = owner.get(node.seq, e.leaf) == e.leaf
            for j in range(count):
                mask[len(node.prompt) + j - start] = int(owned)
                logprobs[len(node.prompt) + j - start] = entries[j][0]
        assert sample.path == [node.seq for node in sim_path(sim, e.leaf)]
        assert sample.turns == [node.seq for node in e.turns]
        assert sample.tokens == tokens
        assert sample.response_length == len(tokens) - start
        assert sample.loss_mask == mask
        assert sample.rollout_log_probs == logprobs
        assert sample.status == e.status
        assert sample.weight_versions == [meta(bodies[n.seq])["weight_version"]
                                          for n in e.turns]
        assert sample.reward == 1.0
        if game.max_seq_len is not None:
            assert len(sample.tokens) <= game.max_seq_len


def check_r3(game: Played, sample_index: int) -> bool:
    """True when the sample had a tensor, which then equals a full forward."""
    sample = game.result.samples[sample_index]
    if sample.r3_plan is None:
        return False
    tensor = assemble(sample.read_plan(), game.patches)
    assert sample.r3 == {"shape": list(tensor.shape), "dtype": "int32"}
    assert tensor.shape[0] == len(sample.tokens) - 1
    if game.state.topk is None:
        # No payload ever had a row: nothing to replay, and topk is unknown.
        assert tensor.shape[0] == 0
        return True
    oracle = route(np.asarray(sample.tokens), LAYERS, TOPK, EXPERTS, game.sim.config.router_seed)
    assert tensor.tobytes() == oracle.tobytes()
    return True


# -- properties -------------------------------------------------------------------------


@PROPERTY
@given(played())
def test_every_sample_replays_a_full_forward_over_its_tokens(game: Played) -> None:
    for index in range(len(game.result.samples)):
        assert check_r3(game, index)


@PROPERTY
@given(played())
def test_samples_follow_the_documented_rules(game: Played) -> None:
    check_against_oracle(game)


@PROPERTY
@given(played(no_r3=0.25))
def test_a_missing_tensor_is_null_or_a_gap_never_a_wrong_one(game: Played) -> None:
    check_against_oracle(game)
    addition = game.sim.config.addition
    for index, sample in enumerate(game.result.samples):
        carries = [bool(game.state.node(seq).r3_span) for seq in sample.turns]
        if check_r3(game, index):
            continue
        if sample.r3 is None:
            assert not any(carries) if addition else not carries[-1]
        else:
            assert addition and not all(carries)
            assert sample.r3_error is not None and sample.r3_error.http_status == 422


@PROPERTY
@given(played())
def test_the_carrier_sums_every_contributing_turn_once(game: Played) -> None:
    keys = ("spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_verify_ct")
    totals = dict.fromkeys((*keys, "completion_tokens"), 0)
    for body in game.bodies:
        info = meta(body)
        if info["spec_verify_ct"] > 0:
            for key in keys:
                totals[key] += info[key]
            totals["completion_tokens"] += info["completion_tokens"]
    assert game.result.session_metrics == {"session_id": game.sim.config.session_id,
                                           "metrics": {"spec_info": totals}}


def test_the_simulator_is_deterministic() -> None:
    def play() -> list[dict[str, Any]]:
        sim = SessionSimulator(SimConfig(pause_generation_mode="in_place", max_trim_tokens=1),
                               random.Random(11))
        return sim.random_session(10)

    assert play() == play()


def test_route_is_causal() -> None:
    tokens = np.arange(30) * 7 % 13
    full = route(tokens, LAYERS, TOPK, EXPERTS)
    assert full.shape == (29, LAYERS, TOPK)
    assert np.array_equal(route(tokens[:10], LAYERS, TOPK, EXPERTS), full[:9])
    changed = tokens.copy()
    changed[20] += 1
    assert np.array_equal(route(changed, LAYERS, TOPK, EXPERTS)[:20], full[:20])
    assert not np.array_equal(route(changed, LAYERS, TOPK, EXPERTS)[20:], full[20:])
    assert all(len(set(row)) == TOPK for row in full.reshape(-1, TOPK).tolist())
