"""The strict decoders' shortcuts keep their rules (app.domain.wire: jsonio, msgpackio, width).

The nesting and strictness walks type-scan a long list (>= 256 items) on its
own and only look below it when it holds containers; the MessagePack value
count is skipped when the turn's R3 bin leaves too few other bytes to reach
the limit. Each is checked against a plain recursive oracle, at the edges of
those shortcuts: a NaN, a bin, a non-string key or a deep nest inside or just
beside a long list, and bodies one value under, at and over the limit, with
and without a bin the typed pass can locate.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.errors import InvalidRequest, TooLarge
from app.domain.wire import jsonio, msgpackio, width
from tests.fuzz.budget import DERANDOMIZE, examples

LONG = 256  # the walks' long-list size (jsonio._LONG)
PROPS = settings(max_examples=examples(150), deadline=None, derandomize=DERANDOMIZE)


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def values(value: Any) -> int:
    """How many values `value` decodes into: containers, keys and scalars."""
    if isinstance(value, dict):
        return 1 + sum(values(k) + values(v) for k, v in value.items())
    if isinstance(value, list):
        return 1 + sum(map(values, value))
    return 1


def strict(value: Any, level: int = 0) -> bool:
    """The MessagePack rules, recursively: what `msgpackio.loads` must accept."""
    if isinstance(value, dict):
        if level + 1 > jsonio.MAX_DEPTH or not all(type(k) is str for k in value):
            return False
        return all(strict(v, level + 1) for v in value.values())
    if isinstance(value, list):
        return level + 1 <= jsonio.MAX_DEPTH and all(strict(v, level + 1) for v in value)
    if type(value) is float:
        return math.isfinite(value)
    return type(value) in (str, int, bool, type(None))  # (no bin: none is at the R3 path)


def nested(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


scalars = st.one_of(st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True),
                    st.booleans(), st.none(), st.text(max_size=3), st.binary(max_size=2))
odd = st.one_of(st.just(math.nan), st.just(math.inf), st.just(b"x"), st.just({1: 2}),
                st.builds(nested, st.integers(60, 66)), st.just([[0.5, 1]] * 3))


@st.composite
def long_list(draw: st.DrawFn) -> list[Any]:
    """A long list of ints (an `input_ids`), maybe with one odd item somewhere."""
    items: list[Any] = list(range(draw(st.integers(LONG - 2, LONG + 2))))
    if draw(st.booleans()):
        items[draw(st.integers(0, len(items) - 1))] = draw(odd)
    return items


def bodies() -> st.SearchStrategy[Any]:
    leaves = st.one_of(scalars, long_list(), odd)
    return st.recursive(leaves, lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.text(max_size=3), kids, max_size=4)), max_leaves=8)


@PROPS
@given(bodies())
def test_msgpack_strictness_is_the_recursive_rules(value):
    raw = msgspec.msgpack.encode(value)
    if strict(value):
        assert jsonio.dumps(msgpackio.loads(raw)) == jsonio.dumps(value)
    else:
        with pytest.raises(InvalidRequest):
            msgpackio.loads(raw)


@PROPS
@given(bodies())
def test_json_nesting_is_the_recursive_depth(value):
    json_value = msgspec.json.decode(msgspec.json.encode(_jsonable(value)))
    assert min(jsonio._depth(json_value), jsonio.MAX_DEPTH + 1) == \
        min(depth(json_value), jsonio.MAX_DEPTH + 1)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes) or (type(value) is float and not math.isfinite(value)):
        return None
    return value


@pytest.mark.parametrize("where", [0, LONG // 2, LONG - 1])
@pytest.mark.parametrize(("odd_item", "why"), [
    (math.nan, "non-finite"), (-math.inf, "non-finite"), (b"x", "bin"),
    ({1: 2}, "map keys"), (msgspec.msgpack.Ext(1, b"x"), "ext"),
])
def test_an_odd_item_of_a_long_list_is_refused(where, odd_item, why):
    ids: list[Any] = list(range(LONG))
    ids[where] = odd_item
    with pytest.raises(InvalidRequest, match=why):
        msgpackio.loads(msgspec.msgpack.encode({"record": {"request": {"input_ids": ids}}}))


def test_a_deep_nest_inside_a_long_list_is_refused_on_both_wires():
    ok = {"ids": [*range(LONG), nested(jsonio.MAX_DEPTH - 2)]}
    deep = {"ids": [*range(LONG), nested(jsonio.MAX_DEPTH - 1)]}
    msgpackio.loads(msgspec.msgpack.encode(ok))
    jsonio.loads(msgspec.json.encode(ok))
    with pytest.raises(InvalidRequest, match="too deep"):
        msgpackio.loads(msgspec.msgpack.encode(deep))
    with pytest.raises(InvalidRequest, match="too deep"):
        jsonio.loads(msgspec.json.encode(deep))


def turn_with(payload: Any, filler: int, choices: int = 1) -> dict[str, Any]:
    meta = {"routed_experts": payload}
    return {"event_id": "e", "filler": [0] * filler,
            "record": {"response": {"choices": [{"meta_info": meta}] + [{}] * (choices - 1)}}}


@pytest.mark.parametrize("choices", [1, 2])
@pytest.mark.parametrize("payload", [b"\x00" * 4000, "A" * 4000])
@pytest.mark.parametrize("over", [-1, 0, 1])
def test_values_are_refused_exactly_over_the_limit_whatever_the_r3_bin(payload, choices,
                                                                        over):
    """A body far longer than the limit (the bin), with one value under, at and over it:
    refused only over it, whether the typed pass found the bin (1 choice) or not (2)."""
    limit = 1000
    body = turn_with(payload, 0, choices)
    body["filler"] = [0] * (limit - values(body) + over)
    raw = msgspec.msgpack.encode(body)
    assert values(body) == limit + over
    assert len(raw) > 4 * limit
    assert (msgpackio.layout(raw).r3 > 0) == (choices == 1)
    if over > 0:
        with pytest.raises(TooLarge):
            msgpackio.loads(raw, limit)
    else:
        msgpackio.loads(raw, limit)


def test_the_walk_is_skipped_only_when_the_rest_is_under_the_limit():
    """`scalar`'s bound, at its edge: the bytes outside the bin plus the bin's one value."""
    limit = 1000
    raw = msgspec.msgpack.encode(turn_with(b"\x00" * 4000, 0))
    span = msgpackio.layout(raw).r3
    assert span == 3 + 4000  # bin 16: its header and its bytes
    # Many one-byte values after the bin: a body of exactly `limit + 1` values, its
    # non-bin bytes `limit` (the bound says at most limit + 1: it must walk, and refuse).
    body = turn_with(b"\x00" * 4000, 0)
    body["filler"] = [0] * (limit + 1 - values(body))
    raw = msgspec.msgpack.encode(body)
    with pytest.raises(TooLarge):
        width.check_msgpack(raw, limit, msgpackio.layout(raw).r3)
    body["filler"].pop()
    raw = msgspec.msgpack.encode(body)
    width.check_msgpack(raw, limit, msgpackio.layout(raw).r3)


@pytest.mark.parametrize("raw", [
    msgspec.msgpack.encode({"record": {"response": {"choices": [{"meta_info": {
        "routed_experts": [1, 2]}}]}}}),  # not a str or bin
    msgspec.msgpack.encode({"record": {"response": {"choices": []}}}),
    msgspec.msgpack.encode({1: 2, "record": {}}),  # not decodable typed
    msgspec.msgpack.encode({"record": {"response": {"choices": {"0": 1}}}}),
    b"\x81\xa6record" + b"\x91" * 5000 + b"\xc0",  # deeper than the typed pass recurses
    b"\xc1",
    b"",
])
def test_a_body_the_typed_pass_cannot_read_has_no_span(raw):
    assert msgpackio.layout(raw).r3 == 0


@pytest.mark.parametrize("limit_over_values", [-1, 0, 1])
def test_the_scalar_bound_is_exact_when_every_other_value_is_one_byte(limit_over_values):
    """[bin, 0, 0, ...]: the bytes outside the bin are one per value, so the bound
    `len - scalar + 1` is the count itself; the walk runs (and refuses) exactly
    when the limit is under it."""
    items: list[Any] = [b"\x00" * 5000, *[0] * 14]  # a fixarray of 15
    raw = msgspec.msgpack.encode(items)
    bin_bytes = 3 + 5000
    count = 1 + len(items)
    assert len(raw) - bin_bytes + 1 == count
    limit = count + limit_over_values
    if limit < count:
        with pytest.raises(TooLarge):
            width.check_msgpack(raw, limit, bin_bytes)
    else:
        width.check_msgpack(raw, limit, bin_bytes)


def test_a_msgpack_refusal_names_a_value_of_the_kind_it_refused():
    # A review's finding: the refusal named the first faulty value of any kind (a bin
    # at metadata.x.b) while its detail spoke of another (the NaN at `reward`).


    from app.domain.errors import InvalidRequest
    from app.domain.wire import msgpackio

    body = {"event_id": "e", "metadata": {"x": {"b": b"xx"}}, "reward": float("nan")}
    try:
        msgpackio.loads(msgspec.msgpack.encode(body))
    except InvalidRequest as refused:
        assert "non-finite" in refused.detail and refused.field == "reward"
    else:
        raise AssertionError("a NaN was accepted")
