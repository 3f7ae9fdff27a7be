"""Corrupted turns: the validator and the HTTP append reject each with a 4xx problem, store
nothing, and never fail any other way.

Every example starts from one valid second turn of an addition-R3 session
(a parent with rows [0, 4), the turn's patch [4, 7)) and breaks it one way:
truncated base64, wrong offsets, huge numbers, NaN/Infinity literals in the
raw bytes, over-deep nesting, a wrong type at a validated path, a missing
required key. The domain property runs the pure parse + attach on many
examples; the HTTP properties run the real append on both backends, each
example on a fresh session, and then check that the session still has one
node and two events. A wrong type at *any* path of the body must be either
accepted (and stored losslessly) or rejected with nothing stored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.domain import jsonio
from app.domain.errors import DomainError
from app.domain.turn import parse_turn
from app.simulator import fold_in_memory
from tests.factory import open_body, r3_b64, turn
from tests.fuzz.budget import DERANDOMIZE, examples

# Hundreds of appends per backend: run on SQLite and PostgreSQL, not repeated on Citus.
pytestmark = pytest.mark.not_citus

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
LITERALS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"nan", b"inf"]
SENTINEL = 0.123456789012345
any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                          allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=6)


def dumps(body: Any) -> bytes:
    return json.dumps(body).encode()


@st.composite
def truncated_base64(draw: st.DrawFn) -> bytes:
    body = second_turn()
    payload = get_at(body, PAYLOAD)
    set_at(body, PAYLOAD, payload[:draw(st.integers(1, len(payload) - 1))])
    return dumps(body)


@st.composite
def wrong_offset(draw: st.DrawFn) -> bytes:
    body = second_turn()
    set_at(body, START, draw(st.integers(-2**40, 2**40).filter(lambda s: s != 4)))
    return dumps(body)


@st.composite
def huge_number(draw: st.DrawFn) -> bytes:
    body = second_turn()
    # cached_tokens is never refused (a count that is not one counts 0), so it is
    # only in the non-finite cases below.
    path = draw(st.sampled_from([*[p for p in NUMBERS if p != (*META, "cached_tokens")],
                                 LOGPROB]))
    if path == ("parent",):
        body["parent"] = 0  # an explicit parent, so only the number itself is wrong
    if path == LOGPROB:  # any float64 is a log-prob; an integer beyond float64 is not
        value = draw(st.integers(2**1024, 2**1100) | st.integers(-(2**1100), -(2**1024)))
    else:
        value = draw(st.integers(2**53, 2**300) | st.integers(max_value=-1)
                     | st.sampled_from([1e300, -1e300, 2.0**64, -(2**70), -(10**400)]))
    set_at(body, path, value)
    return dumps(body)


@st.composite
def non_finite_literal(draw: st.DrawFn) -> bytes:
    body = second_turn()
    path = draw(st.sampled_from([*NUMBERS, (*REQUEST, "temperature"), LOGPROB,
                                 ("metadata", "x")]))
    set_at(body, path, SENTINEL)
    raw = dumps(body)
    assert raw.count(repr(SENTINEL).encode()) == 1
    return raw.replace(repr(SENTINEL).encode(), draw(st.sampled_from(LITERALS)))


@st.composite
def deep_nesting(draw: st.DrawFn) -> bytes:
    body = second_turn()
    path = draw(st.sampled_from(paths(body)))
    set_at(body, path, "__deep__")
    depth = draw(st.integers(65, 20_000))
    return dumps(body).replace(b'"__deep__"', b"[" * depth + b"0" + b"]" * depth)


@st.composite
def wrong_type(draw: st.DrawFn) -> bytes:
    body = second_turn()
    path, accepts = draw(st.sampled_from(list(TYPED.items())))
    value = draw(any_json.filter(lambda v: not accepts(v) and v is not None))
    set_at(body, path, value)
    return dumps(body)


@st.composite
def missing_key(draw: st.DrawFn) -> bytes:
    body = second_turn()
    path = draw(st.sampled_from(REQUIRED))
    del get_at(body, path[:-1])[path[-1]]
    return dumps(body)


CORRUPTIONS = {
    "truncated_base64": truncated_base64(),
    "wrong_offset": wrong_offset(),
    "huge_number": huge_number(),
    "non_finite_literal": non_finite_literal(),
    "deep_nesting": deep_nesting(),
    "wrong_type": wrong_type(),
    "missing_key": missing_key(),
}
any_corruption = st.one_of(*CORRUPTIONS.values())


def test_the_uncorrupted_turn_is_valid():
    state, _ = fold_in_memory(open_spec("fz"), [first_turn(), second_turn()])
    assert len(state.nodes) == 2 and state.nodes[1].parent == 0


@settings(max_examples=examples(400), deadline=None, derandomize=DERANDOMIZE)
@given(raw=any_corruption)
def test_validator_rejects_every_corruption_with_a_domain_error(raw):
    state, _ = fold_in_memory(open_spec("fz"), [first_turn()])
    with pytest.raises(DomainError) as info:
        state.attach(parse_turn(jsonio.loads(raw), state.definition), 1024)
    assert 400 <= info.value.http_status < 500
    assert len(state.nodes) == 1


@settings(max_examples=examples(300), deadline=None, derandomize=DERANDOMIZE)
@given(raw=st.binary(max_size=512) | any_corruption.map(lambda b: b[:len(b) // 2]))
def test_parser_fails_only_with_invalid_request(raw):
    try:
        jsonio.loads(raw)
    except DomainError as exc:
        assert exc.http_status == 422 and exc.field == "body"


async def fresh_session(client) -> str:
    sid = f"fz-{uuid.uuid4().hex}"
    assert (await client.post("/v1/sessions", json=open_spec(sid))).status_code == 201
    r = await client.post(f"/v1/sessions/{sid}/turns", json=first_turn())
    assert r.status_code == 201, r.text
    return sid


async def post_raw(client, sid: str, raw: bytes):
    return await client.post(f"/v1/sessions/{sid}/turns", content=raw,
                             headers={"content-type": "application/json"})


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


async def test_the_uncorrupted_turn_is_appended(client):
    sid = await fresh_session(client)
    r = await client.post(f"/v1/sessions/{sid}/turns", json=second_turn())
    assert r.status_code == 201, r.text
    assert r.json()["r3"] == {"start": 4, "end": 7}


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
    body = second_turn()
    path = data.draw(st.sampled_from(paths(body)))
    set_at(body, path, data.draw(any_json))
    sid = await fresh_session(client)
    r = await post_raw(client, sid, dumps(body))
    num_nodes, events = await stored(client, sid)
    if r.status_code == 201:
        assert num_nodes == 2 and len(events) == 3
        assert events[2]["record"] == body["record"]
    else:
        assert_problem(r)
        assert num_nodes == 1 and len(events) == 2
