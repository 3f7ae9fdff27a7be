"""Rewards recorded after the close: parsing the body and which reward each sample shows.

A reward model usually scores a rollout once the agent is done, so the
reward is not known at close. `POST …/rewards` records a `reward_recorded`
event; this module owns the body's rules (a finite number, at most one of
`sample` and `response_id`, `source` of at most 128 characters), which
samples one reward targets (a sample index, every sample whose leaf turn's
`response.id` it is, or the whole session) and the fold over a session's
rewards in commit order: per sample, the latest reward aimed at it wins over
any session-wide one whatever their order; else the latest session-wide one;
else the close's reward, with no source. Pure: the store locks, persists and
hands the recorded rewards back in log order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from app.domain.body.turn import parse_event_id
from app.domain.errors import InvalidRequest, UnknownSample
from app.domain.wire.validate import (
    describe,
    finite_float,
    is_int,
    reject_unknown,
    require_object,
    require_text,
)

REWARD_FIELDS = frozenset({"event_id", "reward", "sample", "response_id", "source"})
SOURCE_MAX = 128


@dataclass(frozen=True)
class RewardBody:
    """One recorded reward, as sent with its defaults filled in."""

    event_id: str
    reward: int | float  # the JSON number as sent (finite)
    sample: int | None
    response_id: str | None
    source: str | None

    @property
    def session_wide(self) -> bool:
        return self.sample is None and self.response_id is None

    def body(self) -> dict[str, Any]:
        """What the event stores and an identical repeat is compared against."""
        return {"event_id": self.event_id, "reward": self.reward, "sample": self.sample,
                "response_id": self.response_id, "source": self.source}

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> RewardBody:
        """Rebuild from a stored, already parsed body."""
        return cls(event_id=body["event_id"], reward=body["reward"], sample=body.get("sample"),
                   response_id=body.get("response_id"), source=body.get("source"))


def parse_reward(raw: Any) -> RewardBody:
    body = require_object(raw, "body")
    reject_unknown(body, REWARD_FIELDS, "")
    event_id = parse_event_id(body)
    if "reward" not in body:
        raise InvalidRequest("reward is required", field="reward",
                             expected="finite number", actual="absent")
    reward = body["reward"]
    if finite_float(reward) is None:
        raise InvalidRequest("reward must be a finite number", field="reward",
                             expected="finite number", actual=describe(reward))
    # Any index and any string: which samples exist is the session's to say (404),
    # and a leaf's response.id is whatever text SGLang put there, empty or long.
    sample = body.get("sample")
    if sample is not None and (not is_int(sample) or sample < 0):
        raise InvalidRequest("sample must be a sample index or null", field="sample",
                             expected="integer >= 0 | null", actual=describe(sample))
    response_id = body.get("response_id")
    if response_id is not None and not isinstance(response_id, str):
        raise InvalidRequest("response_id must be a string or null", field="response_id",
                             expected="string | null", actual=describe(response_id))
    if sample is not None and response_id is not None:
        raise InvalidRequest("give at most one of sample and response_id",
                             field="response_id", expected="null when sample is given",
                             actual=describe(response_id))
    source = body.get("source")
    if source is not None:
        require_text(source, "source", SOURCE_MAX)
    return RewardBody(event_id=event_id, reward=reward, sample=sample,
                      response_id=response_id, source=source)


def targets(reward: RewardBody, response_ids: Sequence[str | None]) -> list[int] | None:
    """The sample indices `reward` is aimed at (None: session-wide), given each
    sample's leaf `response.id` in sample order; 404 when it names none."""
    if reward.sample is not None:
        if reward.sample >= len(response_ids):
            raise UnknownSample(f"session has no sample {reward.sample}", field="sample",
                                expected=f"an index below {len(response_ids)}",
                                actual=reward.sample)
        return [reward.sample]
    if reward.response_id is not None:
        hit = [i for i, rid in enumerate(response_ids) if rid == reward.response_id]
        if not hit:
            raise UnknownSample("no sample's leaf turn has this response.id",
                                field="response_id",
                                expected="the response.id of a sample's leaf turn",
                                actual=describe(reward.response_id))
        return hit
    return None


@dataclass(frozen=True)
class SampleReward:
    reward: Any
    source: str | None


def latest_rewards(close_reward: Any, response_ids: Sequence[str | None],
                   rewards: Iterable[RewardBody]) -> list[SampleReward]:
    """Each sample's reward after `rewards` (in commit order): the latest aimed at it,
    else the latest session-wide one, else the close's reward with no source.

    A reward that names no sample of this projection (recorded against another
    version of the rules) is skipped here: folding never fails on the log."""
    session_wide: RewardBody | None = None
    per_sample: dict[int, RewardBody] = {}
    for reward in rewards:
        try:
            aimed = targets(reward, response_ids)
        except UnknownSample:
            continue
        if aimed is None:
            session_wide = reward
        else:
            for index in aimed:
                per_sample[index] = reward
    out = []
    for index in range(len(response_ids)):
        chosen = per_sample.get(index, session_wide)
        out.append(SampleReward(close_reward, None) if chosen is None
                   else SampleReward(chosen.reward, chosen.source))
    return out


def all_rewarded(rewards: Iterable[Any]) -> bool:
    """Every sample's reward (one per sample) is non-null; true without samples:
    there is nothing to wait for."""
    return all(reward is not None for reward in rewards)
