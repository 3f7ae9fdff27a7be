"""One recorded SGLang turn: shape validation and the facts derived from it.

Owns the context-free rules of docs/api.md §1.2 for a turn body (types, prompt,
output, completion_tokens, mismatch types, R3 payload encoding and geometry
relative to the session definition) and the per-turn facts every projection
uses (tokens, finish reason, weight version, SpecInfo counters). Rules that
need the session's tree (parent, offsets, prefix) live in `app/domain/log/tree.py`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Annotated, Any

import msgspec
import numpy as np
import pybase64

from app.domain.body.session import SessionDefinition
from app.domain.body.specinfo import SPEC_INFO_KEYS, SpecInfo
from app.domain.errors import InvalidR3, InvalidRequest
from app.domain.wire.packed import OutputEntries
from app.domain.wire.r3 import NarrowR3, decode_payload, decode_raw, infer_topk
from app.domain.wire.validate import (
    CONVERT_REFUSED,
    TOKEN_MAX,
    describe,
    is_int,
    reject_unknown,
    require_member,
    require_object,
    require_text,
)

TURN_FIELDS = frozenset({"event_id", "parent", "record", "metadata"})
MISMATCH_TYPES = ("special_token_count", "special_token_type", "non_assistant_text",
                  "assistant_text")
LEGACY_SPEC_FIELDS = {
    "spec_num_correct_drafts": "spec_accept_token_num",
    "spec_num_proposed_drafts": "spec_draft_token_num",
    "completion_tokens": "completion_token_num",
}
COUNTER_MAX = 1 << 52  # a session carrier sums at most 1024 of them: stays in BIGINT
EVENT_ID_MAX = 128
TIMESTAMP_MAX = 253402300800  # 10000-01-01T00:00:00Z
OMITTED: Any = object()

META = "record.response.choices[0].meta_info"
PROMPT_FIELD = "record.request.input_ids"


@dataclass(frozen=True)
class TurnFacts:
    """Everything derived from one record, independent of where it attaches."""

    prompt: np.ndarray
    output: np.ndarray
    logprobs: list[float]
    finish_reason: str | None
    weight_version: Any
    returns_r3: bool
    r3_start: int | None
    r3_values: np.ndarray | None
    topk: int | None
    spec_info: SpecInfo
    cached_tokens: int | None
    timestamp: float | None
    mismatch: list[Any] | None = field(default=None)
    # For the miles samples wire: the message text (no tokenizer here) and the
    # prompt token count as reported (a value that is not a counter counts 0).
    content: str = ""
    prompt_tokens: int = 0
    # `response.id` when it is a string: how a reward recorded later names a leaf.
    response_id: str | None = None
    # `meta_info` has the key `weight_version` (null included): a sample lists the
    # versions of the turns that have it, as miles appends them.
    sends_weight_version: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.prompt.size + self.output.size)

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.output])

    @property
    def r3_end(self) -> int:
        return self.num_tokens - 1


@dataclass(frozen=True)
class TurnBody:
    event_id: str
    parent: Any  # OMITTED, None (new root) or an int seq
    record: dict[str, Any]
    metadata: dict[str, Any] | None
    facts: TurnFacts

    def content(self) -> dict[str, Any]:
        """The idempotency content: the body as sent, omitted keys left out, as JSON
        carries it (an R3 bin is its canonical base64 text)."""
        out: dict[str, Any] = {"event_id": self.event_id, "record": json_carried(self.record)}
        if self.parent is not OMITTED:
            out["parent"] = self.parent
        if self.metadata is not None:
            out["metadata"] = self.metadata
        return out


def json_carried(record: dict[str, Any]) -> dict[str, Any]:
    """`record` as JSON carries it, for comparing contents: an R3 bin (MessagePack;
    bytes, or a view of the request's body) becomes its base64 text, and a packed
    prompt or packed output entries (`msgpackio` reads them into arrays) their lists.

    Copies only the maps on those paths; with none of them, `record` itself.
    """
    with contextlib.suppress(KeyError, IndexError, TypeError):
        payload = record["response"]["choices"][0]["meta_info"]["routed_experts"]
        if isinstance(payload, NarrowR3):
            payload = payload.int32()
        if isinstance(payload, bytes | memoryview):
            record = _with_meta(record, routed_experts=pybase64.b64encode(payload)
                                .decode("ascii"))
    with contextlib.suppress(KeyError, TypeError):
        prompt = record["request"]["input_ids"]
        if isinstance(prompt, np.ndarray):
            record = {**record, "request": {**record["request"], "input_ids": prompt.tolist()}}
    entries = _packed_entries(record)
    return record if entries is None else \
        _with_meta(record, output_token_logprobs=entries.as_lists())


def entries_to_write(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with packed output entries as tuples: for writing it as JSON only (the
    text of the lists, for half the CPU of making them). Copies the maps on the path."""
    entries = _packed_entries(record)
    return record if entries is None else \
        _with_meta(record, output_token_logprobs=entries.as_items())


def _packed_entries(record: dict[str, Any]) -> OutputEntries | None:
    with contextlib.suppress(KeyError, IndexError, TypeError):
        entries = record["response"]["choices"][0]["meta_info"]["output_token_logprobs"]
        if type(entries) is OutputEntries:
            return entries
    return None


def _with_meta(record: dict[str, Any], **values: Any) -> dict[str, Any]:
    """`record` with `values` set in its first choice's `meta_info`, copying only the
    maps on that path."""
    response = dict(record["response"])
    choices = list(response["choices"])
    choice = dict(choices[0])
    choice["meta_info"] = {**choice["meta_info"], **values}
    choices[0] = choice
    response["choices"] = choices
    return {**record, "response": response}


def _invalid(detail: str, field_name: str, expected: Any, actual: Any) -> InvalidRequest:
    return InvalidRequest(detail, field=field_name, expected=expected, actual=describe(actual))


def parse_event_id(body: dict[str, Any]) -> str:
    event_id = body.get("event_id")
    if not isinstance(event_id, str) or not 1 <= len(event_id) <= EVENT_ID_MAX \
            or not event_id.isprintable():
        detail = ("event_id is required: a client-made id, unique within the session"
                  if event_id is None else
                  f"event_id must be a printable string of 1-{EVENT_ID_MAX} characters")
        raise _invalid(detail, "event_id", f"printable string of 1-{EVENT_ID_MAX} characters",
                       event_id)
    return event_id


# What `msgspec.convert` checks a list of token ids against, in one C-level pass.
_TOKEN_LIST = list[Annotated[int, msgspec.Meta(ge=0, le=TOKEN_MAX)]]
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def _token_ids(values: list[Any]) -> bool:
    """Every item an `int` (not a boolean, nor a float) in [0, TOKEN_MAX]: one C-level
    pass, a fifth of a type scan plus a copy to numpy and its min and max."""
    try:
        msgspec.convert(values, _TOKEN_LIST)
    except CONVERT_REFUSED:
        return False
    return True


def _token_error(values: list[Any], field_name: str) -> InvalidRequest:
    for i, tok in enumerate(values):
        if not is_int(tok) or not 0 <= tok <= TOKEN_MAX:
            return _invalid(f"{field_name}[{i}] is not a token id", f"{field_name}[{i}]",
                            f"integer in [0, {TOKEN_MAX}]", tok)
    raise AssertionError("no invalid token id")  # pragma: no cover


def token_array(value: Any, field_name: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        # A stored turn's prompt, restored from the log (validated when appended), or
        # a packed MessagePack prompt (`msgpackio`, validated as it was read).
        return value.astype(np.int64, copy=False)
    if not isinstance(value, list):
        raise _invalid(f"{field_name} must be a list of token ids", field_name,
                       "array of integers", value)
    if not value:
        return np.empty(0, np.int64)
    # One C-level pass checks types and range, then numpy copies the ids; the slow
    # walk only runs to name a bad one.
    if not _token_ids(value):
        raise _token_error(value, field_name)
    return np.fromiter(value, np.int64, len(value))


def _fits_float64(value: int | float) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _output_error(entries: list[Any], name: str) -> InvalidRequest:
    for i, entry in enumerate(entries):
        where = f"{name}[{i}]"
        if not isinstance(entry, list) or len(entry) < 2:
            return _invalid("each output entry is [logprob, token_id, ...]", where,
                            "array [logprob, token_id, ...]", entry)
        logprob, tok = entry[0], entry[1]
        if not isinstance(logprob, int | float) or isinstance(logprob, bool) \
                or not _fits_float64(logprob):
            return _invalid("logprob must be a number", f"{where}[0]", "float64 number",
                            logprob)
        if not is_int(tok) or not 0 <= tok <= TOKEN_MAX:
            return _invalid("token id out of range", f"{where}[1]",
                            f"integer in [0, {TOKEN_MAX}]", tok)
    raise AssertionError("no invalid output entry")  # pragma: no cover


def _output(meta: dict[str, Any]) -> tuple[np.ndarray, list[float]]:
    entries = meta.get("output_token_logprobs")
    if type(entries) is OutputEntries:  # packed: read and checked as it was decoded
        return entries.ids, entries.logprobs.tolist()
    name = f"{META}.output_token_logprobs"
    if not isinstance(entries, list):
        raise _invalid("output_token_logprobs is required", name,
                       "array of [logprob, token_id, ...]", entries)
    if not entries:
        return np.empty(0, np.int64), []
    # Whole-list checks at C speed; the slow walk only runs to name a bad entry.
    if set(map(type, entries)) == {list} and min(map(len, entries)) >= 2:
        logprobs = list(map(_FIRST, entries))
        ids = list(map(_SECOND, entries))
        # Range-checked as Python ints first (msgspec, booleans refused): numpy
        # overflows on ids beyond int64, and float() on an integer log-prob beyond float64.
        if set(map(type, logprobs)) <= {float, int} and _token_ids(ids):
            with contextlib.suppress(OverflowError):
                return np.fromiter(ids, np.int64, len(ids)), list(map(float, logprobs))
    raise _output_error(entries, name)


def _counter(meta: dict[str, Any], name: str) -> int | None:
    value = meta.get(name)
    if value is None:
        return None
    if not is_int(value) or not 0 <= value <= COUNTER_MAX:
        raise _invalid(f"{name} must be a non-negative integer", f"{META}.{name}",
                       f"integer in [0, {COUNTER_MAX}]", value)
    return int(value)


def _lenient_counter(meta: dict[str, Any], name: str) -> int:
    value = meta.get(name)
    return int(value) if is_int(value) and value >= 0 else 0


def _optional_counter(meta: dict[str, Any], name: str) -> int | None:
    """A reported count that is never refused: a value that is not a non-negative
    integer is as if absent (the samples wire counts it 0, docs/trainers.md)."""
    value = meta.get(name)
    return int(value) if is_int(value) and value >= 0 else None


def _content(choice: dict[str, Any]) -> str:
    message = choice.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else ""


def read_spec_info(meta: dict[str, Any], output_len: int) -> SpecInfo:
    """SpecInfo counters of one turn (before the guard): canonical names first,
    then legacy ones."""
    values: dict[str, int] = {}
    for canonical_name in SPEC_INFO_KEYS:
        value = _counter(meta, canonical_name)
        legacy = LEGACY_SPEC_FIELDS.get(canonical_name)
        if value is None and legacy is not None:
            value = _counter(meta, legacy)
        if value is None:
            value = output_len if canonical_name == "completion_tokens" else 0
        values[canonical_name] = value
    return SpecInfo.from_dict(values)


def _mismatch(metadata: dict[str, Any] | None) -> list[Any] | None:
    if metadata is None or "tito_session_mismatch" not in metadata:
        return None
    entries = metadata["tito_session_mismatch"]
    name = "metadata.tito_session_mismatch"
    if not isinstance(entries, list):
        raise _invalid("tito_session_mismatch must be a list", name, "array of objects", entries)
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise _invalid("each mismatch is an object", f"{name}[{i}]", "object", entry)
        if entry.get("type") not in MISMATCH_TYPES:
            raise _invalid("unknown mismatch type", f"{name}[{i}].type",
                           " | ".join(MISMATCH_TYPES), entry.get("type"))
    return entries


def _r3(
    definition: SessionDefinition,
    request: dict[str, Any],
    meta: dict[str, Any],
    num_tokens: int,
    stored_r3: tuple[int, int] | None,
) -> tuple[bool, int | None, np.ndarray | None, int | None]:
    returns = request.get("return_routed_experts", False)
    if not isinstance(returns, bool):
        raise _invalid("return_routed_experts must be a boolean",
                       "record.request.return_routed_experts", "boolean", returns)
    start_raw = request.get("routed_experts_start_len")
    payload = meta.get("routed_experts")
    payload_field = f"{META}.routed_experts"
    start_field = "record.request.routed_experts_start_len"
    if not returns:
        # Empty: "" in JSON, the empty bin, or the narrowed wire's bin of no values.
        if payload is not None and not (isinstance(payload, str | bytes | memoryview | NarrowR3)
                                        and not payload):
            raise InvalidR3("routed_experts sent but return_routed_experts is not true",
                            field=payload_field, expected="absent, null or \"\"",
                            actual="a payload")
        return False, None, None, None
    if definition.num_layers is None:
        raise InvalidR3("turn carries routed experts but the session was opened without r3",
                        field="record.request.return_routed_experts",
                        expected="false (open the session with r3.num_layers)", actual=True)
    if definition.use_addition_r3:
        if not is_int(start_raw) or start_raw < 0:
            why = "is required" if start_raw is None else "must be a non-negative integer"
            raise _invalid(f"routed_experts_start_len {why} in addition (in_place) mode",
                           start_field, "non-negative integer", start_raw)
        start = int(start_raw)
    else:
        if start_raw is not None and not (is_int(start_raw) and start_raw == 0):
            raise _invalid("routed_experts_start_len must be absent or 0 in full (retract) mode",
                           start_field, "absent or 0", start_raw)
        start = 0
    end = num_tokens - 1
    rows = end - start
    if rows < 0:
        raise InvalidR3(f"routed_experts_start_len {start} is past the turn's last row {end}",
                        field=start_field, expected=f"at most {end}", actual=start)
    if payload is not None and not isinstance(payload, str | bytes | memoryview | NarrowR3):
        raise InvalidR3("routed_experts must be a base64 string", field=payload_field,
                        expected="base64 string (or a MessagePack bin)",
                        actual=describe(payload))
    if stored_r3 is not None:
        return True, start, None, stored_r3[1]
    if not payload:
        if rows > 0:
            raise InvalidR3(f"turn has {rows} R3 rows but no routed_experts payload",
                            field=payload_field, expected=f"payload of {rows} rows",
                            actual="absent")
        return True, start, None, None
    # A MessagePack bin is already the raw int32 bytes: no base64 to undo; the
    # narrowed wire's bin holds the values at the width it names.
    values = (payload.values(payload_field) if isinstance(payload, NarrowR3)
              else decode_raw(payload, payload_field) if isinstance(payload, bytes | memoryview)
              else decode_payload(payload, payload_field))
    if rows == 0:
        raise InvalidR3("routed_experts payload sent for a turn with zero rows",
                        field=payload_field, expected="absent, null or \"\"",
                        actual=f"{values.size} values")
    topk = infer_topk(values.size, rows, definition.num_layers, payload_field)
    return True, start, values, topk


@dataclass(frozen=True)
class _Envelope:
    """The parts of a turn body every later step reads, each checked to be an object."""

    event_id: str
    parent: Any  # OMITTED, None or a node seq
    record: dict[str, Any]
    request: dict[str, Any]
    response: dict[str, Any]
    choice: dict[str, Any]
    meta: dict[str, Any]
    metadata: dict[str, Any] | None


def _envelope(raw: Any) -> _Envelope:
    """Step 1: the wrapper `{event_id, parent, record, metadata}` and the record's nesting."""
    body = require_object(raw, "body")
    if "record" not in body and {"request", "response"} & set(body):
        # The commonest first mistake: posting the session server's record itself.
        raise _invalid("this looks like a bare record: a turn body wraps it as "
                       '{"event_id": "...", "record": {...}}', "record",
                       '{"event_id", "record": {method, path, request, response, ...}}',
                       "absent (the body has request/response at the top level)")
    reject_unknown(body, TURN_FIELDS, "")
    event_id = parse_event_id(body)

    parent: Any = OMITTED
    if "parent" in body:
        parent = body["parent"]
        if parent is not None and (not is_int(parent) or parent < 0):
            raise _invalid("parent must be a node seq or null", "parent",
                           "non-negative integer | null", parent)

    record = require_member(body, "record", "record")
    request = require_member(record, "request", "record.request")
    response = require_member(record, "response", "record.response")
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise _invalid("response.choices must be a non-empty list", "record.response.choices",
                       "non-empty array", choices)
    choice = require_object(choices[0], "record.response.choices[0]")
    meta = require_object(choice.get("meta_info"), META)

    metadata_raw = body.get("metadata")
    metadata = None if metadata_raw is None else require_object(metadata_raw, "metadata")
    return _Envelope(event_id, parent, record, request, response, choice, meta, metadata)


def _prompt_output(envelope: _Envelope, stored_prompt: np.ndarray | None,
                   ) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """Step 2: the prompt's and the output's token ids, the log-probs, `completion_tokens`."""
    prompt = stored_prompt if stored_prompt is not None else \
        token_array(envelope.request.get("input_ids"), PROMPT_FIELD)
    if prompt.size == 0:
        raise _invalid("prompt (record.request.input_ids) must not be empty",
                       PROMPT_FIELD, "at least one token id", [])
    output, logprobs = _output(envelope.meta)

    completion = envelope.meta.get("completion_tokens")
    if completion is not None and (not is_int(completion) or completion != output.size):
        raise _invalid("completion_tokens must equal the number of output tokens",
                       f"{META}.completion_tokens", output.size, completion)
    return prompt, output, logprobs


def _meta(envelope: _Envelope) -> tuple[str | None, Any, float | None]:
    """Step 3: `finish_reason`, `weight_version` and the record's `timestamp`."""
    finish = envelope.choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise _invalid("finish_reason must be a string", "record.response.choices[0]."
                       "finish_reason", "string | null", finish)
    if finish is not None:
        require_text(finish, "record.response.choices[0].finish_reason", 64)
    weight_version = envelope.meta.get("weight_version")
    if isinstance(weight_version, str):
        require_text(weight_version, f"{META}.weight_version", 256)

    timestamp = envelope.record.get("timestamp")
    if timestamp is not None and (not isinstance(timestamp, int | float)
                                  or isinstance(timestamp, bool)
                                  or not 0 <= timestamp < TIMESTAMP_MAX):
        raise _invalid("timestamp must be seconds since the epoch",
                       "record.timestamp", f"number in [0, {TIMESTAMP_MAX})", timestamp)
    return finish, weight_version, None if timestamp is None else float(timestamp)


def parse_turn(raw: Any, definition: SessionDefinition,
               stored_r3: tuple[int, int] | None = None,
               stored_prompt: np.ndarray | None = None) -> TurnBody:
    """Validate a turn body against the session definition.

    In steps, each refusing with the field it names, in this order: the envelope,
    the prompt and output, the meta fields, the R3 payload, then the counters,
    the mismatch report and the content (the order decides which of several
    faults a reply names).

    `stored_r3` = `(start, topk)` when re-reading a stored turn whose payload was
    moved to a patch row: the geometry is taken as already validated.
    `stored_prompt` = the prompt of a stored turn, restored from the log (it was
    validated when appended), or `input_ids` already validated by `token_array`
    (the gateway's `classify_request`): `input_ids` is then not read at all, which
    spares folding a long session a list round trip per turn.
    """
    envelope = _envelope(raw)
    prompt, output, logprobs = _prompt_output(envelope, stored_prompt)
    finish, weight_version, timestamp = _meta(envelope)
    facts = _facts(definition, envelope, prompt, output, logprobs, finish, weight_version,
                   timestamp, _mismatch(envelope.metadata), stored_r3)
    return TurnBody(event_id=envelope.event_id, parent=envelope.parent, record=envelope.record,
                    metadata=envelope.metadata, facts=facts)


def _facts(definition: SessionDefinition, envelope: _Envelope, prompt: np.ndarray,
           output: np.ndarray, logprobs: list[float], finish: str | None, weight_version: Any,
           timestamp: float | None, mismatch: list[Any] | None,
           stored_r3: tuple[int, int] | None) -> TurnFacts:
    """Step 4 and the rest: the R3 geometry, the counters and the facts, shared by
    `parse_turn` and `stored_turn_facts`."""
    meta = envelope.meta
    returns_r3, r3_start, r3_values, topk = _r3(definition, envelope.request, meta,
                                                int(prompt.size + output.size), stored_r3)
    return TurnFacts(
        prompt=prompt,
        output=output,
        logprobs=logprobs,
        finish_reason=finish,
        weight_version=weight_version,
        returns_r3=returns_r3,
        r3_start=r3_start,
        r3_values=r3_values,
        topk=topk,
        spec_info=read_spec_info(meta, int(output.size)),
        cached_tokens=_optional_counter(meta, "cached_tokens"),
        timestamp=timestamp,
        mismatch=mismatch,
        content=_content(envelope.choice),
        prompt_tokens=_lenient_counter(meta, "prompt_tokens"),
        response_id=response_id if isinstance(response_id := envelope.response.get("id"), str)
        else None,
        sends_weight_version="weight_version" in meta,
    )


def stored_turn_facts(record: dict[str, Any], metadata: dict[str, Any] | None,
                      definition: SessionDefinition, stored_r3: tuple[int, int] | None,
                      stored_prompt: np.ndarray) -> TurnFacts:
    """The facts of a turn read back from the log, without validating it again.

    Only for records `parse_turn` accepted when they were appended (the log is
    immutable): the checks of steps 1 to 3 are skipped, what they derive
    (output ids and log-probs, finish reason, weight version, timestamp,
    mismatch report) is read directly, and the rest is `parse_turn`'s own
    `_facts`, so both give the same facts for such a record. A rebuild folds
    the whole log with it.
    """
    response = record["response"]
    choice = response["choices"][0]
    meta = choice["meta_info"]
    entries = meta["output_token_logprobs"]
    output = np.asarray([entry[1] for entry in entries], dtype=np.int64) if entries \
        else np.empty(0, np.int64)
    timestamp = record.get("timestamp")
    envelope = _Envelope("stored", OMITTED, record, record["request"], response, choice, meta,
                         metadata)
    mismatch = None if metadata is None else metadata.get("tito_session_mismatch")
    return _facts(definition, envelope, stored_prompt, output,
                  [float(entry[0]) for entry in entries], choice.get("finish_reason"),
                  meta.get("weight_version"), None if timestamp is None else float(timestamp),
                  mismatch, stored_r3)
