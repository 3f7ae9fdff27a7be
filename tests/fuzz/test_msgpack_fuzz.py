"""Corrupted MessagePack turns: the decoder and the HTTP append reject each with a 4xx
problem, store nothing, and never fail any other way (docs/ingest.md).

The same valid second turn as `test_turn_fuzz.py`, sent as MessagePack with
its R3 as a bin, broken one way at a time: a bin of the wrong length, wrong
offsets, numbers out of range, non-finite floats (float64 and float32) at
number paths, a bin / an ext / a timestamp / a non-string key at any path,
trailing or missing bytes, over-deep nesting, a wrong type at a validated
path, a missing key. Any MessagePack value at any path is either stored
losslessly (read back as JSON carries it) and then equal to its JSON twin,
or rejected with nothing stored.
"""

from __future__ import annotations

import datetime
import struct
import uuid
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain import msgpackio
from app.domain.errors import DomainError
from app.domain.turn import json_carried, parse_turn
from app.simulator import fold_in_memory
from tests.fuzz.budget import DERANDOMIZE, examples
from tests.fuzz.test_turn_fuzz import (
    HTTP,
    LOGPROB,
    NUMBERS,
    PAYLOAD,
    REQUIRED,
    START,
    TYPED,
    assert_problem,
    first_turn,
    get_at,
    open_spec,
    paths,
    second_turn,
    set_at,
    stored,
)
from tests.wire import MSGPACK, to_msgpack, with_bin

INT64 = st.integers(-(2**63), 2**64 - 1)
SENTINEL = 0.123456789012345
any_msgpack = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats(allow_nan=False, allow_infinity=False)
    | st.text() | st.binary(max_size=8)
    | st.builds(msgspec.msgpack.Ext, st.integers(0, 127), st.binary(max_size=4))
    | st.just(datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text() | st.integers(-5, 5), inner, max_size=3),
    max_leaves=6)


def base() -> dict[str, Any]:
    body: dict[str, Any] = with_bin(second_turn())
    return body


def encode(body: Any) -> bytes:
    return msgspec.msgpack.encode(body)


@st.composite
def bad_bin(draw: st.DrawFn) -> bytes:
    body = base()
    payload = get_at(body, PAYLOAD)
    size = draw(st.integers(1, 2 * len(payload)).filter(lambda n: n != len(payload)))
    set_at(body, PAYLOAD, (payload * 3)[:size])
    return encode(body)


@st.composite
def wrong_offset(draw: st.DrawFn) -> bytes:
    body = base()
    set_at(body, START, draw(INT64.filter(lambda s: s != 4)))
    return encode(body)


@st.composite
def huge_number(draw: st.DrawFn) -> bytes:
    body = base()
    # cached_tokens is never refused (a count that is not one counts 0), as on the JSON
    # wire (tests/fuzz/test_turn_fuzz.py); it stays in the non-finite cases.
    path = draw(st.sampled_from([p for p in NUMBERS if p[-1] != "cached_tokens"]))
    if path == ("parent",):
        body["parent"] = 0
    value = draw(st.integers(2**53, 2**64 - 1) | st.integers(-(2**63), -1)
                 | st.sampled_from([1e300, -1e300, 2.0**64, -(2.0**70)]))
    set_at(body, path, value)
    return encode(body)


@st.composite
def non_finite(draw: st.DrawFn) -> bytes:
    body = base()
    path = draw(st.sampled_from([*NUMBERS, LOGPROB, ("record", "request", "temperature"),
                                 ("metadata", "x")]))
    set_at(body, path, SENTINEL)
    raw = encode(body)
    old = b"\xcb" + struct.pack(">d", SENTINEL)
    assert raw.count(old) == 1
    value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    new = draw(st.sampled_from([b"\xcb" + struct.pack(">d", value),
                                b"\xca" + struct.pack(">f", value)]))
    return raw.replace(old, new)


@st.composite
def foreign_value(draw: st.DrawFn) -> bytes:
    """A bin, an ext or a timestamp anywhere but the R3 payload."""
    body = base()
    path = draw(st.sampled_from([p for p in paths(body) if p != PAYLOAD]))
    set_at(body, path, draw(st.binary(max_size=8)
                            | st.builds(msgspec.msgpack.Ext, st.integers(0, 127),
                                        st.binary(max_size=4))
                            | st.just(datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC))))
    return encode(body)


@st.composite
def foreign_key(draw: st.DrawFn) -> bytes:
    body = base()
    maps = [()] + [p for p in paths(body) if isinstance(get_at(body, p), dict)]
    target = get_at(body, draw(st.sampled_from(maps)))
    target[draw(st.integers(-5, 5) | st.binary(max_size=4) | st.none() | st.booleans())] = 1
    return encode(body)


@st.composite
def deep_nesting(draw: st.DrawFn) -> bytes:
    body = base()
    set_at(body, draw(st.sampled_from(paths(body))), "__deep__")
    depth = draw(st.integers(65, 20_000))
    opener = draw(st.sampled_from([b"\x91", b"\x81\xa1k"]))  # [x] or {"k": x}
    return encode(body).replace(b"\xa8__deep__", opener * depth + b"\x00")


@st.composite
def wrong_type(draw: st.DrawFn) -> bytes:
    body = base()
    path, accepts = draw(st.sampled_from(list(TYPED.items())))
    if path == PAYLOAD:
        def accepts(v: Any) -> bool:
            return isinstance(v, str | bytes)
    value = draw(any_msgpack.filter(lambda v: not accepts(v) and v is not None))
    set_at(body, path, value)
    return encode(body)


@st.composite
def missing_key(draw: st.DrawFn) -> bytes:
    body = base()
    path = draw(st.sampled_from(REQUIRED))
    del get_at(body, path[:-1])[path[-1]]
    return encode(body)


@st.composite
def framing(draw: st.DrawFn) -> bytes:
    raw = to_msgpack(second_turn())
    cut = draw(st.integers(0, len(raw) - 1))
    extra = draw(st.binary(min_size=1, max_size=8))
    return draw(st.sampled_from([raw[:cut], raw + extra]))


CORRUPTIONS = {
    "bad_bin": bad_bin(),
    "wrong_offset": wrong_offset(),
    "huge_number": huge_number(),
    "non_finite": non_finite(),
    "foreign_value": foreign_value(),
    "foreign_key": foreign_key(),
    "deep_nesting": deep_nesting(),
    "wrong_type": wrong_type(),
    "missing_key": missing_key(),
    "framing": framing(),
}
any_corruption = st.one_of(*CORRUPTIONS.values())


def test_the_uncorrupted_turn_decodes_to_its_json_twin():
    value = msgpackio.loads(to_msgpack(second_turn()))
    assert json_carried(value["record"]) == second_turn()["record"]


@settings(max_examples=examples(400), deadline=None, derandomize=DERANDOMIZE)
@given(raw=any_corruption)
def test_validator_rejects_every_corruption_with_a_domain_error(raw):
    state, _ = fold_in_memory(open_spec("fz"), [first_turn()])
    with pytest.raises(DomainError) as info:
        state.attach(parse_turn(msgpackio.loads(raw), state.definition), 1024)
    assert 400 <= info.value.http_status < 500
    assert len(state.nodes) == 1


@settings(max_examples=examples(300), deadline=None, derandomize=DERANDOMIZE)
@given(raw=st.binary(max_size=512) | any_corruption.map(lambda b: b[:len(b) // 2]))
def test_decoder_fails_only_with_invalid_request(raw):
    try:
        msgpackio.loads(raw)
    except DomainError as exc:
        assert exc.http_status == 422 and exc.field == "body"


async def fresh_session(client) -> str:
    sid = f"fz-{uuid.uuid4().hex}"
    assert (await client.post("/v1/sessions", json=open_spec(sid))).status_code == 201
    r = await client.post(f"/v1/sessions/{sid}/turns", content=to_msgpack(first_turn()),
                          headers={"content-type": MSGPACK})
    assert r.status_code == 201, r.text
    return sid


async def post_raw(client, sid: str, raw: bytes):
    return await client.post(f"/v1/sessions/{sid}/turns", content=raw,
                             headers={"content-type": MSGPACK})


@pytest.mark.parametrize("kind", CORRUPTIONS)
@HTTP
@given(data=st.data())
async def test_append_rejects_corruption_and_stores_nothing(client, kind, data):
    raw = data.draw(CORRUPTIONS[kind])
    sid = await fresh_session(client)
    assert_problem(await post_raw(client, sid, raw))
    num_nodes, events = await stored(client, sid)
    assert num_nodes == 1 and len(events) == 2


@HTTP
@given(data=st.data())
async def test_any_value_at_any_path_is_stored_losslessly_or_rejected(client, data):
    body = base()
    path = data.draw(st.sampled_from(paths(body)))
    set_at(body, path, data.draw(any_msgpack))
    sid = await fresh_session(client)
    r = await post_raw(client, sid, encode(body))
    num_nodes, events = await stored(client, sid)
    if r.status_code == 201:
        assert num_nodes == 2 and len(events) == 3
        carried = json_carried(body["record"])
        assert events[2]["record"] == carried
        # The same turn as JSON carries it is the same turn.
        twin = {**body, "record": carried}
        again = await client.post(f"/v1/sessions/{sid}/turns", json=twin)
        assert again.status_code == 200, again.text
    else:
        assert_problem(r)
        assert num_nodes == 1 and len(events) == 2
