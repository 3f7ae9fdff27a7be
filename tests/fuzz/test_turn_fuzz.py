"""Corrupted turns on every wire, JSON, MessagePack and the narrowed MessagePack: the
parser and the HTTP append
reject each with a 4xx problem, store nothing, and never fail any other way
(docs/ingest.md).

Every example starts from one valid second turn of an addition-R3 session
(a parent with rows [0, 4), the turn's patch [4, 7)), encoded by one wire —
JSON, MessagePack with its R3 as a bin, or the narrowed wire with its R3 as a
width byte and uint8 values (`tests/wire.py`) — and breaks it
one way. The same properties hold on every wire, so they are written once and
run per wire: a wrong R3 payload length, wrong offsets, huge numbers,
non-finite numbers in the raw bytes, over-deep nesting, a wrong type at a
validated path, a missing required key; MessagePack adds what only it can
carry (a bin / an ext / a timestamp / a non-string key at any path, trailing
or missing bytes). The domain property runs the pure parse + attach on many
examples; the HTTP properties run the real append and then check that the session
still has one node and two events (the rejection property sends a test's examples to
one session, as nothing is stored; the any-value property opens one per example).
Any value at any path is either stored losslessly (read back as JSON carries
it, and then a repeat of its JSON twin) or rejected with nothing stored.
"""

from __future__ import annotations

import datetime
import json
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.domain.body.turn import json_carried, parse_turn
from app.domain.errors import DomainError
from app.domain.wire import jsonio, msgpackio
from app.domain.wire.r3 import NarrowR3
from app.sim.simulator import fold_in_memory
from tests.factory import open_body, r3_b64, turn
from tests.fuzz.budget import DERANDOMIZE, examples
from tests.wire import MSGPACK, NARROW, narrowed, to_msgpack, with_bin

L, K = 2, 2
Path = tuple[str | int, ...]
META: Path = ("record", "response", "choices", 0, "meta_info")
REQUEST: Path = ("record", "request")
PAYLOAD: Path = (*META, "routed_experts")
START: Path = (*REQUEST, "routed_experts_start_len")
LOGPROB: Path = (*META, "output_token_logprobs", 1, 0)
HTTP = settings(max_examples=examples(25), deadline=None, derandomize=DERANDOMIZE,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def open_spec(sid: str) -> dict[str, Any]:
    return open_body(sid, pause_generation_mode="in_place", r3={"num_layers": L}, spec=True)


def first_turn() -> dict[str, Any]:
    return turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0, event_id="first")


def second_turn() -> dict[str, Any]:
    """Valid on top of `first_turn`: prompt extends its tokens, patch rows [4, 7)."""
    return turn([1, 2, 3, 4, 5, 6], [7, 8], r3=r3_b64(3, L, K, seed=1), start=4,
                event_id="second", spec=(2, 1, 3), metadata={"tito_session_mismatch": [
                    {"type": "assistant_text", "segment_index": 3}]})


def get_at(body: Any, path: Path) -> Any:
    for key in path:
        body = body[key]
    return body


def set_at(body: Any, path: Path, value: Any) -> None:
    get_at(body, path[:-1])[path[-1]] = value


def paths(value: Any, prefix: Path = ()) -> list[Path]:
    """Every path of a JSON value, containers and leaves."""
    found: list[Path] = []
    if isinstance(value, dict):
        items: list[tuple[str | int, Any]] = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        items = []
    for key, child in items:
        found.append((*prefix, key))
        found += paths(child, (*prefix, key))
    return found


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def is_integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Validated paths of the valid second turn, each with the values it accepts.
TYPED: dict[Path, Callable[[Any], bool]] = {
    ("event_id",): lambda v: isinstance(v, str),
    ("record",): lambda v: isinstance(v, dict),
    (*REQUEST,): lambda v: isinstance(v, dict),
    ("record", "response"): lambda v: isinstance(v, dict),
    ("record", "response", "choices"): lambda v: isinstance(v, list),
    ("record", "response", "choices", 0): lambda v: isinstance(v, dict),
    META: lambda v: isinstance(v, dict),
    (*REQUEST, "input_ids"): lambda v: isinstance(v, list),
    (*REQUEST, "input_ids", 0): is_integer,
    (*REQUEST, "input_ids", 5): is_integer,
    (*REQUEST, "return_routed_experts"): lambda v: isinstance(v, bool),
    START: is_integer,
    (*META, "output_token_logprobs"): lambda v: isinstance(v, list),
    (*META, "output_token_logprobs", 0): lambda v: isinstance(v, list),
    LOGPROB: is_number,
    (*META, "output_token_logprobs", 1, 1): is_integer,
    (*META, "completion_tokens"): lambda v: v is None or is_integer(v),
    (*META, "spec_verify_ct"): lambda v: v is None or is_integer(v),
    (*META, "spec_num_correct_drafts"): lambda v: v is None or is_integer(v),
    (*META, "spec_num_proposed_drafts"): lambda v: v is None or is_integer(v),
    PAYLOAD: lambda v: isinstance(v, str),
    ("record", "response", "choices", 0, "finish_reason"): lambda v: v is None
    or isinstance(v, str),
    ("record", "timestamp"): lambda v: v is None or is_number(v),
    ("metadata",): lambda v: v is None or isinstance(v, dict),
    ("metadata", "tito_session_mismatch"): lambda v: isinstance(v, list),
    ("metadata", "tito_session_mismatch", 0): lambda v: isinstance(v, dict),
    ("metadata", "tito_session_mismatch", 0, "type"): lambda v: isinstance(v, str),
}
REQUIRED: list[Path] = [
    ("event_id",), ("record",), (*REQUEST,), ("record", "response"),
    ("record", "response", "choices"), META, (*REQUEST, "input_ids"),
    (*META, "output_token_logprobs"), (*REQUEST, "return_routed_experts"), START, PAYLOAD,
    ("metadata", "tito_session_mismatch", 0, "type"),
]
NUMBERS: list[Path] = [
    (*REQUEST, "input_ids", 2), (*META, "output_token_logprobs", 0, 1), START,
    (*META, "completion_tokens"), (*META, "spec_verify_ct"), (*META, "cached_tokens"),
    ("record", "timestamp"), ("parent",),
]
SENTINEL = 0.123456789012345
LITERALS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"nan", b"inf"]
INT64 = st.integers(-(2**63), 2**64 - 1)
any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                          allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=6)
any_msgpack = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats(allow_nan=False, allow_infinity=False)
    | st.text() | st.binary(max_size=8)
    | st.builds(msgspec.msgpack.Ext, st.integers(0, 127), st.binary(max_size=4))
    | st.just(datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text() | st.integers(-5, 5), inner, max_size=3),
    max_leaves=6)


def json_non_finite(draw: st.DrawFn, raw: bytes) -> bytes:
    assert raw.count(repr(SENTINEL).encode()) == 1
    return raw.replace(repr(SENTINEL).encode(), draw(st.sampled_from(LITERALS)))


def msgpack_non_finite(draw: st.DrawFn, raw: bytes) -> bytes:
    old = b"\xcb" + struct.pack(">d", SENTINEL)
    assert raw.count(old) == 1
    value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return raw.replace(old, draw(st.sampled_from([b"\xcb" + struct.pack(">d", value),
                                                  b"\xca" + struct.pack(">f", value)])))


def json_nest(draw: st.DrawFn, raw: bytes, depth: int) -> bytes:
    return raw.replace(b'"__deep__"', b"[" * depth + b"0" + b"]" * depth)


def msgpack_nest(draw: st.DrawFn, raw: bytes, depth: int) -> bytes:
    opener = draw(st.sampled_from([b"\x91", b"\x81\xa1k"]))  # [x] or {"k": x}
    return raw.replace(b"\xa8__deep__", opener * depth + b"\x00")


def json_huge(draw: st.DrawFn) -> tuple[list[Path], Callable[[Path], Any]]:
    """JSON carries any integer: beyond int64 everywhere, beyond float64 for a log-prob."""
    def value(path: Path) -> Any:
        if path == LOGPROB:  # any float64 is a log-prob; an integer beyond float64 is not
            return draw(st.integers(2**1024, 2**1100) | st.integers(-(2**1100), -(2**1024)))
        return draw(st.integers(2**53, 2**300) | st.integers(max_value=-1)
                    | st.sampled_from([1e300, -1e300, 2.0**64, -(2**70), -(10**400)]))
    return [*COUNTED, LOGPROB], value


def msgpack_huge(draw: st.DrawFn) -> tuple[list[Path], Callable[[Path], Any]]:
    """MessagePack carries int64/uint64 integers only."""
    def value(path: Path) -> Any:
        return draw(st.integers(2**53, 2**64 - 1) | st.integers(-(2**63), -1)
                    | st.sampled_from([1e300, -1e300, 2.0**64, -(2.0**70)]))
    return COUNTED, value


@dataclass(frozen=True)
class Wire:
    """One wire's encoding of a turn body and what it can carry."""

    name: str
    content_type: str
    base: Callable[[], dict[str, Any]]  # the valid second turn as this wire sends it
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]  # the server's strict parser of this wire
    offsets: st.SearchStrategy[int]  # integers to try as a wrong R3 offset
    huge: Callable[[st.DrawFn], tuple[list[Path], Callable[[Path], Any]]]
    non_finite: Callable[[st.DrawFn, bytes], bytes]
    nest: Callable[[st.DrawFn, bytes, int], bytes]
    any_value: st.SearchStrategy[Any]
    payload_types: tuple[type, ...]  # what the R3 payload may be
    # The record as JSON carries it, from the record as this wire sends it.
    carried: Callable[[dict[str, Any]], dict[str, Any]] = json_carried


JSON = Wire("json", "application/json", second_turn, lambda b: json.dumps(b).encode(),
            jsonio.loads, st.integers(-2**40, 2**40), json_huge, json_non_finite, json_nest,
            any_json, (str,))
MSG = Wire("msgpack", MSGPACK, lambda: with_bin(second_turn()), msgspec.msgpack.encode,
           msgpackio.loads, INT64, msgpack_huge, msgpack_non_finite, msgpack_nest,
           any_msgpack, (str, bytes))


def narrow_base() -> dict[str, Any]:
    body = with_bin(second_turn())
    set_at(body, PAYLOAD, narrowed(get_at(body, PAYLOAD)))
    return body


def narrow_carried(record: dict[str, Any]) -> dict[str, Any]:
    """`json_carried` of a narrowed wire's record: a bin at the payload is read as the
    server reads it there (`NarrowR3`)."""
    try:
        response = record["response"]
        choice = response["choices"][0]
        payload = choice["meta_info"]["routed_experts"]
    except (KeyError, IndexError, TypeError):
        return json_carried(record)
    if not isinstance(payload, bytes):
        return json_carried(record)
    choices = [{**choice, "meta_info": {**choice["meta_info"],
                                        "routed_experts": NarrowR3(payload)}},
               *response["choices"][1:]]
    return json_carried({**record, "response": {**response, "choices": choices}})


NARROWED = Wire("narrow", NARROW, narrow_base, msgspec.msgpack.encode, msgpackio.loads_narrow,
                INT64, msgpack_huge, msgpack_non_finite, msgpack_nest, any_msgpack,
                (str, bytes), narrow_carried)
# cached_tokens is never refused (a count that is not one counts 0), so it is only in the
# non-finite cases.
COUNTED = [p for p in NUMBERS if p != (*META, "cached_tokens")]


@st.composite
def bad_payload(draw: st.DrawFn, wire: Wire) -> bytes:
    """An R3 payload of the wrong length: cut base64 text, or a bin of another size."""
    body = wire.base()
    payload = get_at(body, PAYLOAD)
    if isinstance(payload, str):
        set_at(body, PAYLOAD, payload[:draw(st.integers(1, len(payload) - 1))])
    else:
        size = draw(st.integers(1, 2 * len(payload)).filter(lambda n: n != len(payload)))
        set_at(body, PAYLOAD, (payload * 3)[:size])
    return wire.encode(body)


@st.composite
def wrong_offset(draw: st.DrawFn, wire: Wire) -> bytes:
    body = wire.base()
    set_at(body, START, draw(wire.offsets.filter(lambda s: s != 4)))
    return wire.encode(body)


@st.composite
def huge_number(draw: st.DrawFn, wire: Wire) -> bytes:
    body = wire.base()
    candidates, value = wire.huge(draw)
    path = draw(st.sampled_from(candidates))
    if path == ("parent",):
        body["parent"] = 0  # an explicit parent, so only the number itself is wrong
    set_at(body, path, value(path))
    return wire.encode(body)


@st.composite
def non_finite(draw: st.DrawFn, wire: Wire) -> bytes:
    body = wire.base()
    path = draw(st.sampled_from([*NUMBERS, (*REQUEST, "temperature"), LOGPROB,
                                 ("metadata", "x")]))
    set_at(body, path, SENTINEL)
    return wire.non_finite(draw, wire.encode(body))


@st.composite
def deep_nesting(draw: st.DrawFn, wire: Wire) -> bytes:
    body = wire.base()
    set_at(body, draw(st.sampled_from(paths(body))), "__deep__")
    return wire.nest(draw, wire.encode(body), draw(st.integers(65, 20_000)))


@st.composite
def wrong_type(draw: st.DrawFn, wire: Wire) -> bytes:
    body = wire.base()
    path, accepts = draw(st.sampled_from(list(TYPED.items())))
    if path == PAYLOAD:
        def accepts(v: Any) -> bool:
            return isinstance(v, wire.payload_types)
    value = draw(wire.any_value.filter(lambda v: not accepts(v) and v is not None))
    set_at(body, path, value)
    return wire.encode(body)


@st.composite
def missing_key(draw: st.DrawFn, wire: Wire) -> bytes:
    body = wire.base()
    path = draw(st.sampled_from(REQUIRED))
    del get_at(body, path[:-1])[path[-1]]
    return wire.encode(body)


# Only MessagePack can carry these.
@st.composite
def foreign_value(draw: st.DrawFn) -> bytes:
    """A bin, an ext or a timestamp anywhere but the R3 payload."""
    body = MSG.base()
    path = draw(st.sampled_from([p for p in paths(body) if p != PAYLOAD]))
    set_at(body, path, draw(st.binary(max_size=8)
                            | st.builds(msgspec.msgpack.Ext, st.integers(0, 127),
                                        st.binary(max_size=4))
                            | st.just(datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC))))
    return MSG.encode(body)


@st.composite
def foreign_key(draw: st.DrawFn) -> bytes:
    body = MSG.base()
    maps = [()] + [p for p in paths(body) if isinstance(get_at(body, p), dict)]
    target = get_at(body, draw(st.sampled_from(maps)))
    target[draw(st.integers(-5, 5) | st.binary(max_size=4) | st.none() | st.booleans())] = 1
    return MSG.encode(body)


@st.composite
def framing(draw: st.DrawFn) -> bytes:
    raw = to_msgpack(second_turn())
    cut = draw(st.integers(0, len(raw) - 1))
    extra = draw(st.binary(min_size=1, max_size=8))
    return draw(st.sampled_from([raw[:cut], raw + extra]))


def corruptions(wire: Wire) -> dict[str, st.SearchStrategy[bytes]]:
    found = {
        "bad_payload": bad_payload(wire),
        "wrong_offset": wrong_offset(wire),
        "huge_number": huge_number(wire),
        "non_finite": non_finite(wire),
        "deep_nesting": deep_nesting(wire),
        "wrong_type": wrong_type(wire),
        "missing_key": missing_key(wire),
    }
    if wire is MSG:
        found |= {"foreign_value": foreign_value(), "foreign_key": foreign_key(),
                  "framing": framing()}
    return found


CORRUPTIONS = {wire.name: corruptions(wire) for wire in (JSON, MSG, NARROWED)}
# Hundreds of appends per backend: the JSON and narrowed wires run on SQLite and PostgreSQL,
# not repeated on Citus (MessagePack, whose decoder the narrowed wire shares, keeps its
# Citus run).
WIRES = [pytest.param(JSON, id="json", marks=pytest.mark.not_citus),
         pytest.param(MSG, id="msgpack"),
         pytest.param(NARROWED, id="narrow", marks=pytest.mark.not_citus)]
WIRE_KINDS = [pytest.param(wire, kind, id=f"{wire.name}-{kind}", marks=p.marks)
              for p in WIRES for wire in p.values for kind in CORRUPTIONS[wire.name]]


def test_the_uncorrupted_turn_is_valid():
    state, _ = fold_in_memory(open_spec("fz"), [first_turn(), second_turn()])
    assert len(state.nodes) == 2 and state.nodes[1].parent == 0


def test_the_uncorrupted_turn_decodes_to_its_json_twin():
    value = msgpackio.loads(to_msgpack(second_turn()))
    assert json_carried(value["record"]) == second_turn()["record"]
    value = msgpackio.loads_narrow(NARROWED.encode(narrow_base()))
    assert json_carried(value["record"]) == second_turn()["record"]
    assert narrow_carried(narrow_base()["record"]) == second_turn()["record"]


@pytest.mark.parametrize("wire", WIRES)
@settings(max_examples=examples(400), deadline=None, derandomize=DERANDOMIZE)
@given(data=st.data())
def test_validator_rejects_every_corruption_with_a_domain_error(wire, data):
    raw = data.draw(st.one_of(*CORRUPTIONS[wire.name].values()))
    state, _ = fold_in_memory(open_spec("fz"), [first_turn()])
    with pytest.raises(DomainError) as info:
        state.attach(parse_turn(wire.decode(raw), state.definition), 1024)
    assert 400 <= info.value.http_status < 500
    assert len(state.nodes) == 1


@pytest.mark.parametrize("wire", WIRES)
@settings(max_examples=examples(300), deadline=None, derandomize=DERANDOMIZE)
@given(data=st.data())
def test_parser_fails_only_with_invalid_request(wire, data):
    raw = data.draw(st.binary(max_size=512) | st.one_of(*CORRUPTIONS[wire.name].values())
                    .map(lambda b: b[:len(b) // 2]))
    try:
        wire.decode(raw)
    except DomainError as exc:
        assert exc.http_status == 422 and exc.field == "body"


async def fresh_session(client, wire: Wire) -> str:
    sid = f"fz-{uuid.uuid4().hex}"
    assert (await client.post("/v1/sessions", json=open_spec(sid))).status_code == 201
    first = first_turn() if wire is JSON else with_bin(first_turn())
    if wire is NARROWED:
        set_at(first, PAYLOAD, narrowed(get_at(first, PAYLOAD)))
    r = await post_raw(client, sid, wire, wire.encode(first))
    assert r.status_code == 201, r.text
    return sid


async def post_raw(client, sid: str, wire: Wire, raw: bytes):
    return await client.post(f"/v1/sessions/{sid}/turns", content=raw,
                             headers={"content-type": wire.content_type})


def assert_problem(r) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert {"type", "title", "status", "detail"} <= problem.keys()
    assert problem["status"] == r.status_code


async def stored(client, sid: str) -> tuple[int, list[dict[str, Any]]]:
    summary = (await client.get(f"/v1/sessions/{sid}")).json()
    events = (await client.get(f"/v1/sessions/{sid}/events")).json()
    return summary["num_nodes"], events


@pytest.mark.parametrize("wire", WIRES)
async def test_the_uncorrupted_turn_is_appended(client, wire):
    sid = await fresh_session(client, wire)
    r = await post_raw(client, sid, wire, wire.encode(wire.base()))
    assert r.status_code == 201, r.text
    assert r.json()["r3"] == {"start": 4, "end": 7}


@pytest.fixture
def one_session() -> dict[str, str]:
    """The session a test's examples share (function scope: hypothesis reuses it)."""
    return {}


@pytest.mark.parametrize(("wire", "kind"), WIRE_KINDS)
@HTTP
@given(data=st.data())
async def test_append_rejects_corruption_and_stores_nothing(client, wire, kind, data,
                                                            one_session):
    raw = data.draw(CORRUPTIONS[wire.name][kind])
    # A rejected turn stores nothing, so every example of a test is sent to one session
    # and the check after each (still one node, two events) sees anything one stored.
    if "sid" not in one_session:
        one_session["sid"] = await fresh_session(client, wire)
    sid = one_session["sid"]
    assert_problem(await post_raw(client, sid, wire, raw))
    num_nodes, events = await stored(client, sid)
    assert num_nodes == 1 and len(events) == 2


@pytest.mark.parametrize("wire", WIRES)
@HTTP
@given(data=st.data())
async def test_any_value_at_any_path_is_stored_losslessly_or_rejected(client, wire, data):
    body = wire.base()
    path = data.draw(st.sampled_from(paths(body)))
    set_at(body, path, data.draw(wire.any_value))
    sid = await fresh_session(client, wire)
    r = await post_raw(client, sid, wire, wire.encode(body))
    num_nodes, events = await stored(client, sid)
    if r.status_code == 201:
        assert num_nodes == 2 and len(events) == 3
        carried = wire.carried(body["record"])
        assert events[2]["record"] == carried
        # The same turn as JSON carries it is the same turn: a repeat.
        again = await client.post(f"/v1/sessions/{sid}/turns",
                                  json={**body, "record": carried})
        assert again.status_code == 200, again.text
    else:
        assert_problem(r)
        assert num_nodes == 1 and len(events) == 2
