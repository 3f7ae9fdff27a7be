"""`turnlog_client`: typed errors, retries that are safe, and every read docs/api.md offers."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import random
import struct
import uuid

import httpx
import msgspec
import numpy as np
import pytest

from app.main import create_app
from app.sim.simulator import SessionSimulator, SimConfig, route
from tests.factory import r3_b64, turn
from turnlog_client import TurnlogClient
from turnlog_client.async_client import _encode_turn
from turnlog_client.errors import TurnlogConnectionError, TurnlogError
from turnlog_client.sync import SyncTurnlogClient


@pytest.fixture
async def app(settings):
    app = create_app(settings)
    yield app
    await app.state.services.db.dispose()


@pytest.fixture
async def tl(app):
    async with TurnlogClient("http://turnlog", transport=httpx.ASGITransport(app=app),
                             backoff=0.001) as client:
        yield client


def decoded(request: httpx.Request) -> dict:
    """A sent body, whichever wire it went on."""
    if not request.content:
        return {}
    if request.headers.get("content-type") in ("application/msgpack",
                                               "application/vnd.turnlog.narrow-r3+msgpack"):
        return msgspec.msgpack.decode(request.content)
    return json.loads(request.content)


def flaky(app, failures: list[object]):
    """A transport that fails the first requests as listed (a status or an exception),
    then hands over to the app; it records every body it was sent."""
    inner = httpx.ASGITransport(app=app)
    sent: list[dict] = []

    class Flaky(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            sent.append(decoded(request))
            if failures:
                failure = failures.pop(0)
                if isinstance(failure, Exception):
                    raise failure
                return httpx.Response(failure, headers={"retry-after": "0"}, json={
                    "type": "urn:turnlog:unavailable", "status": failure, "title": "x",
                    "detail": "database unavailable"})
            return await inner.handle_async_request(request)

    return Flaky(), sent


async def test_problem_details_become_typed_errors(tl, sid):
    await tl.open(session_id=sid, version="v2")
    with pytest.raises(TurnlogError) as caught:
        await tl.open(session_id=sid, version="v1")
    error = caught.value
    assert (error.status, error.slug, error.type) == (409, "session-conflict",
                                                      "urn:turnlog:session-conflict")
    assert (error.field, error.expected, error.actual) == ("version", '"v2"', '"v1"')
    assert error.problem["title"]
    with pytest.raises(TurnlogError) as caught:
        await tl.append(sid, turn([], [2])["record"])  # an empty prompt
    assert caught.value.status == 422 and caught.value.event_id is not None


async def test_open_generates_a_session_id_and_repeats_idempotently(tl):
    summary = await tl.open(version="v2", labels={"run_id": "c"})
    assert len(summary["session_id"]) == 32
    again = await tl.open(session_id=summary["session_id"], version="v2",
                          labels={"run_id": "c"})
    assert again["session_id"] == summary["session_id"]


async def test_retries_reuse_the_generated_event_id(app, sid):
    transport, sent = flaky(app, [503, httpx.ReadError("reset"), httpx.ConnectTimeout("slow")])
    async with TurnlogClient("http://turnlog", transport=transport, backoff=0.001) as client:
        await client.open(session_id=sid, version="v2")  # absorbs the three failures
        reply = await client.append(sid, turn([1, 2], [3])["record"])
        assert reply["seq"] == 0
    assert [body.get("session_id") for body in sent[:4]] == [sid] * 4
    transport, sent = flaky(app, [500, 502])
    async with TurnlogClient("http://turnlog", transport=transport, backoff=0.001) as client:
        await client.append(sid, turn([1, 2, 3, 4], [5])["record"])
    assert len(sent) == 3 and len({body["event_id"] for body in sent}) == 1


async def test_client_errors_are_never_retried(app, sid):
    transport, sent = flaky(app, [])
    async with TurnlogClient("http://turnlog", transport=transport, backoff=0.001) as client:
        with pytest.raises(TurnlogError) as caught:
            await client.append(sid, turn([1], [2])["record"])
    assert caught.value.slug == "unknown-session" and len(sent) == 1


async def test_exhausted_retries_name_the_event_id(app, sid):
    transport, sent = flaky(app, [httpx.ConnectError("refused")] * 3)
    async with TurnlogClient("http://turnlog", transport=transport, retries=2,
                             backoff=0.001) as client:
        with pytest.raises(TurnlogConnectionError) as caught:
            await client.append(sid, turn([1], [2])["record"], event_id="mine")
    assert caught.value.event_id == "mine" and caught.value.status is None
    assert isinstance(caught.value.__cause__, httpx.ConnectError) and len(sent) == 3


async def test_reads_samples_r3_events_feed_and_sessions(tl):
    run = f"run-{uuid.uuid4().hex[:8]}"
    sids = []
    for k in range(3):
        config = SimConfig(session_id=f"c-{uuid.uuid4().hex}", version="v1",
                           pause_generation_mode="in_place", labels={"run_id": run})
        sim = SessionSimulator(config, random.Random(k))
        summary = await tl.open(sim.open_body())
        if not sids:
            page = await tl.feed(limit=1000)
            cursor = page.next
            while page.events:
                page = await tl.feed(after=cursor, limit=1000)
                cursor = page.next
        for i in range(3):
            await tl.append_body(summary["session_id"], sim.turn(None if i == 0 else i - 1))
        samples = await tl.close(summary["session_id"], metadata={"reward": 1.0})
        assert samples["samples"][0]["reward"] == 1.0
        sids.append(summary["session_id"])

    state = await tl.resume(sids[0])
    assert state["active_leaf"] == 2 and state["status"] == "closed"
    sample = (await tl.samples(sids[0]))["samples"][0]
    tensor = await tl.r3(sids[0], 0)
    assert tensor.tobytes() == route(np.asarray(sample["tokens"]), 2, 2, 16).tobytes()
    events = await tl.all_events(sids[0], include_r3=False, page_size=2)
    assert [e["type"] for e in events] == ["session_opened"] + ["turn_recorded"] * 3 + [
        "session_closed"]
    assert "routed_experts" not in events[1]["record"]["response"]["choices"][0]["meta_info"]

    listed = [s["session_id"] async for s in tl.iter_sessions(
        status="closed", labels={"run_id": run}, page_size=2)]
    assert listed == sids
    followed = [e async for e in tl.follow(after=cursor, wait=0, limit=4, until_idle=True)]
    assert [e["session_id"] for e in followed if e["type"] == "session_closed"] == sids
    assert len({e["position"] for e in followed}) == len(followed)


def test_sync_client(settings, sid):
    app = create_app(settings)
    with SyncTurnlogClient("http://turnlog", transport=httpx.ASGITransport(app=app)) as tl:
        try:
            tl.open(session_id=sid, version="v2")
            assert tl.append(sid, turn([1, 2], [3])["record"])["seq"] == 0
            assert tl.state(sid)["checkpoint_token_ids"] == [1, 2, 3]
            with pytest.raises(TurnlogError):
                tl.samples(sid)  # still open
            tl.close(sid)
            assert [s["session_id"] for s in tl.iter_sessions(status="closed")][-1:] == [sid]
        finally:
            tl._run(app.state.services.db.dispose())


def recording(app):
    """A transport that hands every request to the app and keeps it."""
    inner = httpx.ASGITransport(app=app)
    seen: list[httpx.Request] = []

    class Recording(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            seen.append(request)
            return await inner.handle_async_request(request)

    return Recording(), seen


def r3_turn(seed: int = 0, **over):
    body = turn([1, 2, 3], [4, 5], r3=r3_b64(4, 2, 2, seed=seed), start=0, **over)
    return body["record"]


def meta_of(record):
    return record["response"]["choices"][0]["meta_info"]


@pytest.mark.parametrize("wire", [None, "msgpack"], ids=["default", "msgpack"])
async def test_turns_go_as_msgpack_with_r3_as_bin(app, sid, wire):
    """By default the R3 bin is narrowed (a width byte, then uint8 values here); on the
    "msgpack" wire it is the raw int32 bytes. Either way the same turn is stored."""
    transport, seen = recording(app)
    record = r3_turn()
    before = json.dumps(record)
    async with TurnlogClient("http://turnlog", transport=transport,
                             **({} if wire is None else {"wire": wire})) as client:
        assert client.wire == (wire or "narrow")
        await client.open(session_id=sid, version="v2", pause_generation_mode="in_place",
                          r3={"num_layers": 2})
        reply = await client.append(sid, record, event_id="e0")
        assert reply["r3"] == {"start": 0, "end": 4}
        events = await client.events(sid)
    sent = seen[1]
    int32 = base64.b64decode(meta_of(record)["routed_experts"])
    body = msgspec.msgpack.decode(sent.content)
    if wire is None:
        assert sent.headers["content-type"] == "application/vnd.turnlog.narrow-r3+msgpack"
        values = struct.unpack(f"<{len(int32) // 4}i", int32)
        assert meta_of(body["record"])["routed_experts"] == bytes([1, *values])
    else:
        assert sent.headers["content-type"] == "application/msgpack"
        assert meta_of(body["record"])["routed_experts"] == int32
    assert json.dumps(record) == before  # the caller's record is left as it was
    assert events[1]["record"] == record  # read back as the session server wrote it


@pytest.mark.parametrize(("values", "width", "code"), [
    ([0, 7, 255], 1, "B"), ([0, 256, 65535], 2, "H"), ([0, 65536], 4, "i"),
    ([-1, 3], 4, "i"), ([2**31 - 1, 0], 4, "i")])
def test_the_r3_bin_is_narrowed_to_the_narrowest_width_that_holds_it(values, width, code):
    text = base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()
    record = turn([1, 2], [3])["record"]
    meta_of(record)["routed_experts"] = text
    sent, kind = _encode_turn({"event_id": "e", "record": record}, "narrow")
    assert kind == "application/vnd.turnlog.narrow-r3+msgpack"
    got = meta_of(msgspec.msgpack.decode(sent)["record"])["routed_experts"]
    assert got == bytes([width]) + struct.pack(f"<{len(values)}{code}", *values)


@pytest.mark.parametrize(("payload", "kind", "sent"), [
    # text of bytes that are not whole int32 values: kept as text, refused as in JSON
    ("AAAA", "application/vnd.turnlog.narrow-r3+msgpack", "AAAA"),
    # int32 bytes given as bytes: narrowed like text
    (struct.pack("<2i", 5, 300), "application/vnd.turnlog.narrow-r3+msgpack",
     b"\x02" + struct.pack("<2H", 5, 300)),
    # bytes that are not whole int32 values: only the plain wire carries them as they are
    (b"\x01\x02\x03", "application/msgpack", b"\x01\x02\x03"),
])
def test_r3_that_cannot_be_narrowed_goes_as_it_is(payload, kind, sent):
    record = turn([1, 2], [3])["record"]
    meta_of(record)["routed_experts"] = payload
    raw, got_kind = _encode_turn({"event_id": "e", "record": record}, "narrow")
    assert got_kind == kind
    assert meta_of(msgspec.msgpack.decode(raw)["record"])["routed_experts"] == sent


async def test_a_server_without_the_narrowed_wire_gets_plain_msgpack_from_then_on(app, sid):
    """A server older than the narrowed wire answers its media type 415 and stores
    nothing: the client sends the same turn (the same event id) as plain MessagePack,
    and every later turn straight away so."""
    inner = httpx.ASGITransport(app=app)
    seen: list[httpx.Request] = []

    class Older(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            seen.append(request)
            if request.headers.get("content-type", "").startswith("application/vnd.turnlog"):
                return httpx.Response(415, json={
                    "type": "urn:turnlog:unsupported-media-type", "status": 415,
                    "title": "Unsupported media type", "field": "content-type",
                    "detail": "a turn's body must be JSON or MessagePack"},
                    headers={"content-type": "application/problem+json"})
            return await inner.handle_async_request(request)

    async with TurnlogClient("http://turnlog", transport=Older()) as client:
        await client.open(session_id=sid, version="v2", pause_generation_mode="in_place",
                          r3={"num_layers": 2})
        first = await client.append(sid, r3_turn(), event_id="e0")
        assert first["seq"] == 0 and client.wire == "msgpack"
        second = await client.append(sid, turn([1, 2, 3, 4, 5, 6], [7], r3=r3_b64(2, 2, 2),
                                               start=4)["record"], event_id="e1")
        assert second["seq"] == 1
    kinds = [r.headers.get("content-type") for r in seen[1:]]
    assert kinds == ["application/vnd.turnlog.narrow-r3+msgpack", "application/msgpack",
                     "application/msgpack"]
    assert [decoded(r)["event_id"] for r in seen[1:]] == ["e0", "e0", "e1"]


async def test_any_other_refusal_of_a_narrowed_turn_is_raised_not_resent(app, sid):
    transport, seen = recording(app)
    async with TurnlogClient("http://turnlog", transport=transport) as client:
        await client.open(session_id=sid, version="v2")  # no R3 asked for: a bin is 422
        with pytest.raises(TurnlogError) as caught:
            await client.append(sid, r3_turn(), event_id="e0")
        assert client.wire == "narrow"
    assert caught.value.status == 422 and len(seen) == 2


async def appended(app, sid, record) -> bytes:
    """The body the default client sends to append `record` (which it leaves as it was)."""
    transport, seen = recording(app)
    before = json.dumps(record)
    async with TurnlogClient("http://turnlog", transport=transport) as client:
        await client.open(session_id=sid, version="v2")
        with contextlib.suppress(TurnlogError):  # the server's verdict is not the point
            await client.append(sid, record, event_id="e0")
    assert json.dumps(record) == before
    return seen[-1].content


@pytest.mark.parametrize(("ids", "packs"), [
    (list(range(100, 140)), True),
    ([0, 2**32 - 1, *range(20)], True),  # the uint32 range, end to end
    (list(range(15)), False),  # too short to gain anything
    ([True, *range(20)], False),  # a boolean is not a token id: sent as it is
    ([-1, *range(20)], False),
    ([2**32, *range(20)], False),
    ([1.0, *range(20)], False),
])
async def test_a_long_prompt_goes_packed_as_uint32_items(app, sid, ids, packs):
    sent = await appended(app, sid, turn(ids, [3])["record"])
    assert msgspec.msgpack.decode(sent)["record"]["request"]["input_ids"] == ids
    assert type(msgspec.msgpack.decode(sent)["record"]["request"]["input_ids"][0]) is \
        type(ids[0])
    packed = struct.pack(">BI", 0xDD, len(ids)) + b"".join(
        struct.pack(">BI", 0xCE, int(i)) for i in ids if 0 <= i < 2**32)
    assert (packed in sent) == packs


@pytest.mark.parametrize(("entries", "packs"), [
    ([[-0.25 * i, 100 + i] for i in range(20)], True),
    ([[-0.25 * i, 100 + i, None] for i in range(20)], True),  # SGLang's null text
    ([[-0.25 * i, 100 + i] for i in range(15)], False),  # too short
    ([[-0.25 * i, 100 + i, "t"] for i in range(20)], False),  # text, not null
    ([[-0.25 * i, 100 + i] for i in range(19)] + [[0, 7]], False),  # an int log-prob
    ([[-0.25 * i, 100 + i] for i in range(19)] + [[-1.0, 7, None]], False),  # mixed
    ([[-0.25 * i, 100 + i] for i in range(19)] + [[-1.0, True]], False),
])
async def test_output_entries_go_packed_at_fixed_width(app, sid, entries, packs):
    record = turn([1, 2, 3], [e[1] for e in entries])["record"]
    record["response"]["choices"][0]["meta_info"]["output_token_logprobs"] = entries
    sent = await appended(app, sid, record)
    decoded = msgspec.msgpack.decode(sent)["record"]["response"]["choices"][0]
    assert decoded["meta_info"]["output_token_logprobs"] == entries
    first = struct.pack(">BBdBI", 0x90 + len(entries[0]), 0xCB, entries[0][0], 0xCE,
                        entries[0][1])
    assert (struct.pack(">BI", 0xDD, len(entries)) + first in sent) == packs


@pytest.mark.parametrize("body", [
    # choices as a map: sent as the map it is (the server refuses its int key)
    {"event_id": "e", "record": {"request": {"input_ids": list(range(16))}, "response": {
        "choices": {0: {"meta_info": {"output_token_logprobs": [[-0.1, i] for i in range(16)],
                                      "routed_experts": r3_b64(4, 2, 2)}}}}}},
    # a third item that is not null (and not hashable): not packed, still MessagePack
    {"event_id": "e", "record": {"request": {"input_ids": [1]}, "response": {"choices": [
        {"meta_info": {"output_token_logprobs": [[-0.1, i, {"a": 1}] for i in range(16)]}}]}}},
])
def test_what_cannot_be_packed_is_sent_as_it_is(body):
    sent, kind = _encode_turn(body, "msgpack")
    assert kind == "application/msgpack"
    assert sent == msgspec.msgpack.encode(body)  # nothing rewritten


async def test_wire_json_sends_the_record_as_is_and_repeats_match(app, sid):
    transport, seen = recording(app)
    record = r3_turn()
    async with TurnlogClient("http://turnlog", transport=transport, wire="json") as as_json, \
            TurnlogClient("http://turnlog", transport=transport) as as_msgpack:
        await as_json.open(session_id=sid, version="v2", pause_generation_mode="in_place",
                           r3={"num_layers": 2})
        first = await as_msgpack.append(sid, record, event_id="e0")
        again = await as_json.append(sid, record, event_id="e0")
    assert again == first
    assert seen[-1].headers["content-type"] == "application/json"
    assert json.loads(seen[-1].content)["record"] == record
    with pytest.raises(ValueError):
        TurnlogClient("http://turnlog", wire="cbor")


@pytest.mark.parametrize("wire", ["narrow", "msgpack", "json"])
@pytest.mark.parametrize("bad", ["non-canonical", "not whole int32"])
async def test_a_bad_base64_payload_is_refused_on_every_wire(app, sid, wire, bad):
    record = r3_turn()
    text = meta_of(record)["routed_experts"]
    meta_of(record)["routed_experts"] = "AAAA" if bad == "not whole int32" else \
        text[:-2] + ("B" if text[-2] != "B" else "C") + "="
    async with TurnlogClient("http://turnlog", transport=httpx.ASGITransport(app=app),
                             wire=wire) as client:
        await client.open(session_id=sid, version="v2", pause_generation_mode="in_place",
                          r3={"num_layers": 2})
        with pytest.raises(TurnlogError) as caught:
            await client.append(sid, record)
    assert caught.value.slug == "invalid-r3"


async def test_ints_beyond_64_bits_go_as_json_for_the_server_to_refuse(app, sid):
    record = turn([1, 2**70], [3])["record"]
    transport, seen = recording(app)
    async with TurnlogClient("http://turnlog", transport=transport) as client:
        await client.open(session_id=sid, version="v2")
        with pytest.raises(TurnlogError) as caught:
            await client.append(sid, record)
    assert caught.value.field == "record.request.input_ids[1]"
    assert seen[-1].headers["content-type"] == "application/json"


class NpyTransport(httpx.AsyncBaseTransport):
    """Serves fixed bytes for every request, in chunks of `size` bytes."""

    def __init__(self, data: bytes, size: int) -> None:
        self.data, self.size = data, size

    async def handle_async_request(self, request):
        data, size = self.data, self.size

        class Stream(httpx.AsyncByteStream):
            async def __aiter__(self):
                for i in range(0, len(data), size):
                    yield data[i:i + size]

        return httpx.Response(200, headers={"content-type": "application/x-npy"},
                              stream=Stream())


def npy_bytes(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


@pytest.mark.parametrize("size", [1, 3, 7, 128, 1 << 20])
async def test_r3_streams_into_one_array_whatever_the_chunking(size):
    array = np.arange(5 * 3 * 2, dtype="<i4").reshape(5, 3, 2)
    async with TurnlogClient("http://t", transport=NpyTransport(npy_bytes(array), size)) as c:
        got = await c.r3("s", 0)
    assert got.dtype == np.dtype("<i4") and got.shape == (5, 3, 2)
    assert got.tobytes() == array.tobytes()


@pytest.mark.parametrize("mangle", [
    lambda b: b[:-4],            # short
    lambda b: b + b"\0\0\0\0",   # long
    lambda b: b[:20],            # header cut
    lambda b: b"NOTNPY" + b[6:],  # not .npy
])
async def test_a_damaged_npy_reply_is_an_error_not_a_wrong_array(mangle):
    data = mangle(npy_bytes(np.zeros((4, 2, 2), dtype="<i4")))
    async with TurnlogClient("http://t", transport=NpyTransport(data, 16)) as c:
        with pytest.raises(ValueError):
            await c.r3("s", 0)


async def test_r3_of_an_unknown_session_is_a_typed_error(tl, sid):
    with pytest.raises(TurnlogError) as caught:
        await tl.r3(sid, 0)
    assert caught.value.slug == "unknown-session"


async def canned_server(reply: bytes, size: int):
    """A loopback HTTP server answering every request with `reply`, `size` bytes a write."""
    requests: list[bytes] = []

    async def handle(reader, writer):
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        for i in range(0, len(reply), size):
            writer.write(reply[i:i + size])
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], requests


def http_reply(status: int, body: bytes, content_type: str = "application/x-npy") -> bytes:
    return (f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


@pytest.mark.parametrize("size", [1, 5, 100, 1 << 20])
async def test_r3_fast_path_receives_into_the_array(size):
    array = np.arange(7 * 3 * 2, dtype="<i4").reshape(7, 3, 2)
    server, port, requests = await canned_server(http_reply(200, npy_bytes(array)), size)
    async with server, TurnlogClient(f"http://127.0.0.1:{port}/prefix", token="t") as client:
        assert client._fast is not None
        got = await client.r3("s1", 0)
    assert got.shape == (7, 3, 2) and got.tobytes() == array.tobytes()
    head = requests[0].decode().lower()
    assert head.startswith("get /prefix/v1/sessions/s1/samples/0/r3 http/1.1")
    assert "authorization: bearer t" in head and "accept-encoding: identity" in head


async def test_r3_fast_path_turns_problems_into_typed_errors():
    problem = json.dumps({"type": "urn:turnlog:session-open", "title": "x", "status": 409,
                          "detail": "open"}).encode()
    server, port, _ = await canned_server(http_reply(409, problem, "application/problem+json"),
                                          7)
    async with server, TurnlogClient(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(TurnlogError) as caught:
            await client.r3("s1", 0)
    assert caught.value.slug == "session-open" and caught.value.status == 409


@pytest.mark.parametrize("mangle", [lambda b: b[:-4], lambda b: b + b"\0" * 4,
                                    lambda b: b"NOTNPY" + b[6:]])
async def test_r3_fast_path_refuses_a_damaged_body(mangle):
    body = mangle(npy_bytes(np.zeros((4, 2, 2), dtype="<i4")))
    # A short body ends with the connection (a connection error), a long or foreign one
    # is refused as soon as it is seen (ValueError): never a wrong array.
    server, port, _ = await canned_server(http_reply(200, body), 16)
    async with server, TurnlogClient(f"http://127.0.0.1:{port}", retries=0) as client:
        with pytest.raises((ValueError, TurnlogConnectionError)):
            await client.r3("s1", 0)


async def test_r3_fast_path_connection_refused_is_a_connection_error():
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    async with TurnlogClient(f"http://127.0.0.1:{port}", retries=1, backoff=0.001) as client:
        with pytest.raises(TurnlogConnectionError):
            await client.r3("s1", 0)
