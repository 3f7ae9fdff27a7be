"""The narrowed MessagePack wire (`application/vnd.turnlog.narrow-r3+msgpack`, docs/ingest.md):
the R3 bin is a width byte and the values at that width. The oracle is the same turn
sent as JSON: the same replies, the same events read back, the same samples, the
same idempotency across the three wires; and every malformed bin is a 422 that
stores nothing. Every other test of the turn route runs on this wire too
(tests/api/test_turns.py).
"""

import base64
import json

import msgspec
import numpy as np
import pytest

from app.main import create_app
from tests.factory import open_body, r3_b64, turn
from tests.wire import MSGPACK, NARROW, narrowed, to_msgpack, to_narrow_msgpack, with_bin

L, K = 2, 2
FIELD = "record.response.choices[0].meta_info.routed_experts"


async def addition_session(client, sid, num_layers=L):
    r = await client.post("/v1/sessions", json=open_body(
        sid, pause_generation_mode="in_place", r3={"num_layers": num_layers}))
    assert r.status_code == 201, r.text


async def post_raw(client, sid, content, content_type=NARROW):
    return await client.post(f"/v1/sessions/{sid}/turns", content=content,
                             headers={"content-type": content_type})


def meta(body):
    return body["record"]["response"]["choices"][0]["meta_info"]


def r3_of(values):
    return base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode()


async def events(client, sid):
    return (await client.get(f"/v1/sessions/{sid}/events")).json()


async def stored(client, sid):
    return (await client.get(f"/v1/sessions/{sid}")).json()["num_nodes"]


@pytest.mark.parametrize(("high", "width"), [(128, 1), (128, 2), (128, 4), (60000, 2),
                                             (60000, 4)])
async def test_a_narrowed_turn_is_the_turn_json_carries(client, sid, high, width):
    await addition_session(client, sid)
    body = turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K, high=high), start=0, event_id="e0")
    first = await post_raw(client, sid, to_narrow_msgpack(body, width))
    assert first.status_code == 201, first.text
    assert first.json()["r3"] == {"start": 0, "end": 4}
    # The same turn on every wire, and at every width that holds it.
    again = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    assert again.status_code == 200 and again.json() == first.json()
    plain = await post_raw(client, sid, to_msgpack(body), MSGPACK)
    assert plain.status_code == 200 and plain.json() == first.json()
    for other in (w for w in (1, 2, 4) if high < 256 or w > 1):
        r = await post_raw(client, sid, to_narrow_msgpack(body, other))
        assert r.status_code == 200 and r.json() == first.json(), other
    evs = await events(client, sid)
    assert len(evs) == 2 and evs[1]["record"] == body["record"]
    page = msgspec.msgpack.decode((await client.get(
        f"/v1/sessions/{sid}/events", headers={"accept": MSGPACK})).content)
    assert meta(page[1])["routed_experts"] == base64.b64decode(meta(body)["routed_experts"])


async def test_a_json_turn_repeated_narrowed_is_the_same_turn_and_other_r3_is_409(client, sid):
    await addition_session(client, sid)
    body = turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0, event_id="e0")
    first = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    again = await post_raw(client, sid, to_narrow_msgpack(body))
    assert again.status_code == 200 and again.json() == first.json()
    other = turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K, seed=9), start=0, event_id="e0")
    r = await post_raw(client, sid, to_narrow_msgpack(other))
    assert r.status_code == 409 and r.json()["type"] == "urn:turnlog:idempotency-conflict"
    assert await stored(client, sid) == 1


async def test_samples_of_a_narrowed_session_equal_the_json_sessions(client, sid):
    """Two sessions, the same turns, one sent as JSON and one narrowed: the same
    samples and the same R3 tensor (the JSON path's is checked against a full
    forward elsewhere)."""
    rng = np.random.default_rng(3)
    turns = []
    prompt, start = [1, 2, 3], 0
    for t in range(3):
        out = [int(x) for x in rng.integers(10, 90, size=4)]
        rows = len(prompt) + len(out) - 1
        values = rng.integers(0, 300, size=(rows - start, L, K))
        turns.append(turn(prompt, out, r3=r3_of(values), start=start, event_id=f"e{t}",
                          **({} if t == 0 else {"parent": t - 1})))
        start = rows
        prompt = [*prompt, *out, int(rng.integers(10, 90))]
    answers = {}
    for wire in ("json", "narrow"):
        name = f"{sid}-{wire}"
        await addition_session(client, name)
        for body in turns:
            r = (await client.post(f"/v1/sessions/{name}/turns", json=body)) if wire == "json" \
                else await post_raw(client, name, to_narrow_msgpack(body))
            assert r.status_code == 201, r.text
        assert (await client.post(f"/v1/sessions/{name}/close", json={})).status_code == 200
        samples = (await client.get(f"/v1/sessions/{name}/samples")).json()
        r3 = await client.get(f"/v1/sessions/{name}/samples/0/r3")
        assert r3.status_code == 200, r3.text
        answers[wire] = (json.dumps(samples["samples"], sort_keys=True), r3.content)
    assert answers["json"] == answers["narrow"]


@pytest.mark.parametrize(("case", "payload", "expected"), [
    ("width 0", b"\x00" + b"\x01" * 16, "a first byte of 1, 2 or 4"),
    ("width 3", b"\x03" + b"\x01" * 48, "a first byte of 1, 2 or 4"),
    ("width 8", b"\x08" + b"\x01" * 128, "a first byte of 1, 2 or 4"),
    ("a width byte alone of no width", b"\x07", "a first byte of 1, 2 or 4"),
    ("not whole uint16 values", b"\x02" + b"\x01" * 31, "1 + a multiple of 2 bytes"),
    ("not whole int32 values", b"\x04" + b"\x01" * 62, "1 + a multiple of 4 bytes"),
    ("not divisible into rows", b"\x01" + b"\x01" * 15, "a positive multiple of 8 values"),
    ("values for more rows", b"\x01" + b"\x01" * 17, "a positive multiple of 8 values"),
    ("no values for four rows", b"\x01", "payload of 4 rows"),
])
async def test_a_bad_narrowed_bin_is_422_invalid_r3_storing_nothing(client, sid, case, payload,
                                                                    expected):
    await addition_session(client, sid)
    body = with_bin(turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0, event_id="e0"))
    meta(body)["routed_experts"] = payload
    r = await post_raw(client, sid, msgspec.msgpack.encode(body))
    assert r.status_code == 422, (case, r.text)
    problem = r.json()
    assert problem["type"] == "urn:turnlog:invalid-r3", problem
    assert problem["field"] == FIELD
    assert expected in str(problem["expected"]), problem
    assert await stored(client, sid) == 0


@pytest.mark.parametrize("empty", [b"", b"\x01", b"\x02", b"\x04"])
async def test_a_bin_of_no_values_is_the_empty_payload(client, sid, empty):
    await addition_session(client, sid)
    first = turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0, event_id="e0")
    assert (await post_raw(client, sid, to_narrow_msgpack(first))).status_code == 201
    body = with_bin(turn([1, 2, 3, 4, 5], [], start=4, return_r3=True, event_id="e1"))
    meta(body)["routed_experts"] = empty
    r = await post_raw(client, sid, msgspec.msgpack.encode(body))
    assert r.status_code == 201, r.text
    meta(body)["routed_experts"] = ""  # as JSON carries it
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=body)).status_code == 200
    assert meta((await events(client, sid))[-1])["routed_experts"] == ""


@pytest.mark.parametrize("empty", [b"", b"\x01"])
@pytest.mark.parametrize("r3", [True, False], ids=["r3-session", "no-r3-session"])
async def test_a_bin_of_no_values_is_empty_without_return_routed_experts(client, sid, empty, r3):
    """A turn that asks for no R3 may carry the empty payload on every wire."""
    if r3:
        await addition_session(client, sid)
    else:
        assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 201
    body = with_bin(turn([1, 2, 3], [4, 5], event_id="e0"))
    meta(body)["routed_experts"] = empty
    r = await post_raw(client, sid, msgspec.msgpack.encode(body))
    assert r.status_code == 201, r.text
    meta(body)["routed_experts"] = ""
    again = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    assert again.status_code == 200 and again.json() == r.json()
    meta(body)["routed_experts"] = b"\x07"  # a width byte of no width is not empty
    body["event_id"] = "e1"
    r = await post_raw(client, sid, msgspec.msgpack.encode(body))
    assert r.status_code == 422 and r.json()["field"] == FIELD


@pytest.mark.parametrize(("case", "raw"), [
    ("trailing bytes", to_narrow_msgpack(turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
     + b"\x00"),
    ("a bin elsewhere", msgspec.msgpack.encode({"event_id": b"e0", "record": {}})),
    ("an ext", b"\xd4\x05\x00"),
    ("not MessagePack", b"\xc1"),
])
async def test_malformed_narrowed_msgpack_is_422_invalid_request(client, sid, case, raw):
    await addition_session(client, sid)
    r = await post_raw(client, sid, raw)
    assert r.status_code == 422, (case, r.text)
    # A value refused where it stands is named there (`event_id`), the rest `body`.
    field = "event_id" if case == "a bin elsewhere" else "body"
    assert r.json()["type"] == "urn:turnlog:invalid-request" and r.json()["field"] == field
    assert await stored(client, sid) == 0


@pytest.mark.parametrize("content_type", [
    NARROW, "Application/Vnd.Turnlog.Narrow-R3+MsgPack; charset=binary"])
async def test_the_narrowed_media_type_is_read_case_insensitively(client, sid, content_type):
    await addition_session(client, sid)
    body = turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0, event_id="e0")
    r = await post_raw(client, sid, to_narrow_msgpack(body), content_type)
    assert r.status_code == 201, r.text


async def test_opens_do_not_read_the_narrowed_wire(client, sid):
    r = await client.post("/v1/sessions", content=msgspec.msgpack.encode(open_body(sid)),
                          headers={"content-type": NARROW})
    assert r.status_code == 415 and r.json()["field"] == "content-type"


@pytest.mark.parametrize("route", ["bare", "fastapi"])
@pytest.mark.parametrize("offload_body_bytes", [16 << 20, 2000], ids=["on-loop", "offloaded"])
async def test_a_large_narrowed_turn_is_read_where_it_lies(settings, sid, offload_body_bytes,
                                                          route):
    """A body above the large-body size, its R3 a bin 32 (64 KiB or more): located by
    the typed pass and used as a view of the body, on the loop or a worker thread, by
    the bare append route and by FastAPI's."""
    import httpx

    app = create_app(settings.replace(large_body_bytes=2000,
                                      offload_body_bytes=offload_body_bytes))
    if route == "fastapi":
        del app.router.routes[0]  # the bare route (tests/api/test_hotpath.py)
    layers, topk = 4, 8
    prompt, output = list(range(100, 2100)), list(range(7, 107))
    rows = len(prompt) + len(output) - 1
    body = turn(prompt, output, r3=r3_b64(rows, layers, topk, high=256), start=0,
                event_id="e0")
    raw = to_narrow_msgpack(body)
    assert len(narrowed(base64.b64decode(meta(body)["routed_experts"]))) > 1 << 16
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://turnlog") as client:
            await addition_session(client, sid, layers)
            r = await post_raw(client, sid, raw)
            assert r.status_code == 201, r.text
            again = await client.post(f"/v1/sessions/{sid}/turns", json=body)
            assert again.status_code == 200 and again.json() == r.json()
            assert (await events(client, sid))[1]["record"] == body["record"]
    finally:
        await app.state.services.db.dispose()
