"""Speculative-decoding counters (SpecInfo) and the per-session carrier.

Owns the rule of docs/api.md §3: which turns contribute (the `spec_verify_ct > 0`
guard), how counters sum, how the two rates are derived from the sums, and
the session carrier `session_metrics` summed over every node of a session.
Refuses to own reading counters from a record (legacy names are resolved in
`app/domain/turn.py`), choosing which turns make a sample
(`app/domain/samples.py`) and aggregating many sessions (the store's SQL
views, which must reproduce `accept_rate`/`accept_length` bit for bit).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.domain.tree import SessionState
from app.domain.turn import SpecCounters

SPEC_INFO_KEYS = ("spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_verify_ct",
                  "completion_tokens")


def contributes(counters: SpecCounters) -> bool:
    """A turn without verification steps was not decoded speculatively: counting
    its completion tokens would dilute the accept length, so it adds nothing."""
    return counters.verify > 0


def _ratio(numerator: int, denominator: int) -> float:
    # Each sum becomes a float64 first, then one division: the same two roundings
    # as SQL `CAST(a AS DOUBLE PRECISION) / CAST(b AS DOUBLE PRECISION)`, so the
    # analytics views agree with this code exactly (true int division would not
    # once sums pass 2**53).
    if denominator == 0:
        return 0.0
    return float(numerator) / float(denominator)


@dataclass
class SpecInfo:
    """Integer sums of the four counters; rates exist only after summing."""

    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0
    spec_verify_ct: int = 0
    completion_tokens: int = 0

    def add_turn(self, counters: SpecCounters) -> None:
        """Add one turn in place, subject to the guard. Returns None on purpose:
        `info = info.add_turn(c)` is then a type error instead of a lost sum."""
        if not contributes(counters):
            return
        self.spec_num_correct_drafts += counters.correct
        self.spec_num_proposed_drafts += counters.proposed
        self.spec_verify_ct += counters.verify
        self.completion_tokens += counters.completion

    def __add__(self, other: SpecInfo) -> SpecInfo:
        return SpecInfo(
            spec_num_correct_drafts=self.spec_num_correct_drafts + other.spec_num_correct_drafts,
            spec_num_proposed_drafts=self.spec_num_proposed_drafts
            + other.spec_num_proposed_drafts,
            spec_verify_ct=self.spec_verify_ct + other.spec_verify_ct,
            completion_tokens=self.completion_tokens + other.completion_tokens,
        )

    def as_dict(self) -> dict[str, int]:
        return {
            "spec_num_correct_drafts": self.spec_num_correct_drafts,
            "spec_num_proposed_drafts": self.spec_num_proposed_drafts,
            "spec_verify_ct": self.spec_verify_ct,
            "completion_tokens": self.completion_tokens,
        }

    @classmethod
    def from_dict(cls, counters: Mapping[str, Any]) -> SpecInfo:
        """Inverse of `as_dict` (a carrier or sample `spec_info` read back)."""
        return cls(**{key: int(counters[key]) for key in SPEC_INFO_KEYS})

    @property
    def accept_rate(self) -> float:
        return _ratio(self.spec_num_correct_drafts, self.spec_num_proposed_drafts)

    @property
    def accept_length(self) -> float:
        return _ratio(self.completion_tokens, self.spec_verify_ct)


def sum_turns(turns: Iterable[SpecCounters]) -> SpecInfo:
    total = SpecInfo()
    for counters in turns:
        total.add_turn(counters)
    return total


def session_carrier(state: SessionState) -> dict[str, Any] | None:
    """`session_metrics`: every node counted once, whatever the leaves.

    Retries, rolled-back branches and turns that truncation cut all cost
    speculative work, so they count here although no sample trains on them;
    summing per leaf instead would count shared ancestors once per leaf.
    """
    if not state.spec.spec:
        return None
    total = sum_turns(node.facts.spec for node in state.nodes)
    return {"session_id": state.spec.session_id, "metrics": {"spec_info": total.as_dict()}}
