"""The body limit answers 413 before anything is parsed, with or without Content-Length."""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from app.main import create_app
from tests.factory import open_body, turn
from tests.wire import MSGPACK, to_msgpack

LIMIT = 2000


@pytest.fixture
async def small(settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings.replace(max_body_bytes=LIMIT))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        yield http
    await app.state.services.db.dispose()


def chunked(raw: bytes, size: int = 256):
    async def stream():
        for i in range(0, len(raw), size):
            yield raw[i:i + size]
    return stream()


async def test_chunked_body_over_limit_is_413_and_stores_nothing(small, sid):
    assert (await small.post("/v1/sessions", json=open_body(sid))).status_code == 201
    raw = json.dumps(turn(list(range(1, 1000)), [1])).encode()
    assert len(raw) > LIMIT
    r = await small.post(f"/v1/sessions/{sid}/turns", content=chunked(raw),
                         headers={"content-type": "application/json"})
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in r.request.headers
    assert r.status_code == 413
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == "urn:turnlog:too-large"
    assert (await small.get(f"/v1/sessions/{sid}")).json()["num_nodes"] == 0


async def test_chunked_body_under_limit_is_read_whole(small, sid):
    assert (await small.post("/v1/sessions", json=open_body(sid))).status_code == 201
    raw = json.dumps(turn([1, 2, 3], [4])).encode()
    r = await small.post(f"/v1/sessions/{sid}/turns", content=chunked(raw, 7),
                         headers={"content-type": "application/json"})
    assert r.status_code == 201, r.text


async def test_declared_length_over_limit_is_413_without_reading(small, sid):
    r = await small.post("/v1/sessions", content=b"{" + b" " * LIMIT + b"}",
                         headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["type"] == "urn:turnlog:too-large"


@pytest.mark.parametrize("route", ["/v1/sessions", "/v1/metric-history", "/v1/gates/evaluate"])
async def test_every_body_route_is_limited(small, route):
    raw = json.dumps({"padding": "x" * LIMIT}).encode()
    r = await small.post(route, content=chunked(raw), headers={"content-type": "application/json"})
    assert r.status_code == 413


# -- width: what a body decodes into, bounded before it is decoded (issue 21) --------------

VALUES = 1000


@pytest.fixture
async def narrow(settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings.replace(max_body_values=VALUES))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        yield http
    await app.state.services.db.dispose()


def wide_bodies(wire: str, kind: str) -> bytes:
    """A body of 5,000 empty containers (or scalars) on `wire`, far under the byte limit."""
    item = {"arrays": [], "maps": {}, "ints": 0}[kind]
    body = {"event_id": "e-wide", "record": {"wide": [item] * 5000}}
    return to_msgpack(body) if wire == "msgpack" else json.dumps(body).encode()


@pytest.mark.parametrize("wire", ["json", "msgpack"])
@pytest.mark.parametrize("kind", ["arrays", "maps", "ints"])
async def test_a_body_decoding_into_too_many_values_is_413(narrow, sid, wire, kind):
    assert (await narrow.post("/v1/sessions", json=open_body(sid))).status_code == 201
    r = await narrow.post(f"/v1/sessions/{sid}/turns", content=wide_bodies(wire, kind),
                          headers={"content-type": MSGPACK if wire == "msgpack"
                                   else "application/json"})
    assert r.status_code == 413, r.text
    problem = r.json()
    assert problem["field"] == "body" and str(VALUES) in problem["expected"]
    assert (await narrow.get(f"/v1/sessions/{sid}")).json()["num_nodes"] == 0
    # An ordinary turn (and open) under the same limit is served.
    ok = turn(list(range(1, 200)), [7, 8])
    content = to_msgpack(ok) if wire == "msgpack" else json.dumps(ok).encode()
    r = await narrow.post(f"/v1/sessions/{sid}/turns", content=content, headers={
        "content-type": MSGPACK if wire == "msgpack" else "application/json"})
    assert r.status_code == 201, r.text


async def test_every_json_body_is_bounded_in_values(narrow, sid):
    wide = json.dumps(open_body(sid, labels={f"k{i}": "v" for i in range(3000)})).encode()
    r = await narrow.post("/v1/sessions", content=wide,
                          headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert (await narrow.get(f"/v1/sessions/{sid}")).status_code == 404


def test_the_value_count_matches_a_full_decode():
    # The oracle: a recursive count over the decoded value (keys counted as values).
    import msgspec

    from app.domain.wire.width import msgpack_values

    def count(v):
        if isinstance(v, dict):
            return 1 + sum(1 + count(x) for x in v.values())
        if isinstance(v, list):
            return 1 + sum(count(x) for x in v)
        return 1

    docs = [{"a": [1, 2.5, None, True, "x" * 40, b"\0" * 300, -5, 2**40, -2**40, "é" * 100],
             "b": {"c": [[], {}], "d": "y" * 70_000, "e": b"z" * 70_000}},
            [list(range(70_000)), [1.5] * 10, {str(i): i for i in range(40)}]]
    for doc in docs:
        raw = msgspec.msgpack.encode(doc)
        assert msgpack_values(raw, 10**9) == count(doc)
        assert msgpack_values(raw, 10) == 11  # stops just past the limit


# -- upload slots: held only by bodies that keep arriving, taken by chunked bodies too ---

def big_turn() -> bytes:
    return json.dumps(turn(list(range(1, 2000)), [7, 8])).encode()  # ~30 kB


async def post_streamed_turn(http: httpx.AsyncClient, sid: str, chunks: Any,
                             length: int) -> httpx.Response:
    """A turn whose body arrives as `chunks` (an async iterator), with its length declared."""
    return await http.post(f"/v1/sessions/{sid}/turns", content=chunks, headers={
        "content-type": "application/json", "content-length": str(length)})


async def test_a_trickling_slot_holder_is_408_and_frees_its_slot(settings, sid):
    app = create_app(settings.replace(
        large_body_bytes=1000, max_large_uploads=1,
        min_upload_rate=1_000_000, upload_grace_s=0.05))
    raw = big_turn()

    async def trickle():
        for i in range(0, len(raw), 100):
            yield raw[i:i + 100]
            await asyncio.sleep(0.5)  # far slower than 1 MB/s once the grace is over

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        assert (await http.post("/v1/sessions", json=open_body(sid))).status_code == 201
        r = await post_streamed_turn(http, sid, trickle(), len(raw))
        assert r.status_code == 408, r.text
        assert r.json()["field"] == "body"
        # The slot is free again: a large turn sent at once is served.
        r = await http.post(f"/v1/sessions/{sid}/turns", content=raw,
                            headers={"content-type": "application/json"})
        assert r.status_code == 201, r.text
    await app.state.services.db.dispose()


async def test_a_slot_holder_keeping_its_pace_is_served_past_the_first_deadline(settings,
                                                                                sid):
    # The hot path keeps one timeout scope per body and moves it as bytes arrive: a
    # body sent at four times the minimum rate outlives the first byte's deadline by
    # far (and keeps twice the rate even if a loaded machine halves the sender's pace).
    app = create_app(settings.replace(
        large_body_bytes=1000, max_large_uploads=1,
        min_upload_rate=1000, upload_grace_s=0.3))
    raw = json.dumps(turn(list(range(1, 1000)), [7, 8])).encode()
    assert len(raw) > 2 * 4000 * 0.3  # takes well past the first byte's deadline

    async def steady():
        for i in range(0, len(raw), 200):
            yield raw[i:i + 200]
            await asyncio.sleep(0.05)  # 4000 bytes/s: four times the minimum

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        assert (await http.post("/v1/sessions", json=open_body(sid))).status_code == 201
        r = await post_streamed_turn(http, sid, steady(), len(raw))
        assert r.status_code == 201, r.text
    await app.state.services.db.dispose()


@pytest.mark.parametrize("gap", [0.05, 1.5])
async def test_each_read_of_a_turn_body_is_timed_not_the_whole_body(settings, sid, gap):
    # One timer per request (limits.ReadWatch), re-armed for the read in progress:
    # reads 0.05 s apart outlive a 0.5 s timeout by far; one gap of 1.5 s is a 408.
    app = create_app(settings.replace(body_timeout_s=0.5))
    raw = json.dumps(turn(list(range(1, 300)), [7, 8])).encode()
    gaps = [0.05] * 16 if gap < 0.5 else [0.0, gap]

    async def paced_body():
        step = -(-len(raw) // len(gaps))
        for i, pause in enumerate(gaps):
            await asyncio.sleep(pause)
            yield raw[i * step:(i + 1) * step]

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        assert (await http.post("/v1/sessions", json=open_body(sid))).status_code == 201
        r = await post_streamed_turn(http, sid, paced_body(), len(raw))
        if gap < 0.5:
            assert r.status_code == 201, r.text
        else:
            assert r.status_code == 408, r.text
            assert r.json()["field"] == "body"
            assert "no data" in r.json()["detail"]
        # The connection's next request is served as usual.
        assert (await http.get(f"/v1/sessions/{sid}")).status_code == 200
    await app.state.services.db.dispose()


async def test_a_chunked_turn_waits_for_an_upload_slot(settings, sid):
    # Issue 21: a body without Content-Length never took a slot, so any number of
    # 49 MB chunked turns were read and decoded at once.
    app = create_app(settings.replace(large_body_bytes=1000,
                                      max_large_uploads=1))
    raw = big_turn()
    holding, release = asyncio.Event(), asyncio.Event()
    second_started = asyncio.Event()

    async def first():
        yield raw[:100]
        holding.set()
        await release.wait()
        yield raw[100:]

    async def second():
        second_started.set()
        yield raw

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        assert (await http.post("/v1/sessions", json=open_body(sid))).status_code == 201
        other = sid + "-b"
        assert (await http.post("/v1/sessions", json=open_body(other))).status_code == 201
        headers = {"content-type": "application/json"}
        a = asyncio.create_task(http.post(f"/v1/sessions/{sid}/turns", content=first(),
                                          headers=headers))
        await holding.wait()
        b = asyncio.create_task(http.post(f"/v1/sessions/{other}/turns", content=second(),
                                          headers=headers))
        for _ in range(50):  # let the second request run as far as it can
            await asyncio.sleep(0.01)
        assert not second_started.is_set(), "a chunked body was read without a slot"
        release.set()
        ra, rb = await a, await b
        assert ra.status_code == rb.status_code == 201, (ra.text, rb.text)
        assert ra.request.headers.get("transfer-encoding") == "chunked"
    await app.state.services.db.dispose()


async def test_a_large_body_waits_for_a_slot_only_so_long_then_503(settings, sid):
    # Slots held by slow uploads that keep the minimum pace may be held for minutes;
    # a body waiting behind them was held as long (its client could only time out).
    # Now it waits at most TURNLOG_BODY_TIMEOUT_S, then 503 `overloaded`, Retry-After.
    app = create_app(settings.replace(large_body_bytes=1000, max_large_uploads=1,
                                      body_timeout_s=0.5))
    raw = big_turn()
    release = asyncio.Event()

    async def held():
        yield raw[:100]
        while not release.is_set():  # a read every 0.1 s: within the body timeout
            await asyncio.sleep(0.1)
            yield b""
        yield raw[100:]

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        assert (await http.post("/v1/sessions", json=open_body(sid))).status_code == 201
        other = sid + "-b"
        assert (await http.post("/v1/sessions", json=open_body(other))).status_code == 201
        headers = {"content-type": "application/json", "content-length": str(len(raw))}
        first = asyncio.create_task(http.post(f"/v1/sessions/{sid}/turns", content=held(),
                                              headers=headers))
        await asyncio.sleep(0.1)
        waited = time.monotonic()
        r = await asyncio.wait_for(  # (it waited for ever before)
            http.post(f"/v1/sessions/{other}/turns", content=raw, headers=headers), 10)
        waited = time.monotonic() - waited
        assert r.status_code == 503, r.text
        problem = r.json()
        assert problem["type"] == "urn:turnlog:overloaded" and problem["field"] == "body"
        assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        assert 0.4 < waited < 5, waited
        release.set()
        assert (await first).status_code == 201
        # Nothing of the refused body was stored; with the slot free it goes in.
        assert (await http.get(f"/v1/sessions/{other}")).json()["num_nodes"] == 0
        r = await http.post(f"/v1/sessions/{other}/turns", content=raw, headers=headers)
        assert r.status_code == 201, r.text
    await app.state.services.db.dispose()
