"""The consumer-group rules as pure functions: matching, claimability, the ack verdict."""

from __future__ import annotations

import pytest

from app.domain.errors import InvalidRequest, LeaseLost
from app.domain.handoff.consumers import (
    Holding,
    ack_verdict,
    claimable,
    matches,
    parse_ack,
    parse_claim,
    parse_group,
    requested,
)

NOW = 1_000_000


def held(sid, claim=None, expires=None, acked=False):
    return Holding(session_id=sid, claim_id=claim, expires_us=expires, acked=acked)


def test_labels_match_as_text_and_an_empty_group_matches_everything():
    group = parse_group("g", {"labels": {"run_id": "r7", "rollout_id": 12}}).label_texts()
    assert matches(group, {"run_id": "r7", "rollout_id": 12, "model": "m"})
    assert not matches(group, {"run_id": "r7", "rollout_id": "13"})
    assert not matches(group, {"run_id": "r7"})
    assert matches({}, {})


def test_defaults_fill_in():
    assert parse_group("g", {}).body() == {"labels": {}, "from": "beginning"}
    c = parse_claim({"claim_id": "c"})
    assert (c.limit, c.lease_seconds, c.wait) == (1, 600, 0.0)
    a = parse_ack({})
    assert (a.sessions, a.step) == (None, None)


@pytest.mark.parametrize("step", [-1, 2**63, 1.5, "3", True])
def test_an_ack_step_beyond_64_bits_is_refused_naming_the_bound(step):
    # A helper's finding: 2**63 was refused as not "integer >= 0", which it is.
    with pytest.raises(InvalidRequest) as refused:
        parse_ack({"step": step})
    assert refused.value.field == "step"
    assert refused.value.expected == "integer in [0, 9223372036854775807] | null"
    assert parse_ack({"step": 2**63 - 1}).step == 2**63 - 1


def test_claimable_is_neither_acked_nor_under_a_live_lease():
    assert claimable(held("a"), NOW)
    assert claimable(held("a", "c", NOW), NOW)  # expired exactly now
    assert not claimable(held("a", "c", NOW + 1), NOW)
    assert not claimable(held("a", "c", 0, acked=True), NOW)


def test_the_ack_verdict_lets_a_late_ack_win_only_without_a_rival():
    mine = held("a", "me", NOW - 1)
    assert ack_verdict("me", [mine], {}, NOW) == ["a"]
    expired_rival = held("a", "other", NOW - 1)
    assert ack_verdict("me", [expired_rival], {}, NOW) == ["a"]
    with pytest.raises(LeaseLost) as lost:
        ack_verdict("me", [held("a", "me", NOW - 1), held("b", "other", NOW + 5)], {}, NOW)
    assert lost.value.extra["sessions"] == ["b"]
    with pytest.raises(LeaseLost):
        ack_verdict("me", [held("a", "other", 0, acked=True)], {"a": "other"}, NOW)
    # Already acknowledged by this claim: answered again, not acknowledged twice.
    assert ack_verdict("me", [held("a", "me", 0, acked=True)], {"a": "me"}, NOW) == []


def test_requested_defaults_to_the_claim_and_refuses_strangers():
    assert requested(["a", "b"], None) == ["a", "b"]
    assert requested(["a", "b"], ["b"]) == ["b"]
    with pytest.raises(InvalidRequest):
        requested(["a"], ["a", "z"])
