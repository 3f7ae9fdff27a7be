"""Rollout metrics over a set of closed sessions: `GET /v1/metrics/rollout`.

Owns the numbers of docs/api.md §4 and §5.2 for a set of sessions: the TITO
mismatch rates per session-server version (`rollout/tito_session_mismatch_rate/{v}`
and `/{v}/{type}`; only samples that sent the key count; v1 and v2 never
share a key), the strict check of `strict=true`, summing the sessions'
SpecInfo carriers (one per session) and the response-length and truncation
statistics of the samples.

Every rate is a ratio of integer sums computed once at the end, as float64
division, so SQL views (`CAST(SUM(x) AS DOUBLE PRECISION) / COUNT(*)`) can
match it exactly. Refuses to own: the accept-rate rule itself
(`specinfo.py`), choosing the sessions (label filters, closed status) and
reading rows — the store feeds plain `SessionRow`s. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.domain.body.specinfo import SpecInfo, ratio
from app.domain.body.turn import MISMATCH_TYPES
from app.domain.errors import StrictTito

TITO_PREFIX = "rollout/tito_session_mismatch_rate"
STRICT_TYPES = ("special_token_count", "special_token_type", "non_assistant_text")
SPEC_ACCEPT_RATE = "rollout/spec_accept_rate"
SPEC_ACCEPT_LENGTH = "rollout/spec_accept_length"
RESPONSE_LEN = "rollout/response_len"
TRUNCATED_RATIO = "rollout/truncated_ratio"

Mismatch = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class SampleRow:
    """What the metrics need of one sample; `mismatch` None = the leaf turn sent no key."""

    response_length: int
    status: str
    mismatch: Mismatch | None = None


@dataclass(frozen=True)
class SessionRow:
    """One closed session; `carrier` (its `session_metrics` spec_info, e.g.
    `SpecInfo.from_dict`) is None when the session was opened without `spec`."""

    session_id: str
    version: str
    samples: Sequence[SampleRow] = field(default_factory=tuple)
    carrier: SpecInfo | None = None


def tito_key(version: str, mismatch_type: str | None = None) -> str:
    base = f"{TITO_PREFIX}/{version}"
    return base if mismatch_type is None else f"{base}/{mismatch_type}"


def tito_rates(samples: Iterable[tuple[str, Mismatch | None]]) -> dict[str, float]:
    """Mismatch rates per version over the samples that sent `tito_session_mismatch`.

    `samples` are `(session version, mismatch list or None)`. A version gets
    keys only if one of its samples sent the list: the overall rate (a
    non-empty list) and one per type (at least one entry of it), for all
    four types. Keys are grouped by version, in sorted version order.
    """
    sent: dict[str, int] = {}
    nonempty: dict[str, int] = {}
    typed: dict[str, dict[str, int]] = {}
    for version, mismatch in samples:
        if mismatch is None:
            continue
        sent[version] = sent.get(version, 0) + 1
        counts = typed.setdefault(version, dict.fromkeys(MISMATCH_TYPES, 0))
        if mismatch:
            nonempty[version] = nonempty.get(version, 0) + 1
        for kind in {entry.get("type") for entry in mismatch}:
            if kind in counts:
                counts[kind] += 1
    rates: dict[str, float] = {}
    for version in sorted(sent):
        rates[tito_key(version)] = ratio(nonempty.get(version, 0), sent[version])
        for kind in MISMATCH_TYPES:
            rates[tito_key(version, kind)] = ratio(typed[version][kind], sent[version])
    return rates


def strict_violations(rates: Mapping[str, Any]) -> list[tuple[str, float]]:
    """The strict-type TITO keys (any version) with a non-zero rate, in key order."""
    prefix = f"{TITO_PREFIX}/"
    return [
        (key, float(rate))
        for key, rate in sorted(rates.items())
        if key.startswith(prefix)
        and key[len(prefix):].partition("/")[2] in STRICT_TYPES
        and rate != 0
    ]


def check_strict(rates: Mapping[str, Any]) -> None:
    """`strict=true`: raise `StrictTito` (409) naming every strict key with a non-zero rate."""
    violations = strict_violations(rates)
    if not violations:
        return
    key, rate = violations[0]
    named = ", ".join(f"{k} = {r!r}" for k, r in violations)
    raise StrictTito(
        f"strict TITO mismatch rates must be 0: {named}",
        field=key,
        expected=0.0,
        actual=rate,
        extra={"violations": [{"key": k, "rate": r} for k, r in violations]},
    )


def spec_rates(carriers: Iterable[SpecInfo]) -> dict[str, float]:
    """Accept rate and length from carriers (one per session): summed first, then divided."""
    total = sum(carriers, SpecInfo())
    return {SPEC_ACCEPT_RATE: total.accept_rate, SPEC_ACCEPT_LENGTH: total.accept_length}


def rollout_metrics(sessions: Iterable[SessionRow]) -> dict[str, float | int]:
    """The `GET /v1/metrics/rollout` body for these sessions (strictness is `check_strict`'s).

    `sessions`/`samples` always; spec keys only if some session has a
    carrier; TITO keys only for versions present (see `tito_rates`);
    `rollout/response_len/{mean,max,min}` and `rollout/truncated_ratio`
    always, 0.0 over no samples (docs/api.md §5.2 lists them unconditionally; a zero
    denominator gives 0.0 as everywhere else).
    A session id given twice is a caller bug (`ValueError`): carriers are
    counted once per session.
    """
    rows = list(sessions)
    ids = [row.session_id for row in rows]
    if len(set(ids)) != len(ids):
        raise ValueError("a session was given twice; carriers count once per session")
    samples = [(row.version, sample) for row in rows for sample in row.samples]
    out: dict[str, float | int] = {"sessions": len(rows), "samples": len(samples)}
    carriers = [row.carrier for row in rows if row.carrier is not None]
    if carriers:
        out.update(spec_rates(carriers))
    out.update(tito_rates((version, sample.mismatch) for version, sample in samples))
    lengths = [sample.response_length for _, sample in samples]
    truncated = sum(1 for _, sample in samples if sample.status == "truncated")
    out[f"{RESPONSE_LEN}/mean"] = ratio(sum(lengths), len(lengths))
    out[f"{RESPONSE_LEN}/max"] = float(max(lengths, default=0))
    out[f"{RESPONSE_LEN}/min"] = float(min(lengths, default=0))
    out[TRUNCATED_RATIO] = ratio(truncated, len(samples))
    return out
