"""`opened_by` in the open body (docs/api.md §1.1) and the gateway's pure rules.

The open-body tests run on the three backends through the in-process API;
the rule tests (app.domain.body.gateway) need no store.
"""

from __future__ import annotations

import base64
import gc
import json
import tracemalloc
from typing import Any

import msgspec
import numpy as np
import pytest

import app.domain.body.gateway as gateway_rules
from app.domain.body.gateway import (
    NO_SESSION,
    NOT_JSON,
    NOT_TITO,
    STREAM,
    UPSTREAM_STATUS,
    Candidate,
    GatewayDefaults,
    Refused,
    Unrecorded,
    classify_reply,
    classify_reply_head,
    classify_request,
    forwarded_headers,
    open_body,
    parse_label_flags,
    parse_labels_header,
    parse_reply,
    r3_as_bin,
)
from app.domain.errors import InvalidRequest
from tests.r3_splice import splice_breakers


async def test_opened_by_is_kept_shown_and_part_of_the_idempotent_open(client, sid):
    body = {"session_id": sid, "version": "v2", "opened_by": "gateway"}
    first = await client.post("/v1/sessions", json=body)
    assert first.status_code == 201 and first.json()["opened_by"] == "gateway"
    assert (await client.post("/v1/sessions", json=body)).status_code == 200
    other = await client.post("/v1/sessions", json={"session_id": sid, "version": "v2"})
    assert other.status_code == 409
    assert (await client.get(f"/v1/sessions/{sid}")).json()["opened_by"] == "gateway"
    opened = (await client.get(f"/v1/sessions/{sid}/events")).json()[0]
    assert opened["session"]["opened_by"] == "gateway"


async def test_a_session_opened_without_it_has_none_and_repeats_as_before(client, sid):
    body = {"session_id": sid, "version": "v1"}
    assert (await client.post("/v1/sessions", json=body)).status_code == 201
    assert (await client.post("/v1/sessions", json=body)).status_code == 200
    assert (await client.get(f"/v1/sessions/{sid}")).json()["opened_by"] is None
    opened = (await client.get(f"/v1/sessions/{sid}/events")).json()[0]
    assert "opened_by" not in opened["session"]


@pytest.mark.parametrize("value", ["", "two words", 7, "x" * 65])
async def test_a_bad_opened_by_is_a_422_naming_it(client, sid, value):
    reply = await client.post("/v1/sessions",
                              json={"session_id": sid, "version": "v2", "opened_by": value})
    assert reply.status_code == 422 and reply.json()["field"] == "opened_by"


# -- the pure rules ------------------------------------------------------------------------

def test_request_classification() -> None:
    body = json.dumps({"input_ids": [1, 2], "messages": []}).encode()
    assert classify_request("s1", body) == Candidate("s1", {"input_ids": [1, 2],
                                                            "messages": []})
    assert classify_request(None, body) == Unrecorded(NO_SESSION)
    assert classify_request("a b", body) == Unrecorded(NO_SESSION)
    assert classify_request("s" * 129, body) == Unrecorded(NO_SESSION)
    for bad in (b"{", b"[]", b'{"input_ids": []}', b'{"input_ids": [1, true]}',
                b'{"input_ids": "12"}', b'{"input_ids": [1.5]}'):
        assert classify_request("s1", bad) == Unrecorded(NOT_TITO), bad
    streamed = json.dumps({"input_ids": [1], "stream": True}).encode()
    assert classify_request("s1", streamed) == Unrecorded(STREAM)
    not_streamed = json.dumps({"input_ids": [1], "stream": False}).encode()
    assert isinstance(classify_request("s1", not_streamed), Candidate)
    # The validated prompt goes on with the candidate; ids out of range leave it to
    # the store, which refuses the turn and names the id.
    candidate = classify_request("s1", body)
    assert isinstance(candidate, Candidate) and candidate.prompt is not None
    assert candidate.prompt.tolist() == [1, 2] and candidate.prompt.dtype == np.int64
    for ids in ([1, -1], [1, 2**31], [1, 2**64]):
        out_of_range = classify_request("s1", json.dumps({"input_ids": ids}).encode())
        assert isinstance(out_of_range, Candidate) and out_of_range.prompt is None, ids


def test_reply_classification() -> None:
    good = {"choices": [{"meta_info": {"output_token_logprobs": []}}]}
    assert classify_reply(200, json.dumps(good).encode()) == good
    assert classify_reply(500, json.dumps(good).encode()) == Unrecorded(UPSTREAM_STATUS)
    assert classify_reply(201, json.dumps(good).encode()) == Unrecorded(UPSTREAM_STATUS)
    assert classify_reply(200, b"<html>") == Unrecorded(NOT_JSON)
    for bad in ({}, {"choices": []}, {"choices": [{"meta_info": {}}]},
                {"choices": [{"meta_info": {"output_token_logprobs": None}}]}, [1]):
        assert classify_reply(200, json.dumps(bad).encode()) == Unrecorded(NOT_TITO), bad


_DEEP = "[" * 70 + "]" * 70  # past the store's nesting bound, well within any parser's


@pytest.mark.parametrize("extra", ["1e400", "-1e999", _DEEP, "1" + "0" * 4300])
def test_json_the_store_cannot_hold_is_a_turn_it_refuses_not_a_body_that_is_no_tito(
        extra: str) -> None:
    """A tester's finding: a request or reply that is JSON, with `input_ids` (or the
    log-prob list), but holds what the store refuses (a number past float range,
    nesting past its bound) was counted `not-tito` / `not-json`; it is a turn the store
    refuses, `rejected`, with the store's own problem. NaN and Infinity are not JSON."""
    request = b'{"input_ids": [1, 2], "temperature": %s}' % extra.encode()
    decided = classify_request("s1", request)
    assert isinstance(decided, Candidate) and decided.refusal is not None, decided
    assert decided.refusal.slug == "invalid-request"
    assert decided.request["input_ids"] == [1, 2]
    streamed = b'{"input_ids": [1], "stream": true, "x": %s}' % extra.encode()
    assert classify_request("s1", streamed) == Unrecorded(STREAM)
    reply = b'{"choices": [{"meta_info": {"output_token_logprobs": [], "x": %s}}]}' % \
        extra.encode()
    for classify in (classify_reply, parse_reply):
        refused = classify(200, reply)
        assert isinstance(refused, Refused) and refused.refusal.slug == "invalid-request"
    assert classify_reply(200, b'{"choices": [], "x": %s}' % extra.encode()) == \
        Unrecorded(NOT_TITO)
    assert classify_reply(500, reply) == Unrecorded(UPSTREAM_STATUS)


@pytest.mark.parametrize("text", [b"NaN", b"Infinity", b"-Infinity", b"1e400 trailing"])
def test_what_is_no_json_stays_not_tito_and_not_json(text: bytes) -> None:
    request = b'{"input_ids": [1, 2], "x": ' + text + b"}"
    assert classify_request("s1", request) == Unrecorded(NOT_TITO)
    reply = b'{"choices": [{"meta_info": {"output_token_logprobs": [], "x": ' + text + b"}}]}"
    assert classify_reply(200, reply) == Unrecorded(NOT_JSON)
    # A request the store takes as it is carries no refusal.
    good = classify_request("s1", b'{"input_ids": [1, 2], "x": 1e300}')
    assert isinstance(good, Candidate) and good.refusal is None


def test_a_body_of_more_values_than_the_store_decodes_is_not_parsed_again(monkeypatch) -> None:
    """Telling JSON the store refuses from no JSON takes a second parse; a body past the
    store's value limit is not given one (it would build every value), and is judged
    as before: not a TITO request, not a JSON reply."""
    monkeypatch.setattr(gateway_rules.jsonio, "plain_json", _never)
    many = b"[" + b"0," * 2_100_000 + b"0]"
    assert classify_request("s1", b'{"input_ids": [1, 2], "x": ' + many + b"}") == \
        Unrecorded(NOT_TITO)
    reply = b'{"choices": [{"meta_info": {"output_token_logprobs": []}}], "x": ' + many + b"}"
    assert classify_reply(200, reply) == Unrecorded(NOT_JSON)


def test_a_refusal_kept_with_a_turn_holds_nothing_of_the_refused_parse() -> None:
    """The refusal goes with the candidate until the upstream answers: its traceback
    (the parser's frames) and the error it was raised in would keep what the refused
    parse built alive beside the second parse's value — twice a large body's values."""
    payload = b"[" * 65 + b",".join([b"7"] * 200_000) + b"]" * 65
    for body in (b'{"input_ids": [1], "x": ' + payload + b"}",
                 b'{"input_ids": [1], "x": [1e400, ' + payload + b"]}"):
        decided = classify_request("s1", body)
        assert isinstance(decided, Candidate) and decided.refusal is not None
        assert decided.refusal.__traceback__ is None
        assert decided.refusal.__context__ is None and decided.refusal.__cause__ is None
    reply = b'{"choices": [{"meta_info": {"output_token_logprobs": [], "x": ' + payload + b"}}]}"
    refused = classify_reply(200, reply)
    assert isinstance(refused, Refused) and refused.refusal.__traceback__ is None
    # What is held while the candidate lives: about one parse of the body, not two.
    body = b'{"input_ids": [1], "x": ' + payload.replace(b"7", b"7.5") + b"}"
    tracemalloc.start()
    try:
        one_parse = gateway_rules.jsonio.plain_json(body)
        once = tracemalloc.get_traced_memory()[0]
        del one_parse
        decided = classify_request("s1", body)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert isinstance(decided, Candidate) and decided.refusal is not None
    assert held < 1.5 * once, (held, once)


def _never(_raw: bytes) -> None:
    raise AssertionError("parsed a second time")


def test_reply_head_classification() -> None:
    """Decided on the status and content type alone: relayed streaming, never held."""
    assert classify_reply_head(200, "application/json") is None
    assert classify_reply_head(200, "") is None  # no type: read it and look
    assert classify_reply_head(500, "application/json") == Unrecorded(UPSTREAM_STATUS)
    assert classify_reply_head(204, "") == Unrecorded(UPSTREAM_STATUS)
    for event_stream in ("text/event-stream", "Text/Event-Stream; charset=utf-8"):
        assert classify_reply_head(200, event_stream) == Unrecorded(NOT_JSON)


def test_hop_by_hop_headers() -> None:
    headers = [("Connection", "close"), ("Keep-Alive", "5"), ("Transfer-Encoding", "chunked"),
               ("TE", "trailers"), ("Trailer", "x"), ("Upgrade", "h2c"),
               ("Proxy-Authorization", "x"), ("Host", "h"), ("X-A", "1")]
    assert forwarded_headers(headers, frozenset({"host"})) == [("X-A", "1")]


def test_open_body_labels_header_wins_and_is_checked() -> None:
    defaults = GatewayDefaults(num_layers=4, labels=parse_label_flags(["run=r", "team=a"]))
    body = open_body("s1", defaults, parse_labels_header('{"team": "b", "n": 1}'))
    assert body["labels"] == {"run": "r", "team": "b", "n": 1}
    assert body["r3"] == {"num_layers": 4} and body["opened_by"] == "gateway"
    assert body["version"] == "v2" and body["pause_generation_mode"] == "retract"
    for bad in ("{", "[1]", '{"a": {"b": 1}}', '{"a": [1]}', '{"bad key": 1}'):
        with pytest.raises(InvalidRequest):
            parse_labels_header(bad)
    with pytest.raises(InvalidRequest):
        parse_label_flags(["novalue"])


def _reply_with_r3(text: object) -> dict[str, Any]:
    return {"id": "x", "choices": [{"index": 0, "meta_info": {
        "output_token_logprobs": [[-0.5, 7]], "routed_experts": text, "cached_tokens": 0}}]}


def test_r3_as_bin_decodes_canonical_base64_once_and_json_renders_it_back() -> None:
    values = np.array([[3, 1], [0, 7], [2**31 - 1, -5]], dtype="<i4")
    text = base64.b64encode(values.tobytes()).decode("ascii")
    reply = _reply_with_r3(text)
    before = json.dumps(reply)
    out = r3_as_bin(reply)
    meta = out["choices"][0]["meta_info"]
    assert meta["routed_experts"] == values.tobytes()
    assert list(meta) == ["output_token_logprobs", "routed_experts", "cached_tokens"]
    # JSON carries a bin as its base64 text: the same document, byte for byte.
    assert msgspec.json.encode(out) == msgspec.json.encode(json.loads(before))
    assert json.dumps(reply) == before  # the parsed reply itself is left as it was


@pytest.mark.parametrize("text", ["", None, 5, "AAAAAQ=", "AAAAAR==", "AA*A", "AAAAAAA="])
def test_r3_as_bin_leaves_what_the_store_must_judge(text) -> None:
    # Empty, not text, truncated, non-zero trailing bits, bad alphabet, not whole int32s:
    # the store answers these with its own R3 error, so they reach it unchanged.
    reply = _reply_with_r3(text)
    assert r3_as_bin(reply) is reply


@pytest.mark.parametrize("reply", [{}, {"choices": []}, {"choices": [{"meta_info": {}}]}, [1]])
def test_r3_as_bin_without_a_payload_is_the_reply_itself(reply) -> None:
    assert r3_as_bin(reply) is reply


def _plain(status: int, body: bytes) -> Any:
    reply = classify_reply(status, body)
    return reply if isinstance(reply, Unrecorded) else r3_as_bin(reply)


_R3 = base64.b64encode(np.arange(48 * 8 * 3, dtype="<i4").tobytes())
_TITO = json.dumps(_reply_with_r3(_R3.decode())).encode()


@pytest.mark.parametrize("body", [
    *splice_breakers(_TITO, _R3, b'{"id"', b'"index"', b'"cached_tokens"'),
    json.dumps({"choices": [{"meta_info": {"output_token_logprobs": []}}]}).encode(),
    b"", b"<html>",
])
def test_parse_reply_answers_as_classify_reply_then_r3_as_bin(body) -> None:
    for status in (200, 500):
        plain, fused = _plain(status, body), parse_reply(status, body)
        assert fused == plain and type(fused) is type(plain)
        if isinstance(plain, dict):  # bytes == str is False: the payload's type is equal too
            assert msgspec.json.encode(fused) == msgspec.json.encode(plain)
            assert list(fused["choices"][0]["meta_info"]) == \
                list(plain["choices"][0]["meta_info"])


def test_parse_reply_decodes_the_payload_from_the_bytes() -> None:
    reply = parse_reply(200, bytearray(_TITO))
    assert reply["choices"][0]["meta_info"]["routed_experts"] == base64.b64decode(_R3)


_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _requests() -> list[bytes]:
    bodies = []
    for ids in ([1], [0], [1, 2, 3], [2**31 - 1, 5], [2**31], [2**63 - 1], [2**63],
                [2**64 + 5], [10**19], [-1, 2], [1, True], [1, 1.0], [1, None], [1, "2"],
                [[1]], list(range(3000))):
        for separators in ((",", ":"), (", ", ": ")):
            bodies.append(json.dumps({**_CHAT, "input_ids": ids}, separators=separators))
            bodies.append(json.dumps({"input_ids": ids, **_CHAT, "stream": True},
                                     separators=separators))
    plain = json.dumps({**_CHAT, "input_ids": [1, 2, 3]})
    for old, new in (("[1, 2, 3]", "[ 1 ,2 , 3 ]"), ("[1, 2, 3]", "[\n1,\n2]"),
                     ("[1, 2, 3]", "[1, 02]"), ("[1, 2, 3]", "[1, 2,]"), ("[1, 2, 3]", "[1 2]"),
                     ("[1, 2, 3]", "[1e3, 2]"), ("[1, 2, 3]", "[-0]"), ("[1, 2, 3]", "[]"),
                     ("[1, 2, 3]", "[1, 2, 3"), ("[1, 2, 3]", "[1, 36893488147419103237]"),
                     ('"model"', '"input_ids": [9, 9], "model"'),  # twice: the last one counts
                     ('"model": "m"', '"model": {"input_ids": [9]}'),
                     ('"model"', '"\\u0069nput_ids": [7], "model"'),  # the same key, escaped
                     ('"model": "m"', '"model": "input_ids"'),
                     ('"content": "hi"', '"content": "a\\nb"'),
                     ('"input_ids": ', '"input_ids"\n:\t')):
        bodies.append(plain.replace(old, new))
    return [body.encode() for body in bodies] + [b"[1,2]", b"", b'{"input_ids": [1]} x']


@pytest.mark.parametrize("body", _requests())
def test_token_ids_read_from_the_bytes_are_those_of_the_parsed_list(body, monkeypatch) -> None:
    """`classify_request` answers the same with the ids read from the bytes as with
    the parsed list converted (`token_array`), whichever way a body goes."""
    fast = classify_request("s1", body)
    monkeypatch.setattr(gateway_rules, "_listed_ids", lambda _body, _count: None)
    slow = classify_request("s1", body)
    assert type(fast) is type(slow)
    if isinstance(slow, Unrecorded):
        assert fast == slow
        return
    assert isinstance(fast, Candidate) and fast.request == slow.request
    if slow.prompt is None:
        assert fast.prompt is None
    else:
        assert fast.prompt is not None and fast.prompt.dtype == slow.prompt.dtype == np.int64
        assert fast.prompt.tolist() == slow.prompt.tolist()


def test_token_ids_of_a_plain_request_are_read_from_its_bytes() -> None:
    for separators in ((",", ":"), (", ", ": ")):
        body = json.dumps({**_CHAT, "input_ids": [5, 0, 2**31 - 1]}, separators=separators)
        ids = gateway_rules._listed_ids(body.encode(), 3)
        assert ids is not None and ids.tolist() == [5, 0, 2**31 - 1]
    # One past int64 reads as its maximum (strtoll), never wrapped into range.
    assert gateway_rules._listed_ids(b'{"input_ids": [18446744073709551621]}', 1) is None


@pytest.mark.parametrize(("headers", "fault"), [
    ([(b"content-type", b"application/json")], None),
    ([(b"x-text", b"tab\tand obs-text \xe9 are fine")], None),
    ([(b"x-bin", b"\x01")], "control character"),
    ([(b"x-ok", b"1"), (b"x-del", b"a\x7f")], "control character"),
    ([(b"x-newline", b"a\nb")], "control character"),
    ([(b"x(bad", b"v")], "not an HTTP token"),
    ([(b"x bad", b"v")], "not an HTTP token"),
    ([(b"", b"v")], "not an HTTP token"),
])
def test_a_reply_header_the_server_could_not_send_is_named(headers, fault):
    found = gateway_rules.unrelayable_header(headers)
    assert (found is None) if fault is None else (fault in str(found))
