"""Speculative-decoding counters (SpecInfo): the guard, the sums and the rates.

Owns the rule of docs/api.md §3: which turns contribute (the `spec_verify_ct > 0`
guard), how counters sum and how the two rates are derived from the sums.
Refuses to own reading counters from a record (legacy names are resolved in
`app/domain/body/turn.py`), choosing which turns make a sample and the session
carrier summed over a session's tree (`app/domain/projection/samples.py`: the carrier
needs the tree, and the tree's turns carry SpecInfo, so it lives with the
samples, not here) and aggregating many sessions (the store's SQL
views, which must reproduce `accept_rate`/`accept_length` bit for bit).
`SpecInfo` is the one counters type: a turn's counters, a sample's, a
carrier's and an analytics group's, with one key tuple, one mapping to table
columns and one ratio helper.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

# The four counters, in their miles wire names (record meta_info, samples,
# carriers, analytics replies and the `spec_turns` view all use them).
SPEC_INFO_KEYS = ("spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_verify_ct",
                  "completion_tokens")
# Counter → column of the `nodes`, `samples` and `sessions` tables.
SPEC_INFO_COLUMNS: Mapping[str, str] = MappingProxyType({
    "spec_num_correct_drafts": "spec_correct",
    "spec_num_proposed_drafts": "spec_proposed",
    "spec_verify_ct": "spec_verify",
    "completion_tokens": "spec_completion",
})


def ratio(numerator: int, denominator: int) -> float:
    """float64 division of two integer sums; 0.0 when the denominator is 0.

    Each sum becomes a float64 first, then one division: the same two roundings
    as SQL `CAST(a AS DOUBLE PRECISION) / CAST(b AS DOUBLE PRECISION)`, so the
    analytics views agree with this code exactly (true int division would not
    once sums pass 2**53).
    """
    if denominator == 0:
        return 0.0
    return float(numerator) / float(denominator)


@dataclass(frozen=True)
class SpecInfo:
    """The four counters: one turn's as read (legacy names resolved, before the
    guard), or integer sums of many. Rates exist only after summing."""

    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0
    spec_verify_ct: int = 0
    completion_tokens: int = 0

    @property
    def contributes(self) -> bool:
        """A turn without verification steps was not decoded speculatively: counting
        its completion tokens would dilute the accept length, so it adds nothing."""
        return self.spec_verify_ct > 0

    def __add__(self, other: SpecInfo) -> SpecInfo:
        return SpecInfo(*(getattr(self, key) + getattr(other, key) for key in SPEC_INFO_KEYS))

    def as_dict(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in SPEC_INFO_KEYS}

    def columns(self) -> dict[str, int]:
        """The counters as table columns (`spec_correct`, …)."""
        return {SPEC_INFO_COLUMNS[key]: getattr(self, key) for key in SPEC_INFO_KEYS}

    @classmethod
    def from_dict(cls, counters: Mapping[Any, Any]) -> SpecInfo:
        """Inverse of `as_dict` (a carrier or sample `spec_info`, an analytics row)."""
        return cls(*(int(counters[key]) for key in SPEC_INFO_KEYS))

    @classmethod
    def from_columns(cls, row: Mapping[Any, Any]) -> SpecInfo:
        """Inverse of `columns` (a `nodes`, `samples` or `sessions` row)."""
        return cls(*(int(row[SPEC_INFO_COLUMNS[key]]) for key in SPEC_INFO_KEYS))

    @property
    def accept_rate(self) -> float:
        return ratio(self.spec_num_correct_drafts, self.spec_num_proposed_drafts)

    @property
    def accept_length(self) -> float:
        return ratio(self.completion_tokens, self.spec_verify_ct)


assert tuple(f.name for f in fields(SpecInfo)) == SPEC_INFO_KEYS


def sum_turns(turns: Iterable[SpecInfo]) -> SpecInfo:
    """The guarded sum: turns that do not contribute add nothing."""
    # Plain integer sums, one object at the end: every append sums all of a
    # session's nodes for its carrier, so this loop is on the write path.
    correct = proposed = verify = completion = 0
    for turn in turns:
        if turn.contributes:
            correct += turn.spec_num_correct_drafts
            proposed += turn.spec_num_proposed_drafts
            verify += turn.spec_verify_ct
            completion += turn.completion_tokens
    return SpecInfo(correct, proposed, verify, completion)
