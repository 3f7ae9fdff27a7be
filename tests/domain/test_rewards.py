"""Which reward each sample shows (`latest_rewards`), against an oracle that reads the
rule the other way round: per sample, scan the rewards from the newest back."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.domain.body.rewards import RewardBody, latest_rewards, parse_reward, targets
from app.domain.errors import InvalidRequest, UnknownSample


def rb(i: int, reward: float, sample: int | None = None, response_id: str | None = None,
       source: str | None = None) -> RewardBody:
    return RewardBody(f"e{i}", reward, sample, response_id, source)


def oracle(close_reward: Any, response_ids: list[str | None],
           rewards: list[RewardBody]) -> list[tuple[Any, str | None]]:
    out = []
    for index, rid in enumerate(response_ids):
        aimed = [r for r in rewards if r.sample == index
                 or (r.response_id is not None and r.response_id == rid)]
        wide = [r for r in rewards if r.sample is None and r.response_id is None]
        pick = aimed[-1] if aimed else wide[-1] if wide else None
        out.append((close_reward, None) if pick is None else (pick.reward, pick.source))
    return out


def test_per_sample_wins_over_session_wide_in_either_order() -> None:
    ids = ["a", "b"]
    before = [rb(0, 1.0, source="wide"), rb(1, 2.0, sample=1, source="one")]
    after = [rb(1, 2.0, sample=1, source="one"), rb(0, 1.0, source="wide")]
    for rewards in (before, after):
        got = [(r.reward, r.source) for r in latest_rewards(0.5, ids, rewards)]
        assert got == [(1.0, "wide"), (2.0, "one")]
    assert [(r.reward, r.source) for r in latest_rewards(0.5, ids, [])] == \
        [(0.5, None), (0.5, None)]


def test_a_response_id_reaches_every_leaf_that_has_it() -> None:
    got = latest_rewards(None, ["x", None, "x"], [rb(0, 3.0, response_id="x")])
    assert [r.reward for r in got] == [3.0, None, 3.0]


def test_targets_refuse_what_names_no_sample() -> None:
    with pytest.raises(UnknownSample):
        targets(rb(0, 1.0, sample=2), ["a", "b"])
    with pytest.raises(UnknownSample):
        targets(rb(0, 1.0, response_id="zz"), ["a", None])
    assert targets(rb(0, 1.0), []) is None


def test_parse_fills_defaults_and_refuses_both_targets() -> None:
    assert parse_reward({"event_id": "e", "reward": 1}).body() == {
        "event_id": "e", "reward": 1, "sample": None, "response_id": None, "source": None}
    with pytest.raises(InvalidRequest) as exc:
        parse_reward({"event_id": "e", "reward": 1, "sample": 0, "response_id": "a"})
    assert exc.value.field == "response_id"


rewards_strategy = st.lists(st.tuples(
    st.floats(-10, 10, allow_nan=False),
    st.one_of(st.none(), st.integers(0, 4)),
    st.one_of(st.none(), st.sampled_from(["a", "b", "c"])),
    st.one_of(st.none(), st.sampled_from(["rm1", "rm2"])),
), max_size=12)


@given(ids=st.lists(st.one_of(st.none(), st.sampled_from(["a", "b", "c"])), max_size=4),
       raw=rewards_strategy, close=st.one_of(st.none(), st.floats(-1, 1)))
def test_latest_rewards_agree_with_the_oracle(ids, raw, close) -> None:
    rewards = []
    for i, (value, sample, rid, source) in enumerate(raw):
        # At most one target; a reward naming no sample of these was never recorded.
        body = rb(i, value, sample, None if sample is not None else rid, source)
        try:
            targets(body, ids)
        except UnknownSample:
            continue
        rewards.append(body)
    got = [(r.reward, r.source) for r in latest_rewards(close, ids, rewards)]
    assert got == oracle(close, ids, rewards)
