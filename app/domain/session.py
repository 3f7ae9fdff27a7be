"""The session definition: parsing and normalizing the open and close bodies.

Owns the rules of CONTRACT §1 for `POST /v1/sessions` and `POST …/close`:
allowed values, defaults, the derived `use_addition_r3`. The normalized body
is what the `session_opened` event stores and what an idempotent repeat is
compared against. Pure: no I/O, no clock except the id generator.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from app.domain.errors import InvalidRequest

# Anchored with \Z and used with fullmatch: `$` also matches before a trailing "\n".
SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}\Z")
LABEL_KEY_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}\Z")
OPEN_FIELDS = frozenset(
    {"session_id", "version", "pause_generation_mode", "r3", "spec", "max_trim_tokens", "labels"}
)
CLOSE_FIELDS = frozenset({"max_seq_len", "metadata"})
MAX_LAYERS = 4096
MAX_TRIM = 1 << 20


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def describe(value: Any) -> Any:
    """A short `actual` for problem bodies: scalars as-is, containers by type."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value if len(value) <= 80 else value[:77] + "..."
    return _type_name(value)


def require_object(value: Any, field_name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"{field_name} must be a JSON object",
            field=field_name,
            expected="object",
            actual=_type_name(value),
        )
    return value


def reject_unknown(body: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        name = unknown[0] if not where else f"{where}.{unknown[0]}"
        raise InvalidRequest(
            f"unknown field {name!r}",
            field=name,
            expected=f"one of {sorted(allowed)}",
            actual=unknown[0],
        )


TEXT_MAX = 1024


def is_text_safe(value: str) -> bool:
    """Storable as database text on every backend: no NUL, encodable as UTF-8."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def require_text(value: str, field_name: str, max_len: int = TEXT_MAX) -> str:
    if len(value) > max_len or not is_text_safe(value):
        raise InvalidRequest(
            f"{field_name} must be text of at most {max_len} characters without NUL or "
            "unpaired surrogates",
            field=field_name, expected=f"UTF-8 text, at most {max_len} characters",
            actual=describe(value),
        )
    return value


def validate_session_id(value: Any, field_name: str = "session_id") -> str:
    if not isinstance(value, str) or not SESSION_ID_RE.fullmatch(value):
        raise InvalidRequest(
            "session id must be 1-128 characters of [A-Za-z0-9._:-]",
            field=field_name,
            expected="[A-Za-z0-9._:-]{1,128}",
            actual=describe(value),
        )
    return value


def label_text(value: Any) -> str:
    """A label value as filters see it: JSON text, strings without quotes."""
    from app.domain.jsonio import canonical

    return value if isinstance(value, str) else canonical(value)


def uses_addition_r3(pause_generation_mode: str) -> bool:
    """Addition (append-only patch) R3 iff weights are updated in place."""
    return pause_generation_mode == "in_place"


@dataclass(frozen=True)
class SessionSpec:
    session_id: str
    version: str
    pause_generation_mode: str
    num_layers: int | None
    spec: bool
    max_trim_tokens: int
    labels: dict[str, Any] = field(default_factory=dict)

    @property
    def use_addition_r3(self) -> bool:
        return uses_addition_r3(self.pause_generation_mode)

    @property
    def has_r3(self) -> bool:
        return self.num_layers is not None

    def body(self) -> dict[str, Any]:
        """The open body with defaults filled in (what `session_opened` stores)."""
        return {
            "session_id": self.session_id,
            "version": self.version,
            "pause_generation_mode": self.pause_generation_mode,
            "r3": None if self.num_layers is None else {"num_layers": self.num_layers},
            "spec": self.spec,
            "max_trim_tokens": self.max_trim_tokens,
            "labels": self.labels,
        }

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> SessionSpec:
        """Rebuild from a stored, already normalized body."""
        r3 = body.get("r3")
        return cls(
            session_id=body["session_id"],
            version=body["version"],
            pause_generation_mode=body["pause_generation_mode"],
            num_layers=None if r3 is None else int(r3["num_layers"]),
            spec=bool(body["spec"]),
            max_trim_tokens=int(body["max_trim_tokens"]),
            labels=dict(body.get("labels") or {}),
        )


def parse_open(raw: Any) -> SessionSpec:
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
            + (" (abort cannot be used with a session server)" if mode == "abort" else ""),
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

    spec = body.get("spec")
    spec = False if spec is None else spec
    if not isinstance(spec, bool):
        raise InvalidRequest("spec must be a boolean", field="spec", expected="boolean",
                             actual=describe(spec))

    trim = body.get("max_trim_tokens")
    trim = 0 if trim is None else trim
    if not is_int(trim) or not 0 <= trim <= MAX_TRIM:
        raise InvalidRequest("max_trim_tokens must be a non-negative integer",
                             field="max_trim_tokens", expected=f"integer in [0, {MAX_TRIM}]",
                             actual=describe(trim))

    labels_raw = body.get("labels")
    labels = {} if labels_raw is None else require_object(labels_raw, "labels")
    for key, value in labels.items():
        if not LABEL_KEY_RE.fullmatch(key):
            raise InvalidRequest("label names must be 1-64 characters of [A-Za-z0-9._:-]",
                                 field=f"labels.{key}", expected="[A-Za-z0-9._:-]{1,64}",
                                 actual=describe(key))
        require_text(label_text(value), f"labels.{key}")

    return SessionSpec(
        session_id=session_id,
        version=version,
        pause_generation_mode=mode,
        num_layers=num_layers,
        spec=spec,
        max_trim_tokens=trim,
        labels=labels,
    )


@dataclass(frozen=True)
class CloseSpec:
    max_seq_len: int | None
    metadata: dict[str, Any]

    def body(self) -> dict[str, Any]:
        return {"max_seq_len": self.max_seq_len, "metadata": self.metadata}

    @property
    def reward(self) -> Any:
        return self.metadata.get("reward")


def parse_close(raw: Any) -> CloseSpec:
    body = require_object(raw, "body")
    reject_unknown(body, CLOSE_FIELDS, "")
    max_seq_len = body.get("max_seq_len")
    if max_seq_len is not None and (not is_int(max_seq_len) or max_seq_len < 1):
        raise InvalidRequest("max_seq_len must be a positive integer or null",
                             field="max_seq_len", expected="positive integer | null",
                             actual=describe(max_seq_len))
    metadata = body.get("metadata")
    metadata = {} if metadata is None else require_object(metadata, "metadata")
    return CloseSpec(max_seq_len=max_seq_len, metadata=metadata)
