"""Strict JSON in, canonical JSON out.

Owns the one place where request bytes become Python values: non-finite
numbers (NaN, ±Infinity, 1e999) and over-deep nesting are rejected as
`InvalidRequest` instead of surfacing later as database errors. Also owns the
canonical serialization used for idempotency fingerprints and for storing
JSON losslessly as text. No I/O.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain, compress
from typing import Annotated, Any

import msgspec

from app.domain.errors import InvalidRequest
from app.domain.wire.validate import CONVERT_REFUSED
from app.domain.wire.width import MAX_VALUES, check_json, count_bytes

MAX_DEPTH = 64
_OPENINGS = tuple(b"[{")


class _NonFinite(Exception):
    """A non-finite number met while parsing (its text): refused once its field is known."""


class _Found:
    """Where a non-finite number stands in a refused body, found for the field's name."""

    def __init__(self, text: str) -> None:
        self.text = text


def _reject_constant(name: str) -> Any:
    raise _NonFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _reject_constant(text)
    return value


def _mark_float(text: str) -> Any:
    return _Found(text) if not math.isfinite(float(text)) else 0.0


def _non_finite(raw: bytes | bytearray | str, text: str) -> InvalidRequest:
    """The refusal of a body holding a non-finite number (NaN, ±Infinity, 1e999), naming
    the field where the first one stands (`reward`, `labels.x`, `records[2].y`): the
    body is parsed again with the numbers marked, on this error path only."""
    try:
        value = json.loads(raw, parse_constant=_Found, parse_float=_mark_float)
    except (ValueError, RecursionError):
        value = None
    found = first_path(value, lambda item: type(item) is _Found)
    field = "body"
    if found is not None:
        field, text = found[0] or "body", found[1].text
    return InvalidRequest(
        f"non-finite number {text} is not valid JSON here"
        + (f" ({field})" if field != "body" else ""),
        field=field,
        expected="a finite JSON number",
        actual=text,
    )


def first_path(value: Any, offends: Callable[[Any], bool]) -> tuple[str, Any] | None:
    """The first value (depth first, in document order) for which `offends` is true,
    and its field name as problems give it (`reward`, `labels.x`, `records[2].y`; ""
    for the whole value). For naming the field of a refused body, on the error path
    only: a Python step per value."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if offends(item):
            return path, item
        if type(item) is dict:
            stack.extend((f"{path}.{key}" if path else str(key), child)
                         for key, child in reversed(item.items()))
        elif type(item) is list:
            stack.extend((f"{path}[{index}]", child)
                         for index, child in reversed(list(enumerate(item))))
    return None


def _depth(value: Any) -> int:
    """Nesting depth (up to `MAX_DEPTH + 1`), one level at a time.

    Each level's children are gathered and type-scanned by C-level iterators
    (`chain`, `map`), so 2k `[logprob, id]` pairs or a 20k-token prompt cost a
    few list operations, not a Python step per container.
    """
    level = deepest = 0
    containers = [value] if type(value) is dict or type(value) is list else []
    while containers and level <= MAX_DEPTH:
        level += 1
        children, kinds, _, rows = level_of(containers)
        if rows:  # lists of numbers one level down
            deepest = level + 1
        if dict not in kinds and list not in kinds:
            break
        containers = containers_in(children)
    return min(max(level, deepest), MAX_DEPTH + 1)


_CONTAINERS = frozenset({dict, list})
# A list this long is type-scanned on its own: one pass tells whether its items
# need looking at further (a 20k-token `input_ids` holds only ints).
_LONG = 256
_INTS = frozenset({int})
_IS_DICT = frozenset({dict}).__contains__
_IS_LIST = frozenset({list}).__contains__
_INT_LIST = list[int]
_LISTS = frozenset({list})
# Lists of numbers a float64 holds, NaN and infinities refused (ints are converted).
_FINITE_ROWS = list[tuple[Annotated[float, msgspec.Meta(ge=-sys.float_info.max,
                                                        le=sys.float_info.max)], ...]]


def _types(items: list[Any]) -> frozenset[type] | set[type]:
    """The set of types of `items`. An all-int list (a prompt's token ids) is told by
    msgspec's typed `convert` at a fifth of the cost of `set(map(type, ...))`: it
    refuses booleans, floats and ints beyond 64 bits, which then take the general scan."""
    try:
        msgspec.convert(items, _INT_LIST)
    except CONVERT_REFUSED:
        return set(map(type, items))
    return _INTS


def containers_in(children: list[Any]) -> list[Any]:
    """The dicts and lists among `children`, filtered by C-level iterators only
    (by exact type: decoders make no subclasses; a type test is ~2x `isinstance`)."""
    return list(compress(children, map(_CONTAINERS.__contains__, map(type, children))))


def _finite_rows(items: list[Any]) -> bool:
    """Every item of `items` a list of finite numbers (ints, floats; no booleans):
    one typed msgspec pass, a fifth of walking a turn's 2k `[logprob, id]` pairs a
    level at a time. False says nothing: the general walk then decides."""
    try:
        msgspec.convert(items, _FINITE_ROWS)
    except CONVERT_REFUSED:
        return False
    return True


def level_of(containers: list[Any]) -> tuple[list[Any], set[type], list[list[Any]], bool]:
    """One level of a walk: (children, kinds, leaves, rows).

    `kinds` is the set of types of every child of `containers` (dict values,
    list items). `children` holds those children, except the items of a long
    list with no dict or list among them: such lists are `leaves`, their items
    already typed and with nothing below them; and except the items of a long
    list of lists of finite numbers only (`_finite_rows`): `rows` tells whether
    there was one, those lists being the next level's containers with nothing
    below them and nothing a walk would refuse.
    """
    dicts = list(compress(containers, map(_IS_DICT, map(type, containers))))
    lists = list(compress(containers, map(_IS_LIST, map(type, containers)))) if dicts \
        else containers
    kinds: set[type] = set()
    leaves: list[list[Any]] = []
    rows = False
    if any(map(_LONG.__le__, map(len, lists))):
        short = []
        for items in lists:
            if len(items) < _LONG:
                short.append(items)
                continue
            types = _types(items)
            kinds |= types
            if not types & _CONTAINERS:
                leaves.append(items)
            elif types == _LISTS and _finite_rows(items):
                rows = True
            else:
                short.append(items)
        lists = short
    children = list(chain(chain.from_iterable(map(dict.values, dicts)),
                          chain.from_iterable(lists)))
    kinds.update(map(type, children))
    return children, kinds, leaves, rows


def _too_deep() -> InvalidRequest:
    return InvalidRequest(
        "JSON nesting is too deep",
        field="body",
        expected=f"at most {MAX_DEPTH} levels of nesting",
        actual="deeper",
    )


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic-garbage collection while a body is decoded.

    Decoding allocates thousands of containers (one list per `[logprob, id]`
    pair), which would trigger collections that walk every object of the
    process; none of them can be garbage yet. Synchronous, so nothing else runs
    meanwhile.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def loads(raw: bytes | bytearray | str, max_values: int = MAX_VALUES) -> Any:
    """Parse a request body; every failure is an `InvalidRequest` naming `body`, and a
    body that may decode into more than `max_values` values is a 413 (`width`).

    msgspec is the fast path (exact floats and big integers, ~5x the standard
    library on R3-sized bodies); whatever it refuses (lone surrogate escapes,
    out-of-range numbers, malformed text) the standard library parses again
    with our hooks and decides.
    """
    check_json(raw, max_values)
    try:
        with gc_paused():
            value = msgspec.json.decode(raw)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError:
        value = _loads_stdlib(raw)
    # Each container opens with a `[` or `{` byte (strings may add more): with at most
    # MAX_DEPTH of them the walk is skipped — on a 40k-token prompt it costs 4x the parse.
    if _openings(raw) > MAX_DEPTH and _depth(value) > MAX_DEPTH:
        raise _too_deep()
    return value


def _openings(raw: bytes | bytearray | str) -> int:
    """An upper bound of the containers in JSON text `raw` (stops past MAX_DEPTH)."""
    if isinstance(raw, str):
        return raw.count("[") + raw.count("{")
    return count_bytes(raw, _OPENINGS, MAX_DEPTH)


def loads_stored(raw: bytes | str) -> Any:
    """Parse JSON this store wrote itself (an event payload): it passed `loads` when it
    came in, so the nesting walk is skipped — on a long session's fold it costs more
    than the parse. Parsing is the same as `loads` (msgspec, then the standard library)."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return _loads_stdlib(raw)


def _loads_stdlib(raw: bytes | bytearray | str) -> Any:
    try:
        # JSON is UTF-8 (RFC 8259 §8.1): given bytes, the standard library would guess
        # UTF-16 or UTF-32 from the first bytes and take a byte-order mark; decoded
        # here first, such a body is refused as msgspec refuses it.
        text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except _NonFinite as exc:
        raise _non_finite(raw, str(exc)) from None
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(
            f"body is not valid JSON: {exc}",
            field="body",
            expected="a JSON document",
            actual="malformed JSON",
        ) from None


NOT_JSON: Any = object()  # `plain_json`'s answer for text that is not JSON


def plain_json(raw: bytes | bytearray) -> Any:
    """`raw` parsed as any JSON text (RFC 8259), whether or not `loads` takes it: a
    number out of float range reads as an infinity, nesting is not bounded; NaN and
    Infinity (not JSON), text that is not UTF-8, and nesting too deep to parse at all
    give `NOT_JSON`. For telling a body the store refuses (`loads` raised) from one
    that is no JSON at all; never for a value to keep."""
    try:
        return json.loads(str(raw, "utf-8"), parse_constant=_reject_constant,
                          parse_int=_any_int)
    except (_NonFinite, RecursionError, ValueError, UnicodeDecodeError):
        return NOT_JSON


def _any_int(text: str) -> int:
    """A JSON integer; one past Python's limit on converting digits (4,300 by default,
    JSON has none) reads as 2^64, out of every range the store takes, which is all
    `plain_json`'s reader asks of it."""
    try:
        return int(text)
    except ValueError:
        return 1 << 64


def dumps(value: Any) -> str:
    """Compact JSON text of any value `loads` produced (UTF-8 safe, NUL escaped).

    msgspec is the fast path; a lone surrogate (valid in JSON escapes, not in
    UTF-8) falls back to ASCII-escaped standard-library output.
    """
    try:
        return msgspec.json.encode(value).decode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def dumps_bytes(value: Any) -> bytes:
    """`dumps` as bytes, for response bodies."""
    try:
        return msgspec.json.encode(value)
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False).encode("ascii")


def canonical(value: Any) -> str:
    """Key-sorted compact JSON: equal values give equal text."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False,
                      sort_keys=True)


def fingerprint(value: Any) -> str:
    return hashlib.sha256(canonical(value).encode("ascii")).hexdigest()


def strict_equal(a: Any, b: Any) -> bool:
    """JSON equality that also tells `1`, `1.0` and `true` apart (Python's `==` does not)."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            if x.keys() != y.keys():
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif x != y:
            return False
    return True
