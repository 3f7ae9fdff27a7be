"""Token lanes and tree marks over random simulated sessions.

Oracles independent of `app/domain/projection/lanes.py`: the simulator's own record of
each node's prompt and output, a retry rule written here from the tree's
shape, and the samples' own loss masks (every trained position of every
sample is one output token of exactly one node).
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.body.session import SessionClose
from app.domain.log.tree import SessionState
from app.domain.projection.lanes import node_marks, token_lanes
from app.domain.projection.samples import build_samples
from app.sim.simulator import SessionSimulator, SimConfig, SimRates, fold_in_memory

PROPERTY = settings(max_examples=60, deadline=None)
MODES = (("v2", "retract"), ("v2", "in_place"), ("v1", "retract"), ("v1", "in_place"))


def play(seed: int, mode: int, turns: int, trim: int) -> tuple[SessionSimulator, SessionState]:
    version, pause = MODES[mode]
    config = SimConfig(session_id=f"lanes-{seed}", version=version,
                       pause_generation_mode=pause, max_trim_tokens=trim, speculative=True)
    sim = SessionSimulator(config, random.Random(seed), SimRates(retry=0.3))
    bodies = sim.random_session(turns)
    state, _ = fold_in_memory(sim.open_body(), bodies)
    return sim, state


@PROPERTY
@given(seed=st.integers(0, 10_000), mode=st.integers(0, 3), turns=st.integers(1, 14),
       trim=st.integers(0, 1))
def test_marks_follow_the_tree_shape(seed: int, mode: int, turns: int, trim: int) -> None:
    sim, state = play(seed, mode, turns, trim)
    marks = node_marks(state)
    nodes = sim.nodes
    for node in nodes:
        later_sibling = node.parent is not None and any(
            other.parent == node.parent and other.seq > node.seq for other in nodes)
        leaf = not any(other.parent == node.seq for other in nodes)
        assert marks.retry[node.seq] == (state.definition.version == "v2" and later_sibling)
        if state.definition.version == "v2":
            assert marks.dropped[node.seq] == (leaf and later_sibling)
        else:  # v1 keeps only the latest node's path
            assert marks.dropped[node.seq] == (leaf and node.seq != len(nodes) - 1)


@PROPERTY
@given(seed=st.integers(0, 10_000), mode=st.integers(0, 3), turns=st.integers(1, 14),
       trim=st.integers(0, 1), max_seq_len=st.one_of(st.none(), st.integers(5, 60)))
def test_lanes_show_each_trained_token_once(seed: int, mode: int, turns: int, trim: int,
                                            max_seq_len: int | None) -> None:
    sim, state = play(seed, mode, turns, trim)
    open_lanes = token_lanes(state, 0, None)
    assert open_lanes.loss is None and open_lanes.in_sample is None
    result = build_samples(state, SessionClose(max_seq_len=max_seq_len, metadata={}))
    trained = 0
    for node in sim.nodes:
        lanes = token_lanes(state, node.seq, result.samples)
        parent = () if node.parent is None else sim.nodes[node.parent].tokens
        shared = 0
        while shared < min(len(parent), len(node.prompt)) and \
                parent[shared] == node.prompt[shared]:
            shared += 1
        assert lanes.prompt_shared == shared
        assert lanes.new_prompt == list(node.prompt[shared:])
        assert lanes.output == list(node.output)
        assert lanes.loss is not None and lanes.in_sample is not None
        assert all(lanes.in_sample[i] for i, loss in enumerate(lanes.loss) if loss)
        holders = {s.index for s in result.samples if node.seq in s.turns}
        assert set(lanes.samples) == holders
        if not holders:
            assert not any(lanes.in_sample)
        trained += sum(lanes.loss)
    assert trained == sum(sum(s.loss_mask) for s in result.samples)
