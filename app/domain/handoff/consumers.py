"""Consumer groups: the rules of the exactly-once hand-off of closed sessions to trainers.

Owns parsing the group definition, claim, ack and release bodies (limits,
defaults, the group and claim id patterns), which sessions a group consumes
(label matching), which of a group's sessions a claim may take (neither
acknowledged nor held under a live lease, oldest close first; with
`require_reward`, only sessions whose samples all have a reward) and the ack
verdict (a late ack wins only when nobody else acknowledged or holds the
session). Pure: the store locks rows, reads the clock and persists; every
decision it takes about a session's hand-off is a function here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.domain.body.labels import label_text
from app.domain.errors import InvalidRequest, LeaseLost, UnknownConsumer
from app.domain.wire.validate import (
    LABEL_KEY,
    SESSION_ID,
    describe,
    is_int,
    reject_unknown,
    require_bool,
    require_object,
    require_text,
)

GROUP_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # matched in full (`is_group_name`)
# URL path segments every client and proxy resolves away: no request can name them.
DOT_SEGMENTS = frozenset({".", ".."})
FROM_BEGINNING = "beginning"
FROM_NOW = "now"
GROUP_FIELDS = frozenset({"labels", "from", "require_reward"})
CLAIM_FIELDS = frozenset({"claim_id", "limit", "lease_seconds", "wait"})
ACK_FIELDS = frozenset({"sessions", "step"})
RELEASE_FIELDS = frozenset({"sessions"})
MAX_CLAIM = 1000
MAX_LEASE_SECONDS = 86_400
MAX_WAIT_SECONDS = 30.0
DEFAULT_LEASE_SECONDS = 600
MAX_STEP = 2**63 - 1


@dataclass(frozen=True)
class GroupSpec:
    group: str
    labels: dict[str, Any]
    start: str  # "beginning" | "now" (the body's `from`)
    # Offer a session only once every one of its samples has a reward.
    require_reward: bool = False

    def body(self) -> dict[str, Any]:
        """The definition as compared by a repeated PUT (defaults filled in).

        `require_reward` appears only when true, so a group defined before the
        field existed keeps its fingerprint."""
        body: dict[str, Any] = {"labels": self.labels, "from": self.start}
        if self.require_reward:
            body["require_reward"] = True
        return body

    def label_texts(self) -> dict[str, str]:
        return label_texts(self.labels)


@dataclass(frozen=True)
class ClaimRequest:
    claim_id: str
    limit: int
    lease_seconds: int
    wait: float


@dataclass(frozen=True)
class AckRequest:
    sessions: list[str] | None  # None: all of the claim
    step: int | None


@dataclass(frozen=True)
class Holding:
    """Where one session of a group stands: who holds it, until when, and whether
    (and by which claim) it was acknowledged."""

    session_id: str
    claim_id: str | None
    expires_us: int | None
    acked: bool

    def live(self, now_us: int) -> bool:
        """Held under a lease that has not expired."""
        return self.claim_id is not None and self.expires_us is not None \
            and self.expires_us > now_us


def label_texts(labels: Mapping[str, Any]) -> dict[str, str]:
    """Labels as the session label index stores them (strings unquoted)."""
    return {key: label_text(value) for key, value in labels.items()}


def is_group_name(group: str) -> bool:
    return GROUP_RE.fullmatch(group) is not None and group not in DOT_SEGMENTS


def validate_group(group: str) -> str:
    if not is_group_name(group):
        raise InvalidRequest("consumer group names are 1-64 characters of [A-Za-z0-9._:-], "
                             'other than "." and ".."', field="group",
                             expected='[A-Za-z0-9._:-]{1,64}, not "." or ".."',
                             actual=describe(group))
    return group


def known_group(group: str) -> str:
    """A group name outside the pattern names no group: 404, as one never created."""
    if not is_group_name(group):
        raise UnknownConsumer(f"no consumer group {describe(group)!r}", field="group",
                              expected="an existing consumer group", actual=describe(group))
    return group


def parse_group(group: str, raw: Any) -> GroupSpec:
    validate_group(group)
    body = require_object(raw, "body")
    reject_unknown(body, GROUP_FIELDS, "")
    labels = require_object(body.get("labels", {}), "labels")
    for key, value in labels.items():
        if not LABEL_KEY.matches(key):
            raise InvalidRequest("label names are 1-64 characters of [A-Za-z0-9._:-]",
                                 field=f"labels.{describe(key)}",
                                 expected="[A-Za-z0-9._:-]{1,64}", actual=describe(key))
        require_text(label_text(value), f"labels.{key}")
    start = body.get("from", FROM_BEGINNING)
    if start not in (FROM_BEGINNING, FROM_NOW):
        raise InvalidRequest('from must be "beginning" or "now"', field="from",
                             expected='"beginning" | "now"', actual=describe(start))
    require_reward = require_bool(body.get("require_reward", False), "require_reward")
    return GroupSpec(group=group, labels=dict(labels), start=start,
                     require_reward=require_reward)


def offered(require_reward: bool, rewarded: bool) -> bool:
    """Whether a closed session goes to a group now: a group that requires rewards
    waits until every sample of the session has one (`rewarded`)."""
    return rewarded or not require_reward


def enqueued_late(start: str, created_us: int, closed_us: int) -> bool:
    """Whether a `require_reward` group takes a session that became rewarded only
    after its close: it does if it consumes every close (`beginning`) or existed
    when the session closed (`now`)."""
    return start == FROM_BEGINNING or created_us <= closed_us


def _int_in(body: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name, default)
    if not is_int(value) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer in [{low}, {high}]", field=name,
                             expected=f"integer in [{low}, {high}]", actual=describe(value))
    return value


def claim_id_of(raw: Any) -> str | None:
    """The well-formed `claim_id` of a claim body, if it has one: a repeated claim_id
    answers its original claim whatever the rest of the new body says."""
    claim_id = raw.get("claim_id") if isinstance(raw, dict) else None
    return claim_id if isinstance(claim_id, str) and SESSION_ID.matches(claim_id) else None


def parse_claim(raw: Any) -> ClaimRequest:
    body = require_object(raw, "body")
    reject_unknown(body, CLAIM_FIELDS, "")
    claim_id = body.get("claim_id")
    if not isinstance(claim_id, str) or not SESSION_ID.matches(claim_id):
        raise InvalidRequest("claim_id is required: 1-128 characters of [A-Za-z0-9._:-]",
                             field="claim_id", expected="[A-Za-z0-9._:-]{1,128}",
                             actual=describe(claim_id))
    wait = body.get("wait", 0)
    if isinstance(wait, bool) or not isinstance(wait, int | float) \
            or not 0 <= wait <= MAX_WAIT_SECONDS:
        raise InvalidRequest(f"wait must be a number of seconds in [0, {MAX_WAIT_SECONDS:g}]",
                             field="wait", expected=f"number in [0, {MAX_WAIT_SECONDS:g}]",
                             actual=describe(wait))
    return ClaimRequest(
        claim_id=claim_id,
        limit=_int_in(body, "limit", 1, 1, MAX_CLAIM),
        lease_seconds=_int_in(body, "lease_seconds", DEFAULT_LEASE_SECONDS, 1,
                              MAX_LEASE_SECONDS),
        wait=float(wait),
    )


def _session_list(body: Mapping[str, Any]) -> list[str] | None:
    value = body.get("sessions")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequest("sessions must be a list of session ids", field="sessions",
                             expected="array of strings", actual=describe(value))
    # A session named twice is acknowledged (or released) once.
    return list(dict.fromkeys(value))


def parse_ack(raw: Any) -> AckRequest:
    body = require_object(raw, "body")
    reject_unknown(body, ACK_FIELDS, "")
    step = body.get("step")
    if step is not None and (not is_int(step) or not 0 <= step <= MAX_STEP):
        raise InvalidRequest("step must be a non-negative 64-bit integer or null",
                             field="step", expected=f"integer in [0, {MAX_STEP}] | null",
                             actual=describe(step))
    return AckRequest(sessions=_session_list(body), step=step)


def parse_release(raw: Any) -> list[str] | None:
    body = require_object(raw, "body")
    reject_unknown(body, RELEASE_FIELDS, "")
    return _session_list(body)


def matches(group_labels: Mapping[str, str], session_labels: Mapping[str, Any]) -> bool:
    """A session belongs to a group when every group label equals the session's,
    both written as label text (the label filters' matching; `{}` matches all)."""
    return all(key in session_labels and label_text(session_labels[key]) == text
               for key, text in group_labels.items())


def requested(claimed: Sequence[str], wanted: list[str] | None, field: str = "sessions"
              ) -> list[str]:
    """The sessions an ack or release names: all of the claim by default; a session
    the claim never held is the client's mistake (422)."""
    if wanted is None:
        return list(claimed)
    held = set(claimed)
    strangers = [sid for sid in wanted if sid not in held]
    if strangers:
        raise InvalidRequest(f"{len(strangers)} session(s) are not in this claim",
                             field=field, expected="sessions of this claim",
                             actual=strangers[:10])
    return wanted


def claimable(holding: Holding, now_us: int) -> bool:
    """Neither acknowledged nor held under a live lease."""
    return not holding.acked and not holding.live(now_us)


def ack_verdict(claim_id: str, holdings: Iterable[Holding], acked_by: Mapping[str, str],
                now_us: int) -> list[str]:
    """The sessions of this ack that are not already this claim's: raises `LeaseLost`
    (nothing acknowledged) if another claim acknowledged one or holds it under a
    live lease. `acked_by` maps acknowledged sessions to the claim that did it."""
    fresh: list[str] = []
    lost: list[str] = []
    for holding in holdings:
        if holding.acked:
            if acked_by.get(holding.session_id) != claim_id:
                lost.append(holding.session_id)
        elif holding.claim_id != claim_id and holding.live(now_us):
            lost.append(holding.session_id)
        else:
            fresh.append(holding.session_id)
    if lost:
        raise LeaseLost(f"{len(lost)} session(s) were acknowledged or re-claimed by another "
                        "claim; nothing was acknowledged", field="sessions",
                        expected=f"sessions claim {claim_id!r} still owns",
                        actual=lost[:100], extra={"sessions": lost})
    return fresh


def parse_step_filter(step: int | None) -> int | None:
    """`GET …/acks?step=`: a training step, or none for every step."""
    if step is not None and not 0 <= step <= MAX_STEP:
        raise InvalidRequest("step must be a non-negative integer", field="step",
                             expected=f"integer in [0, {MAX_STEP}]", actual=step)
    return step
