"""MessagePack turns (docs/ingest.md): content types, cross-wire idempotency, events as
MessagePack, and every malformed MessagePack body answered 422 with nothing stored."""

import base64
import datetime
import json
import struct

import msgspec
import numpy as np
import pytest

from tests.factory import open_body, r3_b64, turn
from tests.wire import MSGPACK, to_msgpack, to_packed_msgpack, with_bin

L, K = 2, 2
META = ("record", "response", "choices", 0, "meta_info")


async def addition_session(client, sid):
    r = await client.post("/v1/sessions", json=open_body(
        sid, pause_generation_mode="in_place", r3={"num_layers": L}))
    assert r.status_code == 201, r.text


def first_turn(**over):
    return turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0, event_id="e0", **over)


async def post_raw(client, sid, content, content_type=MSGPACK):
    headers = {} if content_type is None else {"content-type": content_type}
    return await client.post(f"/v1/sessions/{sid}/turns", content=content, headers=headers)


async def stored(client, sid):
    return (await client.get(f"/v1/sessions/{sid}")).json()["num_nodes"]


def meta(body):
    node = body
    for key in META:
        node = node[key]
    return node


@pytest.mark.parametrize("content_type", [
    "application/msgpack", "application/vnd.msgpack", "application/x-msgpack",
    "Application/MsgPack; charset=binary"])
async def test_every_msgpack_media_type_is_read(client, sid, content_type):
    await addition_session(client, sid)
    r = await post_raw(client, sid, to_msgpack(first_turn()), content_type)
    assert r.status_code == 201, r.text
    assert r.json()["r3"] == {"start": 0, "end": 4}


@pytest.mark.parametrize("content_type", [None, "", "application/json",
                                          "APPLICATION/JSON; charset=utf-8"])
async def test_no_content_type_or_json_with_params_is_json(client, sid, content_type):
    await addition_session(client, sid)
    r = await post_raw(client, sid, json.dumps(first_turn()).encode(), content_type)
    assert r.status_code == 201, r.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/cbor",
                                          "application/x-www-form-urlencoded",
                                          "application/json-seq"])
async def test_other_content_types_of_a_turn_are_415(client, sid, content_type):
    await addition_session(client, sid)
    r = await post_raw(client, sid, json.dumps(first_turn()).encode(), content_type)
    assert r.status_code == 415, r.text
    problem = r.json()
    assert r.headers["content-type"] == "application/problem+json"
    assert problem["type"] == "urn:turnlog:unsupported-media-type"
    assert problem["field"] == "content-type"
    assert await stored(client, sid) == 0


@pytest.mark.parametrize("content_type", [MSGPACK, "text/plain"])
async def test_opens_and_closes_read_json_only(client, sid, content_type):
    body = open_body(sid)
    r = await client.post("/v1/sessions", content=msgspec.msgpack.encode(body),
                          headers={"content-type": content_type})
    assert r.status_code == 415 and r.json()["type"] == "urn:turnlog:unsupported-media-type"
    assert r.json()["expected"] == "application/json"
    assert (await client.get(f"/v1/sessions/{sid}")).status_code == 404
    assert (await client.post("/v1/sessions", json=body)).status_code == 201
    r = await client.post(f"/v1/sessions/{sid}/close", content=msgspec.msgpack.encode({}),
                          headers={"content-type": content_type})
    assert r.status_code == 415 and r.json()["expected"] == "application/json"
    assert (await client.get(f"/v1/sessions/{sid}")).json()["status"] == "open"


async def test_a_msgpack_turn_repeated_as_json_is_the_same_turn(client, sid):
    await addition_session(client, sid)
    body = first_turn()
    first = await post_raw(client, sid, to_msgpack(body))
    assert first.status_code == 201, first.text
    again = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    assert again.status_code == 200, again.text
    assert again.json() == first.json()
    back = await post_raw(client, sid, to_msgpack(body))
    assert back.status_code == 200 and back.json() == first.json()
    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert len(evs) == 2
    assert evs[1]["record"] == body["record"]
    # Byte-identical base64, as if the turn had come as JSON.
    assert meta(evs[1])["routed_experts"] == meta(body)["routed_experts"]


@pytest.mark.parametrize("third", [False, True], ids=["pairs", "with-null-text"])
async def test_packed_lists_are_the_same_turn_on_either_wire(client, sid, third):
    """`input_ids` as uint32 items and output entries at fixed width (what the client
    sends) are the lists JSON carries: the same turn, the same events, the same
    idempotency."""
    await addition_session(client, sid)
    prompt, output = list(range(3000, 3040)), list(range(500, 520))
    rows = len(prompt) + len(output) - 1

    def body_of(ids, event_id="e0", **over):
        body = turn(ids, output, r3=r3_b64(rows, L, K), start=0, event_id=event_id, **over)
        if third:
            meta(body)["output_token_logprobs"] = [
                [*entry, None] for entry in meta(body)["output_token_logprobs"]]
        return body

    body = body_of(prompt)
    first = await post_raw(client, sid, to_packed_msgpack(body))
    assert first.status_code == 201, first.text
    again = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    assert again.status_code == 200 and again.json() == first.json()
    assert (await post_raw(client, sid, to_msgpack(body))).status_code == 200
    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert evs[1]["record"] == body["record"]
    other = body_of([*prompt[:-1], 7])
    r = await client.post(f"/v1/sessions/{sid}/turns", json=other)
    assert r.status_code == 409 and r.json()["type"] == "urn:turnlog:idempotency-conflict"
    r = await post_raw(client, sid, to_packed_msgpack(other))
    assert r.status_code == 409 and r.json()["type"] == "urn:turnlog:idempotency-conflict"
    bad = body_of([*prompt[:-1], (1 << 31)], "e1", parent=0)
    r = await post_raw(client, sid, to_packed_msgpack(bad))
    assert r.status_code == 422 and r.json()["field"] == "record.request.input_ids[39]"
    assert await stored(client, sid) == 1


async def test_a_json_turn_repeated_as_msgpack_is_the_same_turn(client, sid):
    await addition_session(client, sid)
    body = first_turn()
    first = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    again = await post_raw(client, sid, to_msgpack(body))
    assert again.status_code == 200 and again.json() == first.json()


async def test_other_r3_under_the_same_event_id_is_409_across_wires(client, sid):
    await addition_session(client, sid)
    await post_raw(client, sid, to_msgpack(first_turn()))
    other = turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K, seed=9), start=0, event_id="e0")
    r = await client.post(f"/v1/sessions/{sid}/turns", json=other)
    assert r.status_code == 409 and r.json()["type"] == "urn:turnlog:idempotency-conflict"
    r = await post_raw(client, sid, to_msgpack(other))
    assert r.status_code == 409


async def test_an_integer_float_is_not_the_same_as_an_int_across_wires(client, sid):
    """Floats compare as float64 and keep their type: 1.0 sent as MessagePack is JSON 1.0."""
    await addition_session(client, sid)
    body = first_turn(timestamp=1755800000.0)
    assert (await post_raw(client, sid, to_msgpack(body))).status_code == 201
    text = json.dumps(body).replace("1755800000.0", "1755800000").encode()
    r = await post_raw(client, sid, text, "application/json")
    assert r.status_code == 409

async def test_a_float32_is_the_float64_json_carries(client, sid):
    await addition_session(client, sid)
    body = first_turn(timestamp=1.5)
    raw = to_msgpack(body).replace(b"\xcb" + struct.pack(">d", 1.5),
                                   b"\xca" + struct.pack(">f", 1.5))
    assert b"\xca" in raw
    assert (await post_raw(client, sid, raw)).status_code == 201
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=body)).status_code == 200


async def test_events_as_msgpack_carry_r3_as_bin(client, sid):
    await addition_session(client, sid)
    body = first_turn()
    await client.post(f"/v1/sessions/{sid}/turns", json=body)
    as_json = (await client.get(f"/v1/sessions/{sid}/events")).json()
    r = await client.get(f"/v1/sessions/{sid}/events",
                         headers={"accept": "application/msgpack"})
    assert r.status_code == 200 and r.headers["content-type"] == MSGPACK
    page = msgspec.msgpack.decode(r.content)
    raw = meta(page[1])["routed_experts"]
    assert isinstance(raw, bytes)
    assert raw == base64.b64decode(meta(body)["routed_experts"])
    assert page[0] == as_json[0]
    assert page[1]["record"] == with_bin(body)["record"]
    assert {k: v for k, v in page[1].items() if k != "record"} == \
        {k: v for k, v in as_json[1].items() if k != "record"}
    no_r3 = msgspec.msgpack.decode((await client.get(
        f"/v1/sessions/{sid}/events?include_r3=false",
        headers={"accept": "application/msgpack"})).content)
    assert "routed_experts" not in meta(no_r3[1])


async def test_accept_msgpack_with_q0_is_json(client, sid):
    await addition_session(client, sid)
    r = await client.get(f"/v1/sessions/{sid}/events",
                         headers={"accept": "application/msgpack;q=0, application/json"})
    assert r.headers["content-type"].startswith("application/json")


async def test_r3_values_beyond_uint8_round_trip_as_bin(client, sid):
    await addition_session(client, sid)
    values = np.repeat(np.array([[[0, 70000]], [[-5, 2**31 - 1]]], dtype="<i4"), L, axis=1)
    body = turn([1, 2], [3], r3=base64.b64encode(values.tobytes()).decode(), start=0)
    assert (await post_raw(client, sid, to_msgpack(body))).status_code == 201
    page = msgspec.msgpack.decode((await client.get(
        f"/v1/sessions/{sid}/events", headers={"accept": MSGPACK})).content)
    assert meta(page[1])["routed_experts"] == values.tobytes()


async def test_an_empty_bin_is_an_empty_payload(client, sid):
    await addition_session(client, sid)
    await post_raw(client, sid, to_msgpack(first_turn()))
    body = with_bin(turn([1, 2, 3, 4, 5], [], start=4, return_r3=True, event_id="e1"))
    meta(body)["routed_experts"] = b""
    r = await post_raw(client, sid, msgspec.msgpack.encode(body))
    assert r.status_code == 201, r.text
    # As JSON carries it: "".
    meta(body)["routed_experts"] = ""
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=body)).status_code == 200
    # Read back: "" as JSON, the empty bin as MessagePack (every payload is a bin there).
    events = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert meta(events[-1])["routed_experts"] == ""
    r = await client.get(f"/v1/sessions/{sid}/events", headers={"accept": MSGPACK})
    payloads = [meta(e)["routed_experts"] for e in msgspec.msgpack.decode(r.content)
                if e["type"] == "turn_recorded"]
    assert [type(p) for p in payloads] == [bytes, bytes] and payloads[-1] == b""


def _encode(value):
    return msgspec.msgpack.encode(value)


def _with_meta(**fields):
    body = with_bin(first_turn())
    meta(body).update(fields)
    return body


def _nan_bytes():
    body = first_turn()
    body["record"]["timestamp"] = 12345.5
    raw = to_msgpack(body)
    return raw.replace(b"\xcb" + struct.pack(">d", 12345.5), b"\xcb" + struct.pack(">d", np.nan))


def _inf32_bytes():
    body = first_turn()
    body["record"]["timestamp"] = 12345.5
    raw = to_msgpack(body)
    return raw.replace(b"\xcb" + struct.pack(">d", 12345.5), b"\xca" + struct.pack(">f", np.inf))


def _bad_utf8():
    body = first_turn()
    body["record"]["method"] = "POSX"
    return to_msgpack(body).replace(b"POSX", b"PO\xed\xa0")


def _deep():
    value: object = 1
    for _ in range(200):
        value = [value]
    body = with_bin(first_turn())
    body["record"]["deep"] = value
    return _encode(body)


MALFORMED = {
    "truncated": lambda: to_msgpack(first_turn())[:-7],
    "trailing bytes": lambda: to_msgpack(first_turn()) + b"\xc0",
    "two documents": lambda: to_msgpack(first_turn()) * 2,
    "invalid opcode": lambda: b"\xc1",
    "empty body": lambda: b"",
    "not a map": lambda: _encode([first_turn()]),
    "a bare bin": lambda: _encode(b"abcd"),
    "int map key": lambda: _encode({**with_bin(first_turn()), 1: "x"}),
    "nested int map key": lambda: _encode(_with_meta(extra={7: 1})),
    "nil map key": lambda: b"\x81\xc0\x01",
    "bin map key": lambda: _encode({b"event_id": "e0"}),
    "ext type": lambda: _encode(_with_meta(extra=msgspec.msgpack.Ext(5, b"x"))),
    "timestamp ext": lambda: _encode(_with_meta(
        extra=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC))),
    "bin elsewhere": lambda: _encode(_with_meta(weight_version=b"7")),
    "bin in metadata": lambda: _encode({**with_bin(first_turn()), "metadata": {"x": b""}}),
    "bin event_id": lambda: _encode({**with_bin(first_turn()), "event_id": b"e0"}),
    "NaN float64": _nan_bytes,
    "Infinity float32": _inf32_bytes,
    "invalid UTF-8 str": _bad_utf8,
    "too deep": _deep,
}


_META = "record.response.choices[0].meta_info"
NAMED = {
    "nested int map key": f"{_META}.extra",
    "ext type": f"{_META}.extra",  # a tester's finding: it named only the body
    "timestamp ext": f"{_META}.extra",
    "bin elsewhere": f"{_META}.weight_version",
    "bin in metadata": "metadata.x",
    "bin event_id": "event_id",
    "NaN float64": "record.timestamp",
    "Infinity float32": "record.timestamp",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_msgpack_is_422_storing_nothing(client, sid, case):
    await addition_session(client, sid)
    raw = MALFORMED[case]()
    r = await post_raw(client, sid, raw)
    assert r.status_code == 422, (case, r.text)
    problem = r.json()
    assert problem["type"] == "urn:turnlog:invalid-request", problem
    assert {"field", "expected", "actual"} <= problem.keys()
    # The field where the refused value stands, as the JSON path names it (a helper's
    # finding: every MessagePack refusal said `body`).
    assert problem["field"] == NAMED.get(case, "body"), (case, problem)
    assert await stored(client, sid) == 0
    assert len((await client.get(f"/v1/sessions/{sid}/events")).json()) == 1


@pytest.mark.parametrize(("case", "payload"), [
    ("not whole int32", b"\x01\x00\x00"),
    ("not divisible", b"\x00" * 4 * (4 * L * K - 1)),
    ("too many values", b"\x00" * 4 * (4 * L * K + 1)),
])
async def test_bad_r3_bin_is_422_invalid_r3(client, sid, case, payload):
    await addition_session(client, sid)
    body = with_bin(first_turn())
    meta(body)["routed_experts"] = payload
    r = await post_raw(client, sid, _encode(body))
    assert r.status_code == 422, case
    assert r.json()["type"] == "urn:turnlog:invalid-r3"
    assert r.json()["field"] == "record.response.choices[0].meta_info.routed_experts"
    assert await stored(client, sid) == 0


async def test_a_bin_without_return_routed_experts_is_422(client, sid):
    await addition_session(client, sid)
    body = with_bin(turn([1, 2, 3], [4, 5], event_id="e0"))
    meta(body)["routed_experts"] = b"\x00" * 16
    r = await post_raw(client, sid, _encode(body))
    assert r.status_code == 422
    assert await stored(client, sid) == 0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
async def test_a_non_finite_logprob_is_named_as_its_json_twin_names_it(client, sid, bad):
    await addition_session(client, sid)
    body = first_turn()
    body["record"]["response"]["choices"][0]["meta_info"]["output_token_logprobs"][1][0] = bad
    as_json = json.dumps(body).encode()  # Infinity / NaN literals
    fields = []
    for raw, content_type in [(as_json, "application/json"), (to_msgpack(body), MSGPACK),
                              (to_packed_msgpack(body), MSGPACK)]:
        r = await post_raw(client, sid, raw, content_type)
        assert r.status_code == 422, r.text
        fields.append(r.json()["field"])
    assert fields == [f"{_META}.output_token_logprobs[1][0]"] * 3
    assert await stored(client, sid) == 0
