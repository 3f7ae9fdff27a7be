"""The session definition: parsing and normalizing the open and close bodies.

Owns the rules of docs/api.md §1.1 and §1.6 for `POST /v1/sessions` and `POST …/close`:
allowed values, defaults, the derived `use_addition_r3`. The normalized body
is what the `session_opened` event stores and what an idempotent repeat is
compared against. Pure: no I/O, no clock except the id generator.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.domain.body.labels import parse_labels
from app.domain.errors import InvalidRequest, SessionConflict
from app.domain.wire.validate import (
    LABEL_KEY,
    SESSION_ID,
    describe,
    is_int,
    reject_unknown,
    require_bool,
    require_object,
)

OPEN_FIELDS = frozenset(
    {"session_id", "version", "pause_generation_mode", "r3", "spec", "max_trim_tokens", "labels",
     "opened_by"}
)
CLOSE_FIELDS = frozenset({"max_seq_len", "metadata"})
MAX_LAYERS = 4096
MAX_TRIM = 1 << 20


def validate_session_id(value: Any, field_name: str = "session_id") -> str:
    return SESSION_ID.require(value, field_name, "session id")


def uses_addition_r3(pause_generation_mode: str) -> bool:
    """Addition (append-only patch) R3 iff weights are updated in place."""
    return pause_generation_mode == "in_place"


@dataclass(frozen=True)
class SessionDefinition:
    session_id: str
    version: str
    pause_generation_mode: str
    num_layers: int | None
    speculative: bool  # wire name `spec`: the session runs speculative decoding
    max_trim_tokens: int
    labels: dict[str, Any] = field(default_factory=dict)
    # Who opened the session when it says so (the recording gateway: "gateway"); None otherwise.
    opened_by: str | None = None

    @property
    def use_addition_r3(self) -> bool:
        return uses_addition_r3(self.pause_generation_mode)

    @property
    def has_r3(self) -> bool:
        return self.num_layers is not None

    def body(self) -> dict[str, Any]:
        """The open body with defaults filled in (what `session_opened` stores).

        `opened_by` appears only when it was sent: a session opened without it keeps
        the body (and so the fingerprint an idempotent repeat is compared against)
        it had before the field existed.
        """
        body: dict[str, Any] = {
            "session_id": self.session_id,
            "version": self.version,
            "pause_generation_mode": self.pause_generation_mode,
            "r3": None if self.num_layers is None else {"num_layers": self.num_layers},
            "spec": self.speculative,
            "max_trim_tokens": self.max_trim_tokens,
            "labels": self.labels,
        }
        if self.opened_by is not None:
            body["opened_by"] = self.opened_by
        return body

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> SessionDefinition:
        """Rebuild from a stored, already normalized body."""
        r3 = body.get("r3")
        return cls(
            session_id=body["session_id"],
            version=body["version"],
            pause_generation_mode=body["pause_generation_mode"],
            num_layers=None if r3 is None else int(r3["num_layers"]),
            speculative=bool(body["spec"]),
            max_trim_tokens=int(body["max_trim_tokens"]),
            labels=dict(body.get("labels") or {}),
            opened_by=body.get("opened_by"),
        )


def parse_open(raw: Any) -> SessionDefinition:
    body = require_object(raw, "body")
    reject_unknown(body, OPEN_FIELDS, "")

    sid = body.get("session_id")
    session_id = uuid.uuid4().hex if sid is None else validate_session_id(sid)

    if "version" not in body:
        raise InvalidRequest("version is required", field="version",
                             expected='"v1" | "v2"', actual=None)
    version_raw = body["version"]
    if version_raw is True:
        version = "v1"
    elif version_raw in ("v1", "v2"):
        version = str(version_raw)
    else:
        raise InvalidRequest("version must be \"v1\" or \"v2\"", field="version",
                             expected='"v1" | "v2"', actual=describe(version_raw))

    mode = body.get("pause_generation_mode")
    mode = "retract" if mode is None else mode
    if mode not in ("retract", "in_place"):
        raise InvalidRequest(
            "pause_generation_mode must be \"retract\" or \"in_place\""
            + ("; for a generation paused with abort (miles then asks SGLang for addition "
               "R3, as with in_place) use \"in_place\"" if mode == "abort" else ""),
            field="pause_generation_mode",
            expected='"retract" | "in_place"',
            actual=describe(mode),
        )

    num_layers: int | None = None
    r3 = body.get("r3")
    if r3 is not None:
        r3 = require_object(r3, "r3")
        reject_unknown(r3, frozenset({"num_layers"}), "r3")
        layers = r3.get("num_layers")
        if not is_int(layers) or not 1 <= layers <= MAX_LAYERS:
            raise InvalidRequest("r3.num_layers must be a positive integer",
                                 field="r3.num_layers", expected=f"integer in [1, {MAX_LAYERS}]",
                                 actual=describe(layers))
        num_layers = layers

    speculative = body.get("spec")
    speculative = False if speculative is None else require_bool(speculative, "spec")

    trim = body.get("max_trim_tokens")
    trim = 0 if trim is None else trim
    if not is_int(trim) or not 0 <= trim <= MAX_TRIM:
        raise InvalidRequest("max_trim_tokens must be a non-negative integer",
                             field="max_trim_tokens", expected=f"integer in [0, {MAX_TRIM}]",
                             actual=describe(trim))

    labels = parse_labels(body.get("labels"))

    opened_by = body.get("opened_by")
    if opened_by is not None:
        opened_by = LABEL_KEY.require(opened_by, "opened_by", "opened_by")

    return SessionDefinition(
        session_id=session_id,
        version=version,
        pause_generation_mode=mode,
        num_layers=num_layers,
        speculative=speculative,
        max_trim_tokens=trim,
        labels=labels,
        opened_by=opened_by,
    )


@dataclass(frozen=True)
class SessionClose:
    max_seq_len: int | None
    metadata: dict[str, Any]

    def body(self) -> dict[str, Any]:
        return {"max_seq_len": self.max_seq_len, "metadata": self.metadata}

    @property
    def reward(self) -> Any:
        return self.metadata.get("reward")


def parse_close(raw: Any) -> SessionClose:
    body = require_object(raw, "body")
    reject_unknown(body, CLOSE_FIELDS, "")
    max_seq_len = body.get("max_seq_len")
    if max_seq_len is not None and (not is_int(max_seq_len) or max_seq_len < 1):
        raise InvalidRequest("max_seq_len must be a positive integer or null",
                             field="max_seq_len", expected="positive integer | null",
                             actual=describe(max_seq_len))
    metadata = body.get("metadata")
    metadata = {} if metadata is None else require_object(metadata, "metadata")
    return SessionClose(max_seq_len=max_seq_len, metadata=metadata)


def open_conflict(stored: SessionDefinition | None,
                  given: SessionDefinition) -> SessionConflict:
    """The 409 for an open whose session id is taken by another definition: it names
    the first field whose value differs (e.g. `labels.run_id`), the stored value as the
    one expected and the sent one as the actual (None: the stored one is not known)."""
    found = None if stored is None else _first_difference(stored.body(), given.body(), "")
    if found is None:  # equal as values, not as stored (e.g. a label's 1 and 1.0)
        return SessionConflict(
            f"session {given.session_id!r} exists with another definition",
            field="body", expected="the body the session was opened with",
            actual="a different body")
    path, was, sent = found
    return SessionConflict(
        f"session {given.session_id!r} exists with another definition: {path} is {was} "
        f"there, {sent} in this open", field=path, expected=was, actual=sent)


_ABSENT = object()
PLAIN_KEY = re.compile(r"[A-Za-z0-9_:-]+")  # a key a conflict's path names bare
SHOWN_MAX = 200  # characters of a value a conflict shows


def _first_difference(stored: Any, sent: Any, path: str) -> tuple[str, str, str] | None:
    """The first field (a path like `labels.run_id`) whose values differ, and the two
    values as JSON text (or `absent`)."""
    if isinstance(stored, dict) and isinstance(sent, dict):
        for key in [*stored, *(k for k in sent if k not in stored)]:
            name = str(key)
            child = (f"{path}.{name}" if path else name) if PLAIN_KEY.fullmatch(name) else \
                f"{path}[{json.dumps(name)}]"  # any other key: labels["a.b"]
            found = _first_difference(stored.get(key, _ABSENT), sent.get(key, _ABSENT), child)
            if found is not None:
                return found
        return None
    if isinstance(stored, list) and isinstance(sent, list) and len(stored) == len(sent):
        # Element by element: [1, 2] and [1, 2.0] are equal lists to Python, not to JSON.
        for index, (was, now) in enumerate(zip(stored, sent, strict=True)):
            found = _first_difference(was, now, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    if stored is _ABSENT or sent is _ABSENT or type(stored) is not type(sent) \
            or stored != sent:
        return path or "body", _json_text(stored), _json_text(sent)
    return None


def _json_text(value: Any) -> str:
    """A value as JSON text (`absent` where there is none), at most SHOWN_MAX characters:
    a conflict's `expected` and `actual`."""
    if value is _ABSENT:
        return "absent"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= SHOWN_MAX else text[:SHOWN_MAX - 1] + "…"
