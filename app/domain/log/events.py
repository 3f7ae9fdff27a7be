"""Event types and the lossless, non-redundant event codec.

A `turn_recorded` event keeps the record exactly as appended, split three ways
so that nothing grows with the sum of turn lengths:
- `request.input_ids` becomes (`prompt_lcp`, `prompt_delta`): the length of the
  prefix shared with the parent node's tokens and the int32 bytes beyond it;
- a non-empty `meta_info.routed_experts` becomes a narrowed R3 `Patch`;
- everything else stays JSON text.
`restore_record` is the exact inverse. No I/O here: the store persists the
parts, this module decides what they are.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from app.domain.body.session import SessionDefinition
from app.domain.body.turn import (
    OMITTED,
    TurnBody,
    TurnFacts,
    entries_to_write,
    parse_turn,
    stored_turn_facts,
)
from app.domain.log.tree import Attachment
from app.domain.wire import jsonio
from app.domain.wire.r3 import NarrowR3, Patch, narrow

SESSION_OPENED = "session_opened"
TURN_RECORDED = "turn_recorded"
SESSION_CLOSED = "session_closed"
# The session's stored R3 was freed by retention (`{"bytes": n}`); folds ignore it.
R3_PRUNED = "r3_pruned"
# A reward recorded after the close (`{"reward": <the body>}`, `event_id` set, no seq).
REWARD_RECORDED = "reward_recorded"
EVENT_TYPES = (SESSION_OPENED, TURN_RECORDED, SESSION_CLOSED, R3_PRUNED, REWARD_RECORDED)
TOKEN_DTYPE = np.dtype("<i4")


@dataclass(frozen=True)
class StoredTurn:
    """The parts of a `turn_recorded` event as they go to the database."""

    payload: str
    prompt_lcp: int
    prompt_delta: bytes
    patch: Patch | None


def _with_r3(record: dict[str, Any], r3_base64: str | bytes | None) -> dict[str, Any]:
    """Copy of `record` whose `response.choices[0].meta_info.routed_experts` is
    `r3_base64`, or absent for None; the rest is shared, not copied."""
    out = dict(record)
    response = dict(out["response"])
    choices = list(response["choices"])
    choice = dict(choices[0])
    meta = dict(choice["meta_info"])
    if r3_base64 is None:
        meta.pop("routed_experts", None)
    else:
        meta["routed_experts"] = r3_base64
    choice["meta_info"] = meta
    choices[0] = choice
    response["choices"] = choices
    out["response"] = response
    return out


def without_r3(record: dict[str, Any]) -> dict[str, Any]:
    """Copy of `record` without `meta_info.routed_experts` (whatever its value:
    a payload, `""` or null), as `GET …/events?include_r3=false` shows it."""
    return _with_r3(record, None)


def _strip(record: dict[str, Any], keep_r3: bool) -> dict[str, Any]:
    """Copy of `record` without `input_ids` (and the R3 payload unless `keep_r3`), for
    writing as JSON (packed output entries as tuples: `entries_to_write`)."""
    out = dict(record) if keep_r3 else without_r3(record)
    if keep_r3:  # a payload kept inline is empty; the narrowed wire's becomes its bytes
        with contextlib.suppress(KeyError, IndexError, TypeError):
            payload = out["response"]["choices"][0]["meta_info"]["routed_experts"]
            if isinstance(payload, NarrowR3):
                out = _with_r3(out, payload.int32())
    out = entries_to_write(out)
    request = dict(out["request"])
    request.pop("input_ids", None)
    out["request"] = request
    return out


def encode_turn(body: TurnBody, attachment: Attachment, num_layers: int | None) -> StoredTurn:
    return encode_prepared(body, attachment, prepare_turn(body, num_layers))


@dataclass(frozen=True)
class PreparedTurn:
    """What `encode_turn` computes before the turn's attachment is known: the R3
    patch and the payload's JSON text around the `parent` the attachment decides
    (`head` + `"parent":…` + `tail`; None when the payload needs the ASCII-escaped
    fallback of `jsonio.dumps`, written whole once the parent is known)."""

    patch: Patch | None
    head: str | None
    tail: str | None


def prepare_turn(body: TurnBody, num_layers: int | None) -> PreparedTurn:
    """The CPU-heavy part of `encode_turn` (narrowing R3, the record's JSON), which a
    large turn does on a worker thread along with its validation."""
    facts = body.facts
    patch: Patch | None = None
    if facts.r3_values is not None and facts.r3_start is not None:
        assert num_layers is not None and facts.topk is not None
        dtype, data = narrow(facts.r3_values)
        patch = Patch(start=facts.r3_start, end=facts.r3_end, num_layers=num_layers,
                      topk=facts.topk, dtype=dtype, data=data)
    rest: dict[str, Any] = {}
    if body.parent is not OMITTED:
        rest["parent_given"] = body.parent
    if body.metadata is not None:
        rest["metadata"] = body.metadata
    # msgspec writes a map as `{"key":value,...}`: the payload's text is its members'
    # texts joined, so the parts can be written now and the parent later.
    try:
        head = '{"record":' + msgspec.json.encode(
            _strip(body.record, keep_r3=patch is None)).decode("utf-8")
        tail = msgspec.json.encode(rest).decode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: `jsonio.dumps` escapes the whole payload
        return PreparedTurn(patch, None, None)
    return PreparedTurn(patch, head, "}" if tail == "{}" else "," + tail[1:])


def encode_prepared(body: TurnBody, attachment: Attachment, prepared: PreparedTurn
                    ) -> StoredTurn:
    """`encode_turn` from its prepared parts: what is left is cheap (the parent, the
    prompt's delta), done wherever the attachment is decided."""
    patch = prepared.patch
    if prepared.head is not None and prepared.tail is not None:
        parent = "null" if attachment.parent is None else str(int(attachment.parent))
        payload = f'{prepared.head},"parent":{parent}{prepared.tail}'
    else:
        document: dict[str, Any] = {
            "record": _strip(body.record, keep_r3=patch is None),
            "parent": attachment.parent,
        }
        if body.parent is not OMITTED:
            document["parent_given"] = body.parent
        if body.metadata is not None:
            document["metadata"] = body.metadata
        payload = jsonio.dumps(document)
    delta = body.facts.prompt[attachment.prompt_lcp:].astype(TOKEN_DTYPE).tobytes()
    return StoredTurn(
        payload=payload,
        prompt_lcp=attachment.prompt_lcp,
        prompt_delta=delta,
        patch=patch,
    )


def restore_prompt(parent_tokens: np.ndarray | None, prompt_lcp: int, delta: bytes) -> np.ndarray:
    head = np.empty(0, np.int64) if parent_tokens is None else parent_tokens[:prompt_lcp]
    return np.concatenate([head, np.frombuffer(delta, dtype=TOKEN_DTYPE).astype(np.int64)])


def restore_record(
    payload: dict[str, Any], prompt: np.ndarray, r3_base64: str | bytes | None
) -> dict[str, Any]:
    """The record exactly as appended; `r3_base64=None` leaves a moved payload out.

    Raw int32 bytes in place of the base64 text are for the MessagePack wire.
    """
    record = dict(payload["record"])
    request = dict(record["request"])
    request["input_ids"] = prompt.tolist()
    record["request"] = request
    return record if r3_base64 is None else _with_r3(record, r3_base64)


def inline_r3_as_bin(record: dict[str, Any]) -> dict[str, Any]:
    """For the MessagePack wire, which carries every R3 payload as bin: a payload
    kept inline in the stored JSON (only `""`, zero rows) becomes the empty bin."""
    meta = record["response"]["choices"][0].get("meta_info")
    if isinstance(meta, dict) and meta.get("routed_experts") == "":
        return _with_r3(record, b"")
    return record


def stored_facts(
    definition: SessionDefinition,
    payload: dict[str, Any],
    prompt: np.ndarray,
    patch_geometry: tuple[int, int] | None,
    *,
    trusted: bool = False,
) -> TurnFacts:
    """Facts of a stored turn without decoding its R3 bytes.

    `patch_geometry` is `(start, topk)` of the stored patch, if any. `trusted`:
    the turn is not validated again (it was when appended; a rebuild folds the
    whole log so), the same facts at a fraction of the cost.
    """
    if trusted:
        return stored_turn_facts(payload["record"], payload.get("metadata"), definition,
                                 patch_geometry, prompt)
    # The stored record without `input_ids`: the prompt goes in as the array it is.
    body: dict[str, Any] = {"event_id": "stored", "record": payload["record"]}
    if "metadata" in payload:
        body["metadata"] = payload["metadata"]
    return parse_turn(body, definition, stored_r3=patch_geometry, stored_prompt=prompt).facts


def stored_content(
    payload: dict[str, Any], event_id: str, prompt: np.ndarray, r3_base64: str | None
) -> dict[str, Any]:
    """The turn body as first sent (the idempotency content, cf. `TurnBody.content`)."""
    out: dict[str, Any] = {"event_id": event_id,
                           "record": restore_record(payload, prompt, r3_base64)}
    if "parent_given" in payload:
        out["parent"] = payload["parent_given"]
    if "metadata" in payload:
        out["metadata"] = payload["metadata"]
    return out
