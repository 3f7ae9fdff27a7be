"""Strict MessagePack in (turn bodies), MessagePack out (event pages).

Owns the rules that make a MessagePack turn body the same value its JSON
twin would be (docs/ingest.md): string map keys only, no ext types (a
timestamp included), finite floats, the JSON path's nesting limit, no
trailing bytes, and a bin in exactly one place — the turn's
`record.response.choices[0].meta_info.routed_experts`, where it holds the raw
little-endian int32 R3 bytes. Every failure is an `InvalidRequest` naming
`body`. Also owns the media types that mean MessagePack. No I/O; which wire a
request uses is the API's decision.

A turn's `record.request.input_ids` written *packed* — every id a uint32
(`0xce` and 4 bytes, valid if not minimal MessagePack; what `TurnlogClient`
sends) — is read by numpy into an int64 array, with no Python int per token.
Any other encoding decodes as every other value does; the value is the same
either way (`turn.json_carried` gives back the list).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain, compress
from typing import Any

import msgspec
import numpy as np

from app.domain.errors import InvalidRequest
from app.domain.wire.jsonio import MAX_DEPTH, containers_in, gc_paused, level_of
from app.domain.wire.validate import TOKEN_MAX
from app.domain.wire.width import MAX_VALUES, check_msgpack

MEDIA_TYPES = frozenset({"application/msgpack", "application/vnd.msgpack",
                         "application/x-msgpack"})
MEDIA_TYPE = "application/msgpack"
# Where a bin may stand: the turn's R3 payload (`TurnBody` keys, then the record's path).
R3_PATH: tuple[str | int, ...] = ("record", "response", "choices", 0, "meta_info",
                                  "routed_experts")
_SCALARS = frozenset({str, int, float, bool, type(None)})
_VALUES = _SCALARS | {dict, list}
_IS_DICT = frozenset({dict}).__contains__
_IS_FLOAT = frozenset({float}).__contains__


def _invalid(why: str, actual: Any) -> InvalidRequest:
    return InvalidRequest(f"body is not valid MessagePack here: {why}", field="body",
                          expected="a MessagePack map with string keys, finite floats, "
                                   "no ext types and bin only as routed_experts",
                          actual=actual)


def _reject_ext(code: int, _data: memoryview) -> Any:
    raise _invalid(f"ext type {code}", f"ext type {code}")


_DECODER = msgspec.msgpack.Decoder(ext_hook=_reject_ext)


def _r3_holder(value: Any) -> dict[str, Any] | None:
    """The map holding a bin (or a view of one, `loads`) at `R3_PATH` of a decoded
    body, if one stands there."""
    holder = _holder(value, R3_PATH[:-1])
    if holder is not None and isinstance(holder.get("routed_experts"), bytes | memoryview):
        return holder
    return None


class _Meta(msgspec.Struct):
    routed_experts: msgspec.Raw = msgspec.Raw()


class _Choice(msgspec.Struct):
    meta_info: _Meta | None = None


class _Response(msgspec.Struct):
    choices: tuple[_Choice] | None = None


class _Request(msgspec.Struct):
    input_ids: msgspec.Raw = msgspec.Raw()


class _Record(msgspec.Struct):
    request: _Request | None = None
    response: _Response | None = None


class _Turn(msgspec.Struct):
    record: _Record | None = None


# Reads only the keys along `R3_PATH` and to `input_ids`; every other value is
# stepped over unallocated. (A key given twice: the last counts, as in the full decode.)
_LAYOUT = msgspec.msgpack.Decoder(_Turn)
# The first byte of a str or bin (str 8/16/32, bin 8/16/32; fixstr never holds R3).
_STR_OR_BIN = frozenset({0xd9, 0xda, 0xdb, 0xc4, 0xc5, 0xc6})
# A packed prompt: array 16/32, then each id as uint32 (`0xce`, 4 bytes big-endian).
_PACKED_ITEM = np.dtype([("tag", "u1"), ("id", ">u4")])
_UINT32 = 0xCE
_ARRAY_HEADERS = {0xDC: 3, 0xDD: 5}
# Shorter prompts decode as they come: nothing to gain.
PACKED_MIN = 16
_BIN32 = 0xC6
# What the decoder is shown in place of a long value it need not read: an ext 32
# (header: 0xc9, 4 bytes of length, the type) of a type code no client may send
# (every ext is refused), covering the value's bytes; see `_decode`.
_EXT32 = 0xC9
_STAND_CODE = 101
_STAND_HEADER = 6


@dataclass(frozen=True)
class Prompt:
    """A packed `input_ids` found in a body: its bytes `start:end` (header included)
    and the ids it holds, each in [0, TOKEN_MAX]."""

    start: int
    end: int
    ids: np.ndarray


@dataclass(frozen=True)
class Layout:
    """Where a turn body's two long values stand, from one typed pass."""

    r3: int = 0  # the R3 str or bin's bytes, header included (0: none found)
    prompt: Prompt | None = None  # a packed `input_ids` (None: none, or not packed)
    r3_bin: int = -1  # where an R3 bin 32 starts (-1: none; its size is `r3`)

    def stands(self) -> list[tuple[int, int]]:
        """The `(start, end)` of each value the decoder need not read."""
        out = [] if self.prompt is None else [(self.prompt.start, self.prompt.end)]
        return out if self.r3_bin < 0 else [*out, (self.r3_bin, self.r3_bin + self.r3)]


_NO_LAYOUT = Layout()


def layout(raw: bytes | bytearray | memoryview) -> Layout:
    """The R3 payload's size (and place, a bin 32's) and a packed prompt of a
    MessagePack body.

    A typed decode that allocates a few objects whatever the body (one choice only:
    `choices` of another length, or anything the typed pass cannot read, finds
    nothing); what it cannot read, the full decode refuses later.
    """
    try:
        turn = _LAYOUT.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return _NO_LAYOUT
    record = turn.record
    if record is None:
        return _NO_LAYOUT
    response = record.response
    choices = response.choices if response is not None else None
    meta = choices[0].meta_info if choices else None
    r3, r3_bin = 0, -1
    if meta is not None and meta.routed_experts:
        r3, r3_bin = _r3_place(raw, meta.routed_experts)
    request = record.request
    prompt = _packed(raw, request.input_ids) if request is not None else None
    return Layout(r3, prompt, r3_bin)


def r3_span(raw: bytes | bytearray | memoryview) -> int:
    """The bytes of the str or bin at `R3_PATH` of a MessagePack body, header included
    (0: none found, or the body is not shaped so that the typed pass can tell)."""
    return layout(raw).r3


def _offset(raw: bytes | bytearray | memoryview, value: msgspec.Raw) -> int:
    """Where `value` (a Raw of the typed pass over `raw`) starts in `raw`; -1 if it is
    not a view of it."""
    body = np.frombuffer(raw, np.uint8)
    span = np.frombuffer(value, np.uint8)
    start = int(span.ctypes.data - body.ctypes.data)
    return start if 0 <= start <= len(body) - len(span) else -1


def _r3_place(raw: bytes | bytearray | memoryview, value: msgspec.Raw) -> tuple[int, int]:
    """The R3 payload's bytes (0: not a str or bin) and where it starts if a bin 32."""
    with memoryview(value) as span:
        size, first = len(span), span[0]
    if first not in _STR_OR_BIN:
        return 0, -1
    return size, _offset(raw, value) if first == _BIN32 else -1


def _packed(raw: bytes | bytearray | memoryview, value: msgspec.Raw) -> Prompt | None:
    """`value` (an array's bytes inside `raw`) as a packed prompt, or None: not an
    array 16/32 of at least `PACKED_MIN` uint32 items each in [0, TOKEN_MAX] (the
    full decode then reads it, and validation names a bad id)."""
    if len(value) < 1 + PACKED_MIN * 5:
        return None
    span = np.frombuffer(value, np.uint8)
    header = _ARRAY_HEADERS.get(int(span[0]), 0)
    start = _offset(raw, value)
    if not header or start < 0:
        return None
    count = int.from_bytes(span[1:header].tobytes(), "big")
    if len(span) != header + 5 * count:
        return None
    items = np.frombuffer(span, _PACKED_ITEM, count, header)
    if not (items["tag"] == _UINT32).all() or int(items["id"].max()) > TOKEN_MAX:
        return None
    return Prompt(start, start + len(span), items["id"].astype(np.int64))


def loads(raw: bytes | bytearray | memoryview, max_values: int = MAX_VALUES,
          found: Layout | None = None) -> Any:
    """Decode a request body strictly; the R3 payload may be a bin, nothing else may.
    A body of more than `max_values` values is a 413 before it is decoded (`width`):
    the header walk is skipped when the R3 bin leaves too few other bytes for that.

    `found`: the body's `layout`, if the caller has it (else it is read here when
    it can serve). In a bytearray, the two long values are not decoded: a packed
    prompt is read from `found`, and an R3 bin 32 becomes a read-only view of the
    body (no copy) — `_decode` says how.
    """
    if found is None and (len(raw) > max_values or
                          (isinstance(raw, bytearray) and len(raw) > PACKED_MIN * 5)):
        found = layout(raw)
    check_msgpack(raw, max_values, found.r3 if found is not None else 0)
    value = _OMITTED
    if found is not None and isinstance(raw, bytearray) and found.stands():
        value = _decode_around(raw, found)
    if value is _OMITTED:
        value = _decode(raw)
    holders = [(holder, key, holder[key]) for holder, key in
               ((_r3_holder(value), "routed_experts"), (_ids_holder(value), "input_ids"))
               if holder is not None]
    # The allowed values step aside for the walk (by place, not identity: b"" is shared).
    for holder, key, _ in holders:
        holder[key] = None
    try:
        _check(value)
    finally:
        for holder, key, kept in holders:
            holder[key] = kept
    return value


_OMITTED: Any = object()


class _Stand:
    """What the decoder makes of a value `_decode_around` hid from it."""


def _decode(raw: bytes | bytearray | memoryview, ext_hook: Any = _reject_ext) -> Any:
    """The full decode."""
    try:
        with gc_paused():
            if ext_hook is _reject_ext:
                return _DECODER.decode(raw)
            return msgspec.msgpack.Decoder(ext_hook=ext_hook).decode(raw)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"body is not valid MessagePack: {exc}", field="body",
                             expected="one complete MessagePack document",
                             actual="malformed MessagePack") from None


def _decode_around(raw: bytearray, found: Layout) -> Any:
    """The full decode, with the long values of `found` not read: `_OMITTED` when the
    decoded body does not hold them where the typed pass saw them (the caller then
    decodes it as it is).

    Each is shown to the decoder as an ext value of its own type code (the first
    bytes rewritten in the buffer, and restored before this returns), which the
    decoder steps over without copying; then the prompt's ids and a view of the R3
    bytes take their places. A client's own ext of that code is still refused: it
    makes one value more than there were places, and the plain decode refuses it.
    """
    stands = found.stands()
    made: list[_Stand] = []

    def stand(code: int, data: memoryview) -> Any:
        if code != _STAND_CODE:
            _reject_ext(code, data)
        made.append(_Stand())
        return made[-1]

    saved = [bytes(raw[start:start + _STAND_HEADER]) for start, _ in stands]
    for start, end in stands:
        raw[start:start + _STAND_HEADER] = bytes((_EXT32,)) + \
            (end - start - _STAND_HEADER).to_bytes(4, "big") + bytes((_STAND_CODE,))
    try:
        value = _decode(raw, stand)
    finally:
        for (start, _), kept in zip(stands, saved, strict=True):
            raw[start:start + _STAND_HEADER] = kept
    if len(made) != len(stands):
        return _OMITTED
    places: list[tuple[dict[str, Any] | None, str, Any]] = []
    if found.prompt is not None:
        places.append((_holder(value, _PROMPT_PATH), "input_ids", found.prompt.ids))
    if found.r3_bin >= 0:
        data = memoryview(raw)[found.r3_bin + 5:found.r3_bin + found.r3].toreadonly()
        places.append((_holder(value, R3_PATH[:-1]), "routed_experts", data))
    for holder, key, _ in places:
        if holder is None or type(holder.get(key)) is not _Stand:
            return _OMITTED
    for holder, key, kept in places:
        assert holder is not None
        holder[key] = kept
    return value


_PROMPT_PATH = ("record", "request")


def _holder(value: Any, path: tuple[str | int, ...]) -> dict[str, Any] | None:
    """The map at `path` of a decoded body, if one stands there."""
    node = value
    for key in path:
        if type(key) is str:
            if type(node) is not dict or key not in node:
                return None
        elif type(node) is not list or not node:
            return None
        node = node[key]
    return node if type(node) is dict else None


def _ids_holder(value: Any) -> dict[str, Any] | None:
    """The decoded `record.request` map if it holds a packed prompt's array."""
    holder = _holder(value, _PROMPT_PATH)
    return holder if holder is not None and \
        type(holder.get("input_ids")) is np.ndarray else None


def _too_deep() -> InvalidRequest:
    return InvalidRequest("MessagePack nesting is too deep", field="body",
                          expected=f"at most {MAX_DEPTH} levels of nesting", actual="deeper")


def _check(value: Any) -> None:
    """One walk, a level at a time: types, keys, floats, depth.

    Each level's children are gathered and scanned by C-level iterators
    (`chain`, `map`, `set`), so the 2k `[logprob, id]` pairs of a turn cost a
    few list operations, not a Python step per pair.
    """
    if type(value) not in _VALUES:
        name = "bin" if type(value) is bytes else type(value).__name__
        raise _invalid(f"{name} is not allowed here", name)
    if type(value) is float and not math.isfinite(value):  # a bare NaN document
        raise _invalid("non-finite float", "NaN or Infinity")
    containers = [value] if type(value) is dict or type(value) is list else []
    level = 0
    while containers:
        level += 1
        if level > MAX_DEPTH:
            raise _too_deep()
        dicts = list(compress(containers, map(_IS_DICT, map(type, containers))))
        if dicts:
            keys = set(map(type, chain.from_iterable(dicts)))
            if keys and keys != {str}:
                bad = next(k for k in chain.from_iterable(dicts) if type(k) is not str)
                raise _invalid("map keys must be strings", f"{type(bad).__name__} key")
        children, kinds, leaves, rows = level_of(containers)
        if not kinds <= _VALUES:
            kind = next(iter(kinds - _VALUES))
            name = "bin" if kind is bytes else kind.__name__
            raise _invalid(f"{name} is not allowed here", name)
        if float in kinds and not _all_finite(children, leaves):
            raise _invalid("non-finite float", "NaN or Infinity")
        if rows and level == MAX_DEPTH:  # lists of finite numbers, one level too deep
            raise _too_deep()
        if dict not in kinds and list not in kinds:
            return
        containers = containers_in(children)


def _all_finite(children: list[Any], leaves: list[list[Any]]) -> bool:
    """No NaN or infinity among the floats of `children` and `leaves`.

    Their sum tells at C speed: a NaN or an infinity makes it non-finite, so a finite
    sum clears them all; only a non-finite one (or finite values that overflow it)
    needs the check one by one.
    """
    floats = list(compress(chain(children, *leaves),
                           map(_IS_FLOAT, map(type, chain(children, *leaves)))))
    return math.isfinite(sum(floats, 0.0)) or all(map(math.isfinite, floats))


def dumps(value: Any) -> bytes:
    """MessagePack of a reply document (R3 payloads already as bytes become bin)."""
    return msgspec.msgpack.encode(value)
