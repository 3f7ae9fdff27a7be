"""The one-round-trip append on PostgreSQL and Citus (`app/store/append/fastpath.py`).

Oracles: the simulator's in-memory fold and a rebuild from the log (the rows the
function writes equal what the general path and a rebuild compute); the
function's own refusal to write for a stale state; and on Citus the
coordinator's transaction ids on the rows it writes (what the feed fence needs).
"""

from __future__ import annotations

import asyncio
import random
import uuid

import asyncpg
import httpx
import pytest

from app.domain.log.events import StoredTurn
from app.domain.wire.jsonio import canonical
from app.main import create_app
from app.sim.simulator import SessionSimulator, SimConfig, SimRates
from app.store.append import fastpath
from app.store.engine.db import Database
from app.store.ops.rebuild import PROJECTIONS, computed_rows, projection_rows
from tests.factory import open_body, turn

pytestmark = pytest.mark.postgres_only


@pytest.fixture
def calls(monkeypatch):
    """Counts the function calls and how many wrote (the real call is made)."""
    seen = {"calls": 0, "written": 0}
    real = fastpath.append

    async def counting(pool, args):
        seen["calls"] += 1
        position = await real(pool, args)
        seen["written"] += position is not None
        return position

    monkeypatch.setattr(fastpath, "append", counting)
    return seen


async def test_simulated_sessions_append_in_one_call_and_equal_a_rebuild(
        client, settings, calls):
    sids = []
    turns = 0
    for seed in range(4):
        config = SimConfig(session_id=f"ot-{uuid.uuid4().hex}", version=("v1", "v2")[seed % 2],
                           pause_generation_mode=("retract", "in_place")[seed % 2],
                           speculative=True, max_trim_tokens=seed % 2)
        sim = SessionSimulator(config, random.Random(seed), SimRates(omit_parent=0.3))
        assert (await client.post("/v1/sessions", json=sim.open_body())).status_code == 201
        for _ in range(6):
            r = await client.post(f"/v1/sessions/{config.session_id}/turns",
                                  json=sim.random_turn())
            assert r.status_code == 201, r.text
            turns += 1
        sids.append(config.session_id)
    # Every append found its state cached (the first one after a fold of the open).
    assert calls == {"calls": turns, "written": turns}
    db = Database(settings.store.database_url, settings)
    try:
        async with db.read() as conn:
            for sid in sids:
                recomputed = await computed_rows(conn, sid)
                for name in PROJECTIONS:
                    stored = await projection_rows(conn, name, [sid])
                    assert sorted(stored, key=canonical) == sorted(recomputed[name],
                                                                   key=canonical), name
    finally:
        await db.dispose()


async def test_a_repeat_and_a_refusal_take_the_general_path(client, sid, calls):
    await client.post("/v1/sessions", json=open_body(sid))
    body = turn([1, 2], [3], event_id="e0")
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=body)).status_code == 201
    again = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    assert again.status_code == 200
    other = await client.post(f"/v1/sessions/{sid}/turns",
                              json=turn([1, 2], [4], event_id="e0"))
    assert other.status_code == 409
    unknown_parent = await client.post(f"/v1/sessions/{sid}/turns",
                                       json=turn([1, 2], [5], event_id="e1", parent=7))
    assert unknown_parent.status_code in (404, 409, 422)
    assert calls == {"calls": 1, "written": 1}


async def test_a_stale_state_writes_nothing_and_the_general_path_decides(settings, sid, calls):
    """Two processes (two caches): the one whose cache is behind calls the function,
    which refuses to write; the general path then folds the other's turns."""
    apps = [create_app(settings) for _ in range(2)]
    clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://localhost")
               for a in apps]
    try:
        await clients[0].post("/v1/sessions", json=open_body(sid))
        for i, c in enumerate(clients):  # both caches hold the one-turn state
            r = await c.post(f"/v1/sessions/{sid}/turns",
                             json=turn([1, 2], [3], event_id="root"))
            assert r.status_code == (201, 200)[i]
        r = await clients[0].post(f"/v1/sessions/{sid}/turns",
                                  json=turn([1, 2, 3, 4], [5], event_id="a"))
        assert r.status_code == 201 and r.json()["seq"] == 1
        before = dict(calls)
        r = await clients[1].post(f"/v1/sessions/{sid}/turns",
                                  json=turn([1, 2, 3, 4, 5, 6], [7], event_id="b"))
        assert r.status_code == 201, r.text
        assert r.json()["seq"] == 2 and r.json()["parent"] == 1
        assert calls["calls"] == before["calls"] + 1
        assert calls["written"] == before["written"]  # refused: the cache was behind
        for c in clients:
            tree = (await c.get(f"/v1/sessions/{sid}")).json()["tree"]
            assert [(n["seq"], n["parent"]) for n in tree] == [(0, None), (1, 0), (2, 1)]
    finally:
        for c in clients:
            await c.aclose()
        for a in apps:
            await a.state.services.db.dispose()


async def test_concurrent_appends_of_one_session_serialize(client, sid, calls):
    await client.post("/v1/sessions", json=open_body(sid))
    bodies = [turn([1, 2, i], [3], event_id=f"e{i}") for i in range(12)]
    replies = await asyncio.gather(*(client.post(f"/v1/sessions/{sid}/turns", json=b)
                                     for b in bodies))
    assert all(r.status_code == 201 for r in replies), [r.text for r in replies]
    assert sorted(r.json()["seq"] for r in replies) == list(range(12))
    assert sorted(r.json()["position"] for r in replies) == sorted(
        {r.json()["position"] for r in replies})


async def test_the_function_refuses_a_stale_count_and_a_closed_session(client, settings, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    assert (await client.post(f"/v1/sessions/{sid}/turns",
                              json=turn([1], [2]))).status_code == 201
    dsn = Database(settings.store.database_url, settings)
    pool = await dsn.driver_pool()
    try:
        head = {"active_leaf": 1, "topk": None, "spec_correct": 0, "spec_proposed": 0,
                "spec_verify": 0, "spec_completion": 0}
        node = dict.fromkeys(fastpath.NODE_COLUMNS, 0) | {
            "parent": 0, "r3_start": None, "r3_end": None, "finish_reason": None,
            "weight_version": None, "cached_tokens": None, "record_ts": None,
            "record_hour": None, "record_day": None}
        stored = StoredTurn(payload="{}", prompt_lcp=1, prompt_delta=b"", patch=None)
        for expected in (0, 2):  # the session has 1 turn
            args = fastpath.append_args(sid, expected, expected, f"x{expected}", stored, 1,
                                        node, head)
            assert await fastpath.append(pool, args) is None
        assert (await client.post(f"/v1/sessions/{sid}/close", json={})).status_code == 200
        args = fastpath.append_args(sid, 1, 1, "x1", stored, 1, node, head)
        assert await fastpath.append(pool, args) is None
        assert await fastpath.append(pool, fastpath.append_args(
            f"{sid}-none", 0, 0, "x", stored, 1, node, head)) is None
        conn: asyncpg.Connection
        async with pool.acquire() as conn:
            assert await conn.fetchval(
                "SELECT count(*) FROM events WHERE session_id = $1", sid) == 3
    finally:
        await dsn.dispose()


async def test_rows_carry_the_coordinators_transaction_id(client, settings, sid, backend):
    """The feed fence compares event xids with the coordinator's horizon (dialect.py):
    the functions run on the coordinator (not delegated to a worker) on Citus —
    `turnlog_open`'s session row and event as well as `turnlog_append`'s event. Ids
    on the store's clock (migration 0012: the coordinator's id plus its offset)."""
    db = Database(settings.store.database_url, settings)
    pool = await db.driver_pool()
    try:
        async with pool.acquire() as conn:
            before = int(await conn.fetchval("SELECT turnlog_xid()"))
        assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 201
        async with pool.acquire() as conn:
            low = int(await conn.fetchval("SELECT turnlog_xid()"))
            opened = await conn.fetchval(
                "SELECT xid FROM events WHERE session_id = $1 AND type = 'session_opened'", sid)
            row = await conn.fetchval("SELECT xid FROM sessions WHERE session_id = $1", sid)
        assert before < opened == row < low
        assert (await client.post(f"/v1/sessions/{sid}/turns",
                                  json=turn([1], [2]))).status_code == 201
        async with pool.acquire() as conn:
            high = int(await conn.fetchval("SELECT turnlog_xid()"))
            xid = await conn.fetchval(
                "SELECT xid FROM events WHERE session_id = $1 AND seq = 0", sid)
        assert low < xid < high
    finally:
        await db.dispose()


async def test_on_citus_the_call_is_a_one_worker_transaction(client, settings, sid, backend,
                                                             calls):
    """Citus records every two-phase commit in pg_dist_transaction: one-trip appends of
    sessions on both workers add none (each call stays on its session's worker)."""
    if backend != "citus":
        pytest.skip("Citus only")
    db = Database(settings.store.database_url, settings)
    pool = await db.driver_pool()
    try:
        async with pool.acquire() as conn:
            by_worker: dict[int, list[str]] = {}
            for i in range(64):  # two sessions on each of the two workers
                port = await conn.fetchval(
                    "SELECT nodeport FROM citus_shards WHERE table_name = 'sessions'::regclass "
                    "AND shardid = get_shard_id_for_distribution_column('sessions', $1::text)",
                    f"{sid}-{i}")
                by_worker.setdefault(port, [])
                if len(by_worker[port]) < 2:
                    by_worker[port].append(f"{sid}-{i}")
                if len(by_worker) == 2 and all(len(v) == 2 for v in by_worker.values()):
                    break
            before = await conn.fetchval("SELECT count(*) FROM pg_dist_transaction")
        sids = [s for group in by_worker.values() for s in group]
        assert len(by_worker) == 2 and len(sids) == 4
        for s in sids:
            await client.post("/v1/sessions", json=open_body(s))
        for s in sids:
            for k in range(2):
                r = await client.post(f"/v1/sessions/{s}/turns",
                                      json=turn(list(range(1, 3 + 2 * k)), [k + 100]))
                assert r.status_code == 201, r.text
        async with pool.acquire() as conn:
            after = await conn.fetchval("SELECT count(*) FROM pg_dist_transaction")
        assert calls["written"] == len(sids) * 2
        assert after == before
    finally:
        await db.dispose()


async def test_a_repeated_open_reads_and_writes_nothing(client, settings, sid):
    """`turnlog_open` answers a session that exists from a read, before its insert
    (whose column defaults would take a sequence value and a transaction id, and so a
    WAL flush at the commit). The gateway tries an open for every session whose state
    its cache does not hold."""
    db = Database(settings.store.database_url, settings)
    pool = await db.driver_pool()
    try:
        assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 201
        for _ in range(3):
            assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 200
        other = f"{sid}-next"
        assert (await client.post("/v1/sessions", json=open_body(other))).status_code == 201
        async with pool.acquire() as conn:
            ids = [await conn.fetchval("SELECT id FROM sessions WHERE session_id = $1", s)
                   for s in (sid, other)]
        # The three repeats took no value of the sequence the insert's default draws.
        assert ids[1] == ids[0] + 1
    finally:
        await db.dispose()
