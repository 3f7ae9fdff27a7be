"""Strict MessagePack in (turn bodies), MessagePack out (event pages).

Owns the rules that make a MessagePack turn body the same value its JSON
twin would be (docs/ingest.md): string map keys only, no ext types (a
timestamp included), finite floats, the JSON path's nesting limit, no
trailing bytes, and a bin in exactly one place — the turn's
`record.response.choices[0].meta_info.routed_experts`, where it holds the raw
little-endian int32 R3 bytes. Every failure is an `InvalidRequest` naming
the field where the refused value stands (`body` for the body as a whole).
Also owns the media types that mean MessagePack, and the narrowed wire
(`NARROW_MEDIA_TYPE`, `loads_narrow`): the same body, its R3 bin a width byte
and the values at that width (`r3.NarrowR3`). No I/O; which wire a request
uses is the API's decision.

The long values of a turn are not decoded into Python objects when the body
is a bytearray (the API's receive buffer): a prompt and output entries written
*packed* (`packed`: fixed-width items, valid MessagePack; what `TurnlogClient`
sends) are read by numpy, and an R3 bin 32 (what encoders write for 64 KiB
or more) is used where it lies, as a read-only view. The value is the same as the plain decode's
(`turn.json_carried` gives back the lists and the base64 text).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, compress
from typing import Any

import msgspec
import numpy as np

from app.domain.errors import InvalidRequest
from app.domain.wire import packed
from app.domain.wire.jsonio import MAX_DEPTH, containers_in, first_path, gc_paused, level_of
from app.domain.wire.r3 import NarrowR3
from app.domain.wire.width import MAX_VALUES, check_msgpack

MEDIA_TYPES = frozenset({"application/msgpack", "application/vnd.msgpack",
                         "application/x-msgpack"})
MEDIA_TYPE = "application/msgpack"
# turnlog's own MessagePack turn: the R3 bin narrowed (`loads_narrow`). A server
# that does not know it answers 415, so a client can fall back to `MEDIA_TYPE`.
NARROW_MEDIA_TYPE = "application/vnd.turnlog.narrow-r3+msgpack"
# Where a bin may stand: the turn's R3 payload (`TurnBody` keys, then the record's path).
R3_PATH: tuple[str | int, ...] = ("record", "response", "choices", 0, "meta_info",
                                  "routed_experts")
_SCALARS = frozenset({str, int, float, bool, type(None)})
_VALUES = _SCALARS | {dict, list}
_IS_DICT = frozenset({dict}).__contains__
_IS_FLOAT = frozenset({float}).__contains__


class _Refused(InvalidRequest):
    """`_check`'s refusal, with what it refused (`offends`, asked of one value), so the
    field where such a value first stands can be named (`_named`)."""

    offends: Callable[[Any], bool] | None = None


def _invalid(why: str, actual: Any,
             offends: Callable[[Any], bool] | None = None) -> InvalidRequest:
    refusal = _Refused(f"body is not valid MessagePack here: {why}", field="body",
                       expected="a MessagePack map with string keys, finite floats, "
                                "no ext types and bin only as routed_experts",
                       actual=actual)
    refusal.offends = offends
    return refusal


def _not_allowed(value: Any) -> bool:
    return type(value) not in _VALUES


def _non_finite(value: Any) -> bool:
    return type(value) is float and not math.isfinite(value)


def _key_not_text(value: Any) -> bool:
    return type(value) is dict and any(type(key) is not str for key in value)


class _Ext:
    """A client's ext value, decoded as this stand-in: `_check` refuses it as a type not
    allowed, naming the field it stands in (the decoder, refusing it at once, could
    name only the body)."""

    __slots__ = ("code",)

    def __init__(self, code: int) -> None:
        self.code = code


def _ext(code: int, _data: memoryview) -> _Ext:
    return _Ext(code)


def _kind_name(kind: type) -> str:
    """How a refusal names a decoded value's type (MessagePack's names where Python's
    differ)."""
    return "bin" if kind is bytes else "ext type" if kind is _Ext else kind.__name__


_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext)


class _Meta(msgspec.Struct):
    routed_experts: msgspec.Raw = msgspec.Raw()
    output_token_logprobs: msgspec.Raw = msgspec.Raw()


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


# Reads only the keys along the paths to the long values; every other value is
# stepped over unallocated. (A key given twice: the last counts, as in the full decode.)
_LAYOUT = msgspec.msgpack.Decoder(_Turn)
# The first byte of a str or bin (str 8/16/32, bin 8/16/32; fixstr never holds R3).
_STR_OR_BIN = frozenset({0xd9, 0xda, 0xdb, 0xc4, 0xc5, 0xc6})
_BIN32, _BIN32_HEADER = 0xC6, 5
# What the decoder is shown in place of a long value it need not read: an ext 32
# (header: 0xc9, 4 bytes of length, the type) of a type code of ours, covering the
# value's bytes (see `_decode_around`). Its length field bounds what it can cover.
_EXT32, _STAND_CODE, _STAND_HEADER = 0xC9, 101, 6
_STAND_MAX = (1 << 32) - 1 + _STAND_HEADER
# The map holding each long value, by its key.
_HOLDERS: dict[str, tuple[str | int, ...]] = {
    "input_ids": ("record", "request"),
    "output_token_logprobs": R3_PATH[:-1],
    "routed_experts": R3_PATH[:-1],
}
# A body this short has no long value to find.
_WORTH_A_LOOK = packed.MIN_ITEMS * 5
_UNDECODED: Any = object()  # `_decode_around` could not: decode the body as it is
_R3_VIEW: Any = object()  # the R3 bin: a view of the body, taken after the decode


@dataclass(frozen=True)
class Long:
    """A long value at `start:end` of a body's bytes (header included), and the key it
    is found under (its map: `_HOLDERS`)."""

    start: int
    end: int
    key: str


@dataclass(frozen=True)
class Layout:
    """Where a turn body's long values lie, from one typed pass."""

    r3: int = 0  # the R3 str or bin's bytes, header included (0: none found)
    # Values the decode may not need to read: the prompt, the output entries (if
    # packed: `packed`), an R3 bin 32.
    longs: tuple[Long, ...] = ()


_NO_LAYOUT = Layout()


def layout(raw: bytes | bytearray | memoryview) -> Layout:
    """The R3 payload's size and where the long values of a MessagePack body lie.

    A typed decode that allocates a few objects whatever the body (one choice only:
    `choices` of another length, or anything the typed pass cannot read, finds
    nothing); what it cannot read, the full decode refuses later. What the long
    values hold is read by `loads`, once the body's width is checked.
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
    candidates: list[tuple[str, msgspec.Raw]] = []
    r3 = 0
    if meta is not None and meta.routed_experts:
        with memoryview(meta.routed_experts) as view:
            r3, first = len(view), view[0]
        if first not in _STR_OR_BIN:
            r3 = 0
        elif first == _BIN32:
            candidates.append(("routed_experts", meta.routed_experts))
    if meta is not None and meta.output_token_logprobs:
        candidates.append(("output_token_logprobs", meta.output_token_logprobs))
    if record.request is not None and record.request.input_ids:
        candidates.append(("input_ids", record.request.input_ids))
    longs = []
    for key, value in candidates:
        start, size = _offset(raw, value), len(memoryview(value))
        if start >= 0 and _STAND_HEADER < size <= _STAND_MAX:
            longs.append(Long(start, start + size, key))
    return Layout(r3, tuple(longs))


def _offset(raw: bytes | bytearray | memoryview, view: Any) -> int:
    """Where `view` (of the typed pass, or an ext's data) starts in `raw`; -1 if it is
    not a view of `raw`'s bytes."""
    body, span = np.frombuffer(raw, np.uint8), np.frombuffer(view, np.uint8)
    start = int(span.ctypes.data - body.ctypes.data)
    return start if 0 <= start <= body.size - span.size else -1


def loads(raw: bytes | bytearray | memoryview, max_values: int = MAX_VALUES,
          found: Layout | None = None) -> Any:
    """Decode a request body strictly; the R3 payload may be a bin, nothing else may.
    A body of more than `max_values` values is a 413 before it is decoded (`width`):
    the header walk is skipped when the R3 bin leaves too few other bytes for that.

    `found`: the body's `layout`, if the caller has it (else it is read here when
    it can serve). In a bytearray, the long values are not decoded: a packed
    prompt becomes its ids (an int64 array), packed output entries a
    `packed.OutputEntries`, and an R3 bin 32 a read-only view of the body (no
    copy), which holds the bytearray: it cannot be resized while the value
    lives, and must not be written to. `_decode_around` says how.
    """
    if found is None and (len(raw) > max_values or
                          (isinstance(raw, bytearray) and len(raw) > _WORTH_A_LOOK)):
        found = layout(raw)
    check_msgpack(raw, max_values, found.r3 if found is not None else 0)
    value = _UNDECODED
    if found is not None and found.longs and isinstance(raw, bytearray):
        longs = _read(raw, found.longs)
        if longs:
            value = _decode_around(raw, longs)
    if value is _UNDECODED:
        value = _decode(raw, _DECODER)
    aside = [(holder, key, holder[key]) for holder, key in _allowed(value)]
    # The allowed values step aside for the walk (by place, not identity: b"" is shared).
    for holder, key, _ in aside:
        holder[key] = None
    try:
        _check(value)
    except InvalidRequest as exc:
        raise _named(exc, value) from None
    finally:
        for holder, key, kept in aside:
            holder[key] = kept
    return value


def _named(error: InvalidRequest, value: Any) -> InvalidRequest:
    """`error` naming the field where the refused value stands, as the JSON path's
    errors do (`record.response.choices[0].meta_info.output_token_logprobs[0][0]`);
    found by a second walk, on this error path only. A body too deep stays `body`."""
    offends = getattr(error, "offends", None)
    if offends is None:  # too deep, or not MessagePack at all: the body as a whole
        return error
    found = first_path(value, offends)  # the first such value, in document order
    if found is None or not found[0]:
        return error
    field = found[0]
    return InvalidRequest(f"{error.detail} ({field})", field=field, expected=error.expected,
                          actual=error.actual)


def loads_narrow(raw: bytes | bytearray | memoryview, max_values: int = MAX_VALUES,
                 found: Layout | None = None) -> Any:
    """`loads` for the narrowed wire: the same body and rules, the R3 bin (if a bin)
    read as `NarrowR3` (its width byte and values are judged with the turn)."""
    value = loads(raw, max_values, found)
    meta = _holder(value, _HOLDERS["routed_experts"])
    if meta is not None and isinstance(meta.get("routed_experts"), bytes | memoryview):
        meta["routed_experts"] = NarrowR3(meta["routed_experts"])
    return value


# The decoders of MessagePack turn bodies (whose R3 payload `layout` can find).
DECODERS = frozenset({loads, loads_narrow})


def _read(raw: bytearray, longs: tuple[Long, ...]) -> list[tuple[Long, Any]]:
    """What takes each long value's place: a packed list read (`packed`), or the R3
    view; lists that are not packed are left out (decoded as they come)."""
    out: list[tuple[Long, Any]] = []
    for long in longs:
        if long.key == "routed_experts":
            out.append((long, _R3_VIEW))
            continue
        span = np.frombuffer(raw, np.uint8, long.end - long.start, long.start)
        read = packed.prompt(span) if long.key == "input_ids" else packed.output_entries(span)
        if read is not None:
            out.append((long, read))
    return out


def _allowed(value: Any) -> list[tuple[dict[str, Any], str]]:
    """Where a decoded body holds a value the walk would refuse but is allowed: an R3
    bin (or its view), a packed prompt's array and packed output entries."""
    out: list[tuple[dict[str, Any], str]] = []
    meta = _holder(value, _HOLDERS["routed_experts"])
    if meta is not None:
        if isinstance(meta.get("routed_experts"), bytes | memoryview):
            out.append((meta, "routed_experts"))
        if type(meta.get("output_token_logprobs")) is packed.OutputEntries:
            out.append((meta, "output_token_logprobs"))
    request = _holder(value, _HOLDERS["input_ids"])
    if request is not None and type(request.get("input_ids")) is np.ndarray:
        out.append((request, "input_ids"))
    return out


def _decode(raw: bytes | bytearray | memoryview, decoder: msgspec.msgpack.Decoder[Any]) -> Any:
    """The full decode."""
    try:
        with gc_paused():
            return decoder.decode(raw)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"body is not valid MessagePack: {exc}", field="body",
                             expected="one complete MessagePack document",
                             actual="malformed MessagePack") from None


@dataclass(frozen=True, eq=False)
class _Stand:
    """What the decoder makes of the long value at `start` that `_decode_around` hid."""

    start: int


def _decode_around(raw: bytearray, longs: list[tuple[Long, Any]]) -> Any:
    """The full decode, with `longs` not read, each replaced by what goes with it:
    `_UNDECODED` when the decoded body does not hold them where the typed pass saw
    them (the caller then decodes it as it is).

    Each is shown to the decoder as an ext value of our own type code (its first
    bytes rewritten in the buffer, restored before this returns), which the decoder
    steps over without copying; then what was read of it takes its place. The ext
    hook knows each by where its data lies in the buffer; any other ext (a client's
    own, whatever its code) is refused as the plain decode refuses it.
    """
    hidden = {long.start + _STAND_HEADER: long.start for long, _ in longs}
    strays: list[int] = []

    def stand(code: int, data: memoryview) -> Any:
        if code != _STAND_CODE:
            return _Ext(code)
        start = hidden.get(_offset(raw, data))
        if start is None:  # not one we hid: the plain decode judges it
            strays.append(code)
            return None
        return _Stand(start)

    saved = [bytes(raw[long.start:long.start + _STAND_HEADER]) for long, _ in longs]
    try:
        for long, _ in longs:
            raw[long.start:long.start + _STAND_HEADER] = bytes((_EXT32,)) + \
                (long.end - long.start - _STAND_HEADER).to_bytes(4, "big") + \
                bytes((_STAND_CODE,))
        value = _decode(raw, msgspec.msgpack.Decoder(ext_hook=stand))
    finally:
        for (long, _), kept in zip(longs, saved, strict=True):
            raw[long.start:long.start + _STAND_HEADER] = kept
    if strays:
        return _UNDECODED
    holders = [_holder(value, _HOLDERS[long.key]) for long, _ in longs]
    for holder, (long, _) in zip(holders, longs, strict=True):
        placed = None if holder is None else holder.get(long.key)
        if type(placed) is not _Stand or placed.start != long.start:
            return _UNDECODED
    for holder, (long, read) in zip(holders, longs, strict=True):
        assert holder is not None
        # The view is taken once the buffer is restored.
        holder[long.key] = read if read is not _R3_VIEW else \
            memoryview(raw)[long.start + _BIN32_HEADER:long.end].toreadonly()
    return value


def _holder(value: Any, path: tuple[str | int, ...]) -> dict[str, Any] | None:
    """The map at `path` of a decoded body, if it is there."""
    node = value
    for key in path:
        if type(key) is str:
            if type(node) is not dict or key not in node:
                return None
        elif type(node) is not list or not node:
            return None
        node = node[key]
    return node if type(node) is dict else None


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
        name = _kind_name(type(value))
        raise _invalid(f"{name} is not allowed here", name, _not_allowed)
    if type(value) is float and not math.isfinite(value):  # a bare NaN document
        raise _invalid("non-finite float", "NaN or Infinity", _non_finite)
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
                raise _invalid("map keys must be strings", f"{type(bad).__name__} key",
                               _key_not_text)
        children, kinds, leaves, rows = level_of(containers)
        if not kinds <= _VALUES:
            kind = next(iter(kinds - _VALUES))
            name = _kind_name(kind)
            raise _invalid(f"{name} is not allowed here", name, _not_allowed)
        if float in kinds and not _all_finite(children, leaves):
            raise _invalid("non-finite float", "NaN or Infinity", _non_finite)
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
