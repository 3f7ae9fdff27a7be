"""The gateway when the store fails: callers are served, turns wait in the spool (fsynced),
and drain in order, exactly once, when the store is back or a new gateway starts.

Faults: a SQLite file locked by another process, a SQLite file moved away,
PostgreSQL stopped with `pg_ctl stop -m immediate`, a full spool, and the
gateway SIGKILLed with turns in its spool. Afterwards every session holds
exactly the turns its caller was answered for, in the order they were sent.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.gateway.spool import Spool
from app.main import create_app
from app.settings import Settings
from app.store.engine import migrate
from tests.gateway.conftest import (
    Sent,
    chat,
    drained,
    metric,
    scrape,
    send_turn,
    sqlite_lock,
    wait_for,
)
from tests.pg.stoppable import stoppable_cluster
from tests.serverproc import turnlog_serve
from turnlog_client import miles as hooks

STORE_TIMEOUT = "1"


@contextlib.asynccontextmanager
async def api(url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The REST API over the same database, in process (to read back what was stored)."""
    app = create_app(Settings.load(database_url=url, migrate_on_start=False, api_tokens=""))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://turnlog") as http:
        yield http
    await app.state.services.db.dispose()


class Conversation:
    """One session's chat: each turn extends the last reply (so order matters)."""

    def __init__(self) -> None:
        self.session_id = f"gw-{uuid.uuid4().hex[:12]}"
        self.prompt = [3, 1, 4]
        self.answered: list[Sent] = []

    async def turn(self, http: httpx.AsyncClient) -> Sent:
        sent = await send_turn(http, self.session_id, chat(list(self.prompt)))
        if sent.status == 200:
            self.answered.append(sent)
            output = [t for _, t in
                      json.loads(sent.reply)["choices"][0]["meta_info"]["output_token_logprobs"]]
            self.prompt = self.prompt + output + [5, 9]
        return sent


async def check_stored(http: httpx.AsyncClient, conversation: Conversation) -> None:
    """The store holds exactly the answered turns, in order, each once."""
    reply = await http.get(f"/v1/sessions/{conversation.session_id}/events")
    assert reply.status_code == 200, reply.text
    turns = [e for e in reply.json() if e["type"] == "turn_recorded"]
    assert [t["record"]["request"] for t in turns] == [s.request for s in
                                                       conversation.answered]
    assert [t["record"]["response"] for t in turns] == [json.loads(s.reply) for s in
                                                        conversation.answered]
    assert len({t["event_id"] for t in turns}) == len(turns)
    # Each turn extends the one before: the chain was appended in order.
    assert [t["parent"] for t in turns] == [None, *range(len(turns) - 1)]


async def spooled(http: httpx.AsyncClient) -> float:
    return metric(await scrape(http), "turnlog_gateway_spooled_turns")


async def test_a_locked_sqlite_file_spools_and_drains_in_order(tmp_path, gateway_process):
    path = tmp_path / "store.db"
    gateway = gateway_process(f"sqlite:///{path}", "--store-timeout", STORE_TIMEOUT)
    await gateway.wait_ready()
    a, b = Conversation(), Conversation()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        assert (await a.turn(http)).status == 200
        with sqlite_lock(path):
            for conversation in (a, b, a, a):
                assert (await conversation.turn(http)).status == 200
            assert await spooled(http) == 4
            metrics = await scrape(http)
            ready = await http.get("/turnlog/readyz")
            assert ready.status_code == 503, ready.text
            assert len(list((tmp_path / "spool-0").glob("*.turn"))) == 4
        await wait_for(lambda: drained(http), what="the spool to drain")
        assert (await http.get("/turnlog/readyz")).status_code == 200
        assert metric(await scrape(http), "turnlog_gateway_recorded_total") == 5
    assert not list((tmp_path / "spool-0").glob("*.turn"))
    # The store's part of each turn's latency, by what became of it: a's first spooled
    # turn waited the store timeout out (its later ones went behind it at once).
    store = "turnlog_gateway_store_seconds"
    assert metric(metrics, f"{store}_count", 'outcome="recorded"') == 1
    assert metric(metrics, f"{store}_count", 'outcome="spooled"') == 4
    assert metric(metrics, f"{store}_sum", 'outcome="spooled"') >= float(STORE_TIMEOUT)
    async with api(f"sqlite+aiosqlite:///{path}") as http:
        for conversation in (a, b):
            await check_stored(http, conversation)


async def test_a_hanging_store_costs_one_store_timeout_not_one_per_session(tmp_path,
                                                                           gateway_process):
    """Once the drainer's own attempt has waited longer than the store timeout, a new
    session's turn goes to the spool without trying the store (it would wait the
    timeout out too); everything still drains in order when the lock goes."""
    path = tmp_path / "store.db"
    gateway = gateway_process(f"sqlite:///{path}", "--store-timeout", STORE_TIMEOUT)
    await gateway.wait_ready()
    a, b, c = Conversation(), Conversation(), Conversation()
    skipped = "the store is not answering; spooling the turn"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        assert (await a.turn(http)).status == 200
        with sqlite_lock(path):
            assert (await a.turn(http)).status == 200  # tried the store: waited, spooled
            assert skipped not in gateway.log_tail(200)
            # The drainer has been waiting on the same append for longer than the timeout.
            await asyncio.sleep(2.5 * float(STORE_TIMEOUT))
            for conversation in (b, c, b):
                assert (await conversation.turn(http)).status == 200
            assert await spooled(http) == 4
            assert gateway.log_tail(200).count(skipped) == 2  # b's and c's first turns
        await wait_for(lambda: drained(http), what="the spool to drain")
        # The store answers again: a new session's turn is recorded straight away.
        d = Conversation()
        assert (await d.turn(http)).status == 200
        assert await spooled(http) == 0
        assert metric(await scrape(http), "turnlog_gateway_recorded_total") == 6
    assert gateway.log_tail(400).count(skipped) == 2
    async with api(f"sqlite+aiosqlite:///{path}") as http:
        for conversation in (a, b, c, d):
            await check_stored(http, conversation)


async def test_a_missing_sqlite_file_spools_until_it_is_there(tmp_path, gateway_process):
    # The database's folder does not exist yet: every write fails to open the file.
    path = tmp_path / "later" / "store.db"
    url = f"sqlite+aiosqlite:///{path}"
    gateway = gateway_process(url, "--store-timeout", STORE_TIMEOUT, "--no-migrate")
    await gateway.wait_ready()
    a, b = Conversation(), Conversation()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        for conversation in (a, b, a):
            assert (await conversation.turn(http)).status == 200
        assert await spooled(http) == 3
        assert (await http.get("/turnlog/readyz")).status_code == 503
        path.parent.mkdir()
        await migrate.upgrade_async(url)
        await wait_for(lambda: drained(http), what="the spool to drain")
        assert (await http.get("/turnlog/readyz")).status_code == 200
    async with api(url) as http:
        for conversation in (a, b):
            await check_stored(http, conversation)


async def test_postgres_stopped_mid_run_spools_and_drains_in_order(tmp_path, gateway_process):
    try:
        cluster = await asyncio.to_thread(stoppable_cluster)
    except RuntimeError as exc:
        pytest.fail(f"PostgreSQL binaries are required for this fault test: {exc}")
    try:
        gateway = gateway_process(cluster.url, "--store-timeout", "3")
        await gateway.wait_ready()
        a, b = Conversation(), Conversation()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            for conversation in (a, b):
                assert (await conversation.turn(http)).status == 200
            await asyncio.to_thread(cluster.stop, "immediate")
            for conversation in (a, b, a, b, a):
                assert (await conversation.turn(http)).status == 200
            assert await spooled(http) == 5
            assert (await http.get("/turnlog/readyz")).status_code == 503
            await asyncio.to_thread(cluster.start)
            await wait_for(lambda: drained(http), timeout=60, what="the spool to drain")
            assert (await http.get("/turnlog/readyz")).status_code == 200
            assert metric(await scrape(http), "turnlog_gateway_recorded_total") == 7
        async with api(cluster.url) as http:
            for conversation in (a, b):
                await check_stored(http, conversation)
    finally:
        await asyncio.to_thread(cluster.remove)


async def test_a_full_spool_answers_503_and_stores_nothing_of_that_turn(tmp_path,
                                                                        gateway_process):
    path = tmp_path / "store.db"
    gateway = gateway_process(f"sqlite:///{path}", "--store-timeout", STORE_TIMEOUT,
                              "--spool-max-bytes", "4000")
    await gateway.wait_ready()
    a = Conversation()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        assert (await a.turn(http)).status == 200
        refused: list[Sent] = []
        with sqlite_lock(path):
            for _ in range(6):
                sent = await a.turn(http)
                if sent.status != 200:
                    refused.append(sent)
            metrics = await scrape(http)
        assert refused, "the spool never filled"
        for sent in refused:
            assert sent.status == 503
            problem = json.loads(sent.reply)
            assert problem["type"] == "urn:turnlog:spool-full"
        assert metric(metrics, "turnlog_gateway_spooled_bytes") <= 4000
        # Each refused turn is counted, by its reason.
        assert metric(metrics, "turnlog_gateway_unrecorded_total",
                      'reason="spool-full"') == len(refused)
        assert metric(metrics, "turnlog_gateway_store_seconds_count",
                      'outcome="spool-full"') == len(refused)
        await wait_for(lambda: drained(http), what="the spool to drain")
    async with api(f"sqlite+aiosqlite:///{path}") as http:
        await check_stored(http, a)  # the refused turns are not among them


async def test_a_full_spool_answers_by_the_late_write_never_503_for_a_stored_turn(
        tmp_path, gateway_process):
    """The store write outlives the store timeout and the spool has no room: the
    write is not cancelled (it cannot be) and may still commit, so the caller's
    answer waits for it. Answered 503 with the turn stored after all, the caller's
    retry would store the turn twice."""
    path = tmp_path / "store.db"
    gateway = gateway_process(f"sqlite:///{path}", "--store-timeout", "0.5",
                              "--spool-max-bytes", "1")
    await gateway.wait_ready()
    a = Conversation()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        assert (await a.turn(http)).status == 200
        lock = sqlite_lock(path)
        lock.__enter__()
        asyncio.get_running_loop().call_later(3.0, lock.__exit__, None, None, None)
        try:
            sent = await a.turn(http)
        finally:
            lock.__exit__(None, None, None)
        assert sent.status == 200, sent.reply  # the write committed once the lock went
        assert (await a.turn(http)).status == 200
        assert metric(await scrape(http), "turnlog_gateway_recorded_total") == 3
        assert await spooled(http) == 0
    assert "waiting for the store's answer to this turn" in gateway.log_tail(200)
    async with api(f"sqlite+aiosqlite:///{path}") as http:
        await check_stored(http, a)  # each answered turn once, nothing else


async def test_a_sigkilled_gateway_drains_its_spool_once_after_restart(tmp_path,
                                                                      gateway_process):
    path = tmp_path / "store.db"
    spool = tmp_path / "spool"
    gateway = gateway_process(f"sqlite:///{path}", "--store-timeout", STORE_TIMEOUT,
                              spool=spool)
    await gateway.wait_ready()
    a, b = Conversation(), Conversation()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        assert (await a.turn(http)).status == 200
        with sqlite_lock(path):
            for conversation in (a, b, a):
                assert (await conversation.turn(http)).status == 200
            assert await spooled(http) == 3
            gateway.kill()
            # A new gateway over the same spool, the store still locked: not ready from
            # its first answer (its spool holds turns no drain has taken yet).
            gateway.start()
            await gateway.wait_ready()
            ready = await http.get(f"{gateway.url}/turnlog/readyz")
            assert ready.status_code == 503, ready.text
            gateway.kill()
    assert len(list(spool.glob("*.turn"))) == 3
    gateway.start()  # a new gateway over the same spool, the store answering again
    await gateway.wait_ready()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        await wait_for(lambda: drained(http), what="the spool to drain")
        assert metric(await scrape(http), "turnlog_gateway_recorded_total") == 3
        # The restarted gateway goes on with the same sessions.
        assert (await a.turn(http)).status == 200
    assert not list(spool.glob("*.turn"))
    async with api(f"sqlite+aiosqlite:///{path}") as http:
        for conversation in (a, b):
            await check_stored(http, conversation)


async def test_a_turn_committed_before_the_crash_is_not_stored_twice(tmp_path, gateway_process,
                                                                     fake_sglang):
    """The gateway died between the commit and deleting the spool file: the next drain
    repeats the append, which the store answers as an idempotent repeat."""
    path = tmp_path / "store.db"
    url = f"sqlite+aiosqlite:///{path}"
    await migrate.upgrade_async(url)
    session = f"gw-{uuid.uuid4().hex[:12]}"
    request = chat([2, 7, 1, 8])
    async with httpx.AsyncClient(base_url=fake_sglang.url, timeout=30) as direct:
        reply = (await direct.post("/v1/chat/completions", json=request)).json()
    body = {"event_id": uuid.uuid4().hex, "record": {
        "timestamp": 2.0, "request_timestamp": 1.0, "method": "POST",
        "path": "/v1/chat/completions", "status_code": 200, "request": request,
        "response": reply}}
    opening = {"session_id": session, "version": "v2", "opened_by": "gateway"}
    async with api(url) as http:
        assert (await http.post("/v1/sessions", json=opening)).status_code == 201
        assert (await http.post(f"/v1/sessions/{session}/turns", json=body)).status_code == 201
    spool = Spool(tmp_path / "spool", 1 << 20)
    spool.add(session, body, opening)
    spool.close()
    gateway = gateway_process(f"sqlite:///{path}", spool=tmp_path / "spool")
    await gateway.wait_ready()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        await wait_for(lambda: drained(http), what="the spool to drain")
        # Nor counted twice (a helper's finding: the repeat was counted as recorded).
        assert metric(await scrape(http), "turnlog_gateway_recorded_total") == 0
    async with api(url) as http:
        reply = await http.get(f"/v1/sessions/{session}/events")
        turns = [e for e in reply.json() if e["type"] == "turn_recorded"]
    assert [t["event_id"] for t in turns] == [body["event_id"]]


def test_a_turn_with_r3_bytes_and_a_lone_surrogate_is_spooled_as_json_carries_it(tmp_path):
    """The gateway hands the store R3 as bytes; the spool writes JSON. A record holding a
    lone surrogate takes the standard library's JSON path, which has no bytes: the payload
    must be spooled as its base64 text (it was a TypeError, answered as a 500)."""
    payload = np.arange(12, dtype="<i4").tobytes()
    body = {"event_id": uuid.uuid4().hex, "record": {
        "timestamp": 2.0, "request_timestamp": 1.0, "method": "POST",
        "path": "/v1/chat/completions", "status_code": 200,
        "request": {"input_ids": [1, 2], "messages": [{"role": "user", "content": "\ud800"}]},
        "response": {"choices": [{"meta_info": {"routed_experts": payload}}]}}}
    spool = Spool(tmp_path / "spool", 1 << 20)
    spool.add("s-1", body, {"session_id": "s-1"})
    spool.close()
    again = Spool(tmp_path / "spool", 1 << 20)
    try:
        [entry] = list(again.entries)
        spooled = again.read(entry).body
        stored = spooled["record"]["response"]["choices"][0]["meta_info"]["routed_experts"]
        assert base64.b64decode(stored) == payload
        assert spooled["record"]["request"] == body["record"]["request"]
        assert entry.event_id == body["event_id"]
    finally:
        again.close()


async def test_a_spooled_turn_that_meets_a_closed_session_is_counted_and_logged(
        tmp_path, gateway_process):
    """Another client closed the session while the gateway held a turn of it in its
    spool: the drain meets a closed session. The turn is not recorded (the store's
    verdict), and the loss is said, as an error, not only counted."""
    path = tmp_path / "store.db"
    spool = tmp_path / "spool"
    gateway = gateway_process(f"sqlite:///{path}", "--store-timeout", STORE_TIMEOUT,
                              spool=spool)
    await gateway.wait_ready()
    a = Conversation()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        assert (await a.turn(http)).status == 200
        with sqlite_lock(path):
            assert (await a.turn(http)).status == 200  # answered, spooled
            assert await spooled(http) == 1
            gateway.kill()
    async with api(f"sqlite+aiosqlite:///{path}") as store:
        closed = await store.post(f"/v1/sessions/{a.session_id}/close", json={})
        assert closed.status_code == 200, closed.text
    gateway.start()  # a new gateway over the same spool: its drain meets the close
    await gateway.wait_ready()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        await wait_for(lambda: drained(http), what="the spool to drain")
        assert metric(await scrape(http), "turnlog_gateway_unrecorded_total",
                      'reason="session-closed"') == 1
    assert "a spooled turn arrived after its session was closed" in gateway.log_tail(200)
    async with api(f"sqlite+aiosqlite:///{path}") as store:
        events = (await store.get(f"/v1/sessions/{a.session_id}/events")).json()
    assert len([e for e in events if e["type"] == "turn_recorded"]) == 1


# What `hooked_agent` drives: set by the test that names it as the hooks' agent.
HOOKED: dict[str, Any] = {}


async def hooked_agent(base_url: str, **_kwargs: Any) -> dict[str, Any]:
    """The user's agent under the miles hook: one turn, then `HOOKED["spooled"]` more
    while another process locks the store (the gateway spools them); returns with the
    lock still held, released `HOOKED["hold_s"]` after it was taken."""
    conversation: Conversation = HOOKED["conversation"]
    assert base_url.endswith(f"/{conversation.session_id}")
    async with httpx.AsyncClient(base_url=HOOKED["gateway"], timeout=60) as http:
        assert (await conversation.turn(http)).status == 200
        lock = sqlite_lock(HOOKED["path"])
        lock.__enter__()
        asyncio.get_running_loop().call_later(HOOKED["hold_s"], lock.__exit__, None, None, None)
        for _ in range(HOOKED.get("spooled", 1)):
            assert (await conversation.turn(http)).status == 200  # answered, spooled
    return {"reward": 1.0}


@contextlib.asynccontextmanager
async def hooked_run(tmp_path: Path, gateway_process: Any, monkeypatch: pytest.MonkeyPatch,
                     **hooked: Any) -> AsyncIterator[tuple[Any, Conversation, Any]]:
    """A gateway and a `turnlog serve` on one SQLite file, the miles hook pointed at
    them, and `hooked_agent` as the user's agent: yields (gateway, conversation, serve)."""
    path = tmp_path / "store.db"
    gateway = gateway_process(f"sqlite:///{path}", "--store-timeout", STORE_TIMEOUT)
    await gateway.wait_ready()
    conversation = Conversation()
    with turnlog_serve(f"sqlite:///{path}", tmp_path / "serve.log") as serve:
        await serve.wait_ready()
        monkeypatch.setenv("TURNLOG_URL", serve.url)
        monkeypatch.setenv("TURNLOG_MILES_AGENT", f"{__name__}.hooked_agent")
        monkeypatch.delenv("TURNLOG_TOKEN", raising=False)
        monkeypatch.delenv("TURNLOG_GATEWAY_URL", raising=False)
        HOOKED.clear()
        HOOKED.update(conversation=conversation, gateway=gateway.url, path=path, **hooked)
        yield gateway, conversation, serve


async def run_hooked(conversation: Conversation) -> dict[str, Any]:
    result = await hooks.agent(base_url=f"http://miles/sessions/{conversation.session_id}",
                               prompt="hi", request_kwargs={}, metadata={})
    assert result["reward"] == 1.0
    return result


async def test_a_hook_close_given_up_on_a_locked_store_never_overtakes_the_spool(
        tmp_path, gateway_process, monkeypatch):
    """The hooks' close times out while another process locks the SQLite file, and the
    gateway holds a spooled turn of that session. The close must not be carried out
    when the lock goes (it would close the session before the drain, and the answered
    turn would be lost): it carries `X-Turnlog-Timeout`, so `turnlog serve` rolls it
    back. Every answered turn is stored; the session stays open for a later close."""
    async with hooked_run(tmp_path, gateway_process, monkeypatch, hold_s=2.5) as (
            gateway, conversation, _serve):
        monkeypatch.setattr(hooks, "DEADLINE", 1.0)  # the hook gives up after 1 s
        monkeypatch.setattr(hooks, "CLOSE_LATER_S", 0.0)  # and does not try again
        await run_hooked(conversation)
        await hooks.finish(10)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            await wait_for(lambda: drained(http), what="the spool to drain")
            await asyncio.sleep(1.5)  # time for a late close to land, were it to
            assert metric(await scrape(http), "turnlog_gateway_unrecorded_total",
                          'reason="session-closed"') == 0
            assert metric(await scrape(http), "turnlog_gateway_recorded_total") == 2
    async with api(f"sqlite+aiosqlite:///{tmp_path / 'store.db'}") as store:
        await check_stored(store, conversation)
        session = (await store.get(f"/v1/sessions/{conversation.session_id}")).json()
        assert session["status"] == "open"
        assert session["labels"] == {}  # the hook's open: no labels were asked for
        closed = await store.post(f"/v1/sessions/{conversation.session_id}/close", json={})
        assert closed.status_code == 200, closed.text


async def test_the_hooks_hand_the_close_and_rewards_to_the_gateway_behind_its_turns(
        tmp_path, gateway_process, monkeypatch, caplog):
    """With the gateway's address (`TURNLOG_GATEWAY_URL`) the agent hook hands its close
    to the gateway while the store is locked and the gateway holds two spooled turns of
    the session: the gateway queues it behind them (202), so the hook returns at once,
    and the reward hook's rewards — which need the session closed — queue behind the
    close, from whichever process they come. When the lock goes, everything lands in
    order: the turns, the close with the agent's reward, the rewards."""
    caplog.set_level("INFO", logger="turnlog_client.miles")
    async with hooked_run(tmp_path, gateway_process, monkeypatch, hold_s=4.0,
                          spooled=2) as (gateway, conversation, _serve):
        monkeypatch.setenv("TURNLOG_GATEWAY_URL", gateway.url)
        monkeypatch.setenv("TURNLOG_MILES_RM", f"{__name__}.hooked_rm")
        sid = conversation.session_id
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            result = await run_hooked(conversation)
            assert (await http.get(f"/turnlog/sessions/{sid}")).json() == {
                "session_id": sid, "spooled_turns": 2, "spooled_writes": 3}
            hooks._DEFERRED.clear()  # as in a reward hook of another process
            await score(result, 0.25, 0.75)
            assert (await http.get(f"/turnlog/sessions/{sid}")).json()["spooled_writes"] == 5
            assert not hooks._TASKS and not said(caplog)  # nothing left in this process
            await wait_for(lambda: drained(http), what="the spool to drain")
            assert metric(await scrape(http), "turnlog_gateway_spooled_writes") == 0
            assert metric(await scrape(http), "turnlog_gateway_unrecorded_total",
                          'reason="session-closed"') == 0
    kinds = await check_closed_then_scored(tmp_path, conversation, 0.25, 0.75)
    assert len([k for k in kinds if k == "turn_recorded"]) == 3


async def score(result: dict[str, Any], *scores: float) -> None:
    """The reward hook scores the hooked session once per score, in order."""
    for value in scores:
        sample = {"metadata": {"turnlog_session_id": result["turnlog_session_id"],
                               "score": value}}
        assert await hooks.rm(None, sample) == value


async def check_closed_then_scored(tmp_path: Path, conversation: Conversation,
                                   *scores: float) -> list[str]:
    """Every answered turn is stored, then the close with the agent's reward (1.0), then
    the reward model's `scores`, in order: the event kinds."""
    async with api(f"sqlite+aiosqlite:///{tmp_path / 'store.db'}") as store:
        await check_stored(store, conversation)
        events = (await store.get(f"/v1/sessions/{conversation.session_id}/events")).json()
    kinds = [e["type"] for e in events]
    tail = len(scores) + 1
    assert kinds[-tail:] == ["session_closed"] + ["reward_recorded"] * len(scores), kinds
    assert events[-tail]["close"]["metadata"]["reward"] == 1.0
    assert [e["reward"]["reward"] for e in events[-len(scores):]] == list(scores)
    return kinds


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the miles hooks logged (other loggers, httpx's say, may be captured too)."""
    return [r.getMessage() for r in caplog.records if r.name == "turnlog_client.miles"]


def hooked_rm(_args: Any, sample: Any, **_kwargs: Any) -> float:
    """The user's reward function under the miles reward hook: the sample's "score"."""
    return float(sample["metadata"]["score"])


async def test_the_hook_defers_the_close_while_the_gateway_still_holds_its_turns(
        tmp_path, gateway_process, monkeypatch, caplog):
    """A gateway that does not take closes (one before that route; here its route is
    missed on purpose), and the store stays locked past the hook's wait: the close is
    not sent then (it could overtake the spooled turns) but deferred, and sent once the
    gateway has drained them; a reward the reward hook records meanwhile waits for
    that close. In the end every answered turn is stored, the session closed with the
    agent's reward, and the reward model's reward recorded after it."""
    caplog.set_level("INFO", logger="turnlog_client.miles")
    async with hooked_run(tmp_path, gateway_process, monkeypatch, hold_s=5.0) as (
            gateway, conversation, _serve):
        monkeypatch.setenv("TURNLOG_GATEWAY_URL", gateway.url)
        # A route the gateway does not have (404): as a gateway without the close route.
        monkeypatch.setattr(hooks, "GATEWAY_PREFIX", "/turnlog/no-such-route")
        monkeypatch.setenv("TURNLOG_MILES_RM", f"{__name__}.hooked_rm")
        monkeypatch.setattr(hooks, "DEADLINE", 2.0)  # ends well before the lock does
        monkeypatch.setattr(hooks, "CLOSE_LATER_POLL_S", 0.2)
        result = await run_hooked(conversation)
        (deferred,) = said(caplog)
        assert "close deferred" in deferred and "still holds 1 spooled turn(s)" in deferred
        await score(result, 0.25, 0.75)  # answered at once, recorded after the close
        await hooks.finish(60)
        assert any("closed (deferred)" in line for line in said(caplog))
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            assert metric(await scrape(http), "turnlog_gateway_unrecorded_total",
                          'reason="session-closed"') == 0
    await check_closed_then_scored(tmp_path, conversation, 0.25, 0.75)


async def test_a_close_handed_over_a_locked_store_is_answered_within_its_timeout(
        tmp_path, gateway_process):
    """The store is locked and the gateway holds nothing of the session, so it tries the
    close at once — but waits on the store only part of the caller's
    `X-Turnlog-Timeout` (not its own 10 s store timeout), then queues it: 202 in time.
    A reward sent meanwhile queues behind it; both land, in order, when the lock goes,
    and the close is written once (the abandoned try and its spooled copy are one). A
    timeout that short is the caller's, not a sick store's: readiness is not lost."""
    path = tmp_path / "store.db"
    gateway = gateway_process(f"sqlite:///{path}", "--store-timeout", "10")
    await gateway.wait_ready()
    conversation = Conversation()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        assert (await conversation.turn(http)).status == 200
        close = f"/turnlog/v1/sessions/{conversation.session_id}/close"
        with sqlite_lock(path):
            started = asyncio.get_running_loop().time()
            reply = await http.post(close, json={"metadata": {"reward": 1.0}},
                                    headers={"X-Turnlog-Timeout": "1.5"})
            took = asyncio.get_running_loop().time() - started
            assert (reply.status_code, reply.json()["outcome"]) == (202, "spooled"), reply.text
            assert took < 1.5, took
            reward = await http.post(
                f"/turnlog/v1/sessions/{conversation.session_id}/rewards",
                json={"event_id": "rm-1", "reward": 0.5})
            assert reward.status_code == 202, reward.text
            bad = await http.post(close, json={}, headers={"X-Turnlog-Timeout": "soon"})
            assert bad.status_code == 400 and bad.json()["field"] == "X-Turnlog-Timeout"

        await wait_for(lambda: drained(http), what="the spooled close and reward")
    async with api(f"sqlite+aiosqlite:///{path}") as store:
        await check_stored(store, conversation)
        events = (await store.get(f"/v1/sessions/{conversation.session_id}/events")).json()
        assert [e["type"] for e in events][-2:] == ["session_closed", "reward_recorded"]
        assert len([e for e in events if e["type"] == "session_closed"]) == 1
