"""Strict MessagePack in (turn bodies), MessagePack out (event pages).

Owns the rules that make a MessagePack turn body the same value its JSON
twin would be (docs/ingest.md): string map keys only, no ext types (a
timestamp included), finite floats, the JSON path's nesting limit, no
trailing bytes, and a bin in exactly one place — the turn's
`record.response.choices[0].meta_info.routed_experts`, where it holds the raw
little-endian int32 R3 bytes. Every failure is an `InvalidRequest` naming
`body`. Also owns the media types that mean MessagePack. No I/O; which wire a
request uses is the API's decision.
"""

from __future__ import annotations

import math
from itertools import chain, compress
from typing import Any

import msgspec

from app.domain.errors import InvalidRequest
from app.domain.wire.jsonio import MAX_DEPTH, containers_in, gc_paused, level_of
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
    """The map holding a bin at `R3_PATH` of a decoded body, if one stands there."""
    node = value
    for key in R3_PATH[:-1]:
        if type(key) is str:
            if type(node) is not dict or key not in node:
                return None
        elif type(node) is not list or not node:
            return None
        node = node[key]
    if type(node) is dict and type(node.get(R3_PATH[-1])) is bytes:
        return node
    return None


class _Meta(msgspec.Struct):
    routed_experts: msgspec.Raw = msgspec.Raw()


class _Choice(msgspec.Struct):
    meta_info: _Meta | None = None


class _Response(msgspec.Struct):
    choices: tuple[_Choice] | None = None


class _Record(msgspec.Struct):
    response: _Response | None = None


class _Turn(msgspec.Struct):
    record: _Record | None = None


# Reads only the keys along `R3_PATH`; every other value is stepped over unallocated.
_R3_SPAN = msgspec.msgpack.Decoder(_Turn)
# The first byte of a str or bin (str 8/16/32, bin 8/16/32; fixstr never holds R3).
_STR_OR_BIN = frozenset({0xd9, 0xda, 0xdb, 0xc4, 0xc5, 0xc6})


def r3_span(raw: bytes | bytearray | memoryview) -> int:
    """The bytes of the str or bin at `R3_PATH` of a MessagePack body, header included
    (0: none found, or the body is not shaped so that the typed pass can tell).

    A typed decode that allocates a few objects whatever the body (one choice only:
    `choices` of another length is "not found"); what it cannot read, the full
    decode refuses later.
    """
    try:
        turn = _R3_SPAN.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return 0
    record = turn.record
    response = record.response if record is not None else None
    choices = response.choices if response is not None else None
    meta = choices[0].meta_info if choices else None
    if meta is None or not meta.routed_experts:
        return 0
    with memoryview(meta.routed_experts) as span:
        return len(span) if span[0] in _STR_OR_BIN else 0


def loads(raw: bytes | bytearray | memoryview, max_values: int = MAX_VALUES) -> Any:
    """Decode a request body strictly; the R3 payload may be a bin, nothing else may.
    A body of more than `max_values` values is a 413 before it is decoded (`width`):
    the header walk is skipped when the R3 bin leaves too few other bytes for that."""
    check_msgpack(raw, max_values, r3_span(raw) if len(raw) > max_values else 0)
    try:
        with gc_paused():
            value = _DECODER.decode(raw)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"body is not valid MessagePack: {exc}", field="body",
                             expected="one complete MessagePack document",
                             actual="malformed MessagePack") from None
    holder = _r3_holder(value)
    if holder is None:
        _check(value)
        return value
    # The one allowed bin steps aside for the walk (by place, not identity: b"" is shared).
    payload = holder["routed_experts"]
    holder["routed_experts"] = None
    try:
        _check(value)
    finally:
        holder["routed_experts"] = payload
    return value


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
