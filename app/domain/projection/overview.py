"""What the UI's overviews compute over samples: per-session summaries, the list's
sort and filters, off-policy lag, reward distributions and TITO mismatch lists.

Owns the rules of these read-only summaries: a session's reward (its samples'
numeric rewards: the value when they agree, else their mean), its sample
count, mean response length and sample statuses; the session list's view
parameters (`sort`, `reward_min`, `reward_max`, `sample_status`: parsed here,
bad values a 422 naming the parameter); a sample's off-policy lag (the
newest integer weight version seen in its run minus the oldest of the
sample's own versions; unknown when any is not an integer); the reward
distribution per weight version (a sample counts under its last turn's
version); and a TITO mismatch report as readable lines. Refuses I/O and
HTML: the store reads the rows, `app/ui/` draws them. Pure.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.domain.errors import InvalidRequest
from app.domain.projection.samples_merge import ABORTED, COMPLETED, PENDING, TRUNCATED
from app.domain.wire import jsonio
from app.domain.wire.validate import describe, finite_mean

SAMPLE_STATUSES = (COMPLETED, TRUNCATED, ABORTED, PENDING)
SORTS = ("", "reward", "-reward", "response", "-response", "samples", "-samples")
HISTOGRAM_BINS = 10


def reward_number(value: Any) -> float | None:
    """A reward as a number: JSON numbers a finite float64 holds (booleans, text and an
    integer of 400 digits — a close's metadata is free JSON — are not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


@dataclass(frozen=True)
class SampleFacts:
    """One sample row as the overviews need it."""

    reward: Any
    response_length: int
    status: str


@dataclass(frozen=True)
class SessionOverview:
    samples: int = 0
    reward: float | None = None
    response_length: float | None = None  # mean over the samples
    statuses: dict[str, int] = field(default_factory=dict)

    @property
    def status_text(self) -> str:
        """`completed` when all agree, else `completed 3 · truncated 1`."""
        if len(self.statuses) == 1:
            return next(iter(self.statuses))
        return " · ".join(f"{status} {n}" for status, n in sorted(self.statuses.items()))


def session_overview(rows: Sequence[SampleFacts]) -> SessionOverview:
    if not rows:
        return SessionOverview()
    rewards = [r for r in (reward_number(row.reward) for row in rows) if r is not None]
    reward = None
    if rewards:
        reward = rewards[0] if len(set(rewards)) == 1 else math.fsum(rewards) / len(rewards)
    return SessionOverview(
        samples=len(rows), reward=reward,
        response_length=math.fsum(row.response_length for row in rows) / len(rows),
        statuses=dict(Counter(row.status for row in rows)))


@dataclass(frozen=True)
class ListView:
    """The session list's sort and filters beyond status and labels."""

    sort: str = ""
    reward_min: float | None = None
    reward_max: float | None = None
    sample_status: str | None = None

    @property
    def active(self) -> bool:
        return bool(self.sort or self.filtering)

    @property
    def filtering(self) -> bool:
        return (self.reward_min is not None or self.reward_max is not None
                or self.sample_status is not None)

    def keeps(self, overview: SessionOverview) -> bool:
        if self.reward_min is not None or self.reward_max is not None:
            if overview.reward is None:
                return False
            if self.reward_min is not None and overview.reward < self.reward_min:
                return False
            if self.reward_max is not None and overview.reward > self.reward_max:
                return False
        return self.sample_status is None or self.sample_status in overview.statuses

    def order(self, items: list[tuple[Any, SessionOverview]]) -> list[tuple[Any, SessionOverview]]:
        """Kept items, sorted by the chosen column (stable: newest first among equals;
        a session without the value goes last either way)."""
        kept = [item for item in items if self.keeps(item[1])]
        if not self.sort:
            return kept
        name = self.sort.lstrip("-")
        descending = self.sort.startswith("-")

        def value(overview: SessionOverview) -> float | None:
            if name == "reward":
                return overview.reward
            if name == "response":
                return overview.response_length
            return float(overview.samples) if overview.samples else None

        known = [item for item in kept if value(item[1]) is not None]
        unknown = [item for item in kept if value(item[1]) is None]
        known.sort(key=lambda item: value(item[1]) or 0.0, reverse=descending)
        return known + unknown


# A number as typed in a filter box: decimal digits, a point, an exponent. Python's
# float() also reads `1_0`, `infinity` and non-ASCII digits, which no filter means.
_DECIMAL = re.compile(r"\s*[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*")


def _bound(text: str | None, name: str) -> float | None:
    if text is None or not text.strip():
        return None
    number = float(text) if _DECIMAL.fullmatch(text) else math.nan
    if not math.isfinite(number):
        raise InvalidRequest(f"{name} must be a number", field=name, expected="finite number",
                             actual=describe(text))
    return number


def parse_list_view(sort: str | None, reward_min: str | None, reward_max: str | None,
                    sample_status: str | None) -> ListView:
    """The list's view parameters; blank = absent (the filter form sends blanks)."""
    sort = (sort or "").strip()
    if sort not in SORTS:
        raise InvalidRequest("sort must name a column", field="sort",
                             expected=" | ".join(repr(s) for s in SORTS if s),
                             actual=describe(sort))
    status = (sample_status or "").strip() or None
    if status is not None and status not in SAMPLE_STATUSES:
        raise InvalidRequest("sample_status must be a sample status", field="sample_status",
                             expected=" | ".join(SAMPLE_STATUSES), actual=describe(status))
    return ListView(sort=sort, reward_min=_bound(reward_min, "reward_min"),
                    reward_max=_bound(reward_max, "reward_max"), sample_status=status)


def integer_version(value: Any) -> int | None:
    """A weight version as an integer: JSON integers and decimal-integer strings."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def newest_version(versions: Iterable[Any]) -> int | None:
    """The newest (largest) integer weight version among `versions`; None without any."""
    known = [v for v in (integer_version(x) for x in versions) if v is not None]
    return max(known, default=None)


def off_policy_lag(weight_versions: Sequence[Any], newest: int | None) -> int | None:
    """How many versions the sample's oldest turn is behind the run's newest; None when
    it cannot be told (no versions, or one that is not an integer)."""
    versions = [integer_version(v) for v in weight_versions]
    if newest is None or not versions or any(v is None for v in versions):
        return None
    return max(0, newest - min(v for v in versions if v is not None))


@dataclass(frozen=True)
class RewardGroup:
    """The rewards of the samples whose last turn ran on one weight version."""

    weight_version: str | None
    count: int
    mean: float
    minimum: float
    maximum: float
    histogram: list[int]  # HISTOGRAM_BINS counts over the shared [low, high] range


@dataclass(frozen=True)
class RewardDistribution:
    low: float
    high: float
    groups: list[RewardGroup]
    unrewarded: int  # samples without a numeric reward


def version_text(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else jsonio.canonical(value)


def _version_key(text: str | None) -> tuple[int, int, str]:
    number = integer_version(text)
    return (0 if text is None else 1, 0 if number is None else 1,
            "" if text is None else (f"{number:020d}" if number is not None else text))


def reward_distribution(samples: Iterable[tuple[Sequence[Any], Any]],
                        bins: int = HISTOGRAM_BINS) -> RewardDistribution:
    """`(weight_versions, reward)` per sample → one group per last weight version, in
    version order (integers numerically), histograms over one shared range."""
    by_version: dict[str | None, list[float]] = {}
    unrewarded = 0
    for versions, raw in samples:
        reward = reward_number(raw)
        if reward is None:
            unrewarded += 1
            continue
        key = version_text(versions[-1]) if versions else None
        by_version.setdefault(key, []).append(reward)
    every = [r for rewards in by_version.values() for r in rewards]
    low, high = (min(every), max(every)) if every else (0.0, 1.0)
    width = (high - low) / bins if high > low else 1.0
    if not math.isfinite(width):  # rewards near ±1.8e308: the range itself overflows
        width = high / bins - low / bins
    groups = []
    for key in sorted(by_version, key=_version_key):
        rewards = by_version[key]
        histogram = [0] * bins
        for r in rewards:
            histogram[_bin(r, low, high, width, bins) if high > low else 0] += 1
        groups.append(RewardGroup(key, len(rewards), finite_mean(rewards), min(rewards),
                                  max(rewards), histogram))
    return RewardDistribution(low, high, groups, unrewarded)


def _bin(reward: float, low: float, high: float, width: float, bins: int) -> int:
    # A range of a few subnormals (5e-324 wide) has bins that underflow to 0 wide.
    position = (reward - low) / (high - low) * bins if width == 0.0 else (reward - low) / width
    if not math.isfinite(position):
        position = reward / width - low / width
    return min(max(int(position), 0), bins - 1) if math.isfinite(position) else bins - 1


def mismatch_lines(report: Any) -> list[str]:
    """A `tito_session_mismatch` report as one readable line per entry:
    `assistant_text at segment 1 (expected …, actual …)`."""
    if report is None:
        return []
    entries = report if isinstance(report, list) else [report]
    lines = []
    for entry in entries:
        if not isinstance(entry, Mapping):
            lines.append(version_text(entry) or "null")
            continue
        kind = str(entry.get("type", "mismatch"))
        where = [f"{name.replace('_', ' ')} {version_text(entry[name])}"
                 for name in ("segment_index", "message_index", "token_index", "position")
                 if name in entry]
        rest = [f"{name}: {_short(entry[name])}" for name in entry
                if name not in ("type", "segment_index", "message_index", "token_index",
                                "position")]
        line = kind + (" at " + ", ".join(where) if where else "")
        lines.append(line + (f" ({'; '.join(rest)})" if rest else ""))
    return lines


def _short(value: Any, limit: int = 120) -> str:
    text = "null" if value is None else version_text(value) or '""'
    return text if len(text) <= limit else text[: limit - 1] + "…"
