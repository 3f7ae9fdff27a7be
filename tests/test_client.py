"""`app.client`: typed errors, retries that are safe, and every read docs/api.md offers."""

from __future__ import annotations

import json
import random
import uuid

import httpx
import numpy as np
import pytest

from app.client import TurnlogClient
from app.client.errors import TurnlogConnectionError, TurnlogError
from app.client.sync import SyncTurnlogClient
from app.main import create_app
from app.simulator import SessionSimulator, SimConfig, route
from tests.factory import turn


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


def flaky(app, failures: list[object]):
    """A transport that fails the first requests as listed (a status or an exception),
    then hands over to the app; it records every body it was sent."""
    inner = httpx.ASGITransport(app=app)
    sent: list[dict] = []

    class Flaky(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            sent.append(json.loads(request.content) if request.content else {})
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
    assert error.field == "body" and error.expected and error.actual
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
