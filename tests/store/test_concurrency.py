"""Two writers at once: one session serializes, different sessions run in parallel."""

import asyncio

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from app.main import create_app
from app.store.engine.dialect import SESSION_WRITERS
from tests.factory import open_body, turn


async def two_clients(settings):
    apps = [create_app(settings) for _ in range(2)]
    clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://localhost")
               for a in apps]
    return apps, clients


async def close_all(apps, clients):
    for c in clients:
        await c.aclose()
    for a in apps:
        await a.state.services.db.dispose()


async def test_two_clients_appending_to_one_session(settings, sid):
    """Two processes' worth of state caches race on one session: no lost or duplicate seq."""
    apps, clients = await two_clients(settings)
    try:
        await clients[0].post("/v1/sessions", json=open_body(sid))
        bodies = [turn([1, 2, i], [3], event_id=f"e{i}") for i in range(20)]

        async def send(i):
            return await clients[i % 2].post(f"/v1/sessions/{sid}/turns", json=bodies[i])

        replies = await asyncio.gather(*(send(i) for i in range(20)))
        assert all(r.status_code == 201 for r in replies), [r.text for r in replies]
        seqs = sorted(r.json()["seq"] for r in replies)
        assert seqs == list(range(20))
        # both caches agree with the log afterwards
        for c in clients:
            s = (await c.get(f"/v1/sessions/{sid}")).json()
            assert [n["seq"] for n in s["tree"]] == list(range(20))
    finally:
        await close_all(apps, clients)


async def test_retry_racing_the_original_lands_once(settings, sid):
    apps, clients = await two_clients(settings)
    try:
        await clients[0].post("/v1/sessions", json=open_body(sid))
        body = turn([1, 2], [3], event_id="same")
        replies = await asyncio.gather(*(
            clients[i % 2].post(f"/v1/sessions/{sid}/turns", json=body) for i in range(6)))
        codes = sorted(r.status_code for r in replies)
        assert codes == [200] * 5 + [201]
        assert len({r.json()["position"] for r in replies}) == 1
        s = (await clients[1].get(f"/v1/sessions/{sid}")).json()
        assert s["num_nodes"] == 1
    finally:
        await close_all(apps, clients)


async def test_different_sessions_in_parallel(client, sid):
    sids = [f"{sid}-{i}" for i in range(8)]
    await asyncio.gather(*(client.post("/v1/sessions", json=open_body(s)) for s in sids))

    async def run(s):
        for k in range(5):
            r = await client.post(f"/v1/sessions/{s}/turns",
                                  json=turn(list(range(1, 3 + 2 * k)), [k + 100]))
            assert r.status_code == 201, r.text

    await asyncio.gather(*(run(s) for s in sids))
    for s in sids:
        body = (await client.get(f"/v1/sessions/{s}")).json()
        assert body["num_nodes"] == 5


async def test_concurrent_open_of_same_id(settings, sid):
    apps, clients = await two_clients(settings)
    try:
        replies = await asyncio.gather(*(
            clients[i % 2].post("/v1/sessions", json=open_body(sid)) for i in range(4)))
        assert sorted(r.status_code for r in replies) == [200, 200, 200, 201]
    finally:
        await close_all(apps, clients)


class CommitsBetween:
    """A connection that runs `between()` once, after its first statement: another
    worker's commit landing between two statements of a fold (READ COMMITTED)."""

    def __init__(self, conn, between):
        self.conn, self.between = conn, between

    async def execute(self, *args, **kwargs):
        result = await self.conn.execute(*args, **kwargs)
        if self.between is not None:
            between, self.between = self.between, None
            await between()
        return result


async def test_a_turn_committed_during_a_fold_is_never_folded_without_its_r3(settings, sid):
    # A helper's finding (`serve --workers 2`): ~3 % of concurrent R3 turns were
    # refused 422 `invalid-r3` ("R3 rows but no routed_experts payload"). A worker
    # that had not cached the session folded it outside the lock, reading the patches
    # before the events; a turn committed in between was folded without its patch.
    from app.store.fold.loader import fold_events
    from tests.factory import r3_b64

    layers, topk = 2, 2
    apps, clients = await two_clients(settings)
    try:
        opened = await clients[0].post("/v1/sessions",
                                       json=open_body(sid, r3={"num_layers": layers}))
        assert opened.status_code == 201, opened.text
        first = turn([1, 2, 3], [4], r3=r3_b64(3, layers, topk), event_id="e0")
        assert (await clients[0].post(f"/v1/sessions/{sid}/turns", json=first)
                ).status_code == 201

        async def another_worker_appends():
            second = turn([1, 2, 3, 4, 5], [6], r3=r3_b64(5, layers, topk), event_id="e1")
            r = await clients[0].post(f"/v1/sessions/{sid}/turns", json=second)
            assert r.status_code == 201, r.text

        db = apps[1].state.services.db
        async with db.read() as conn:
            state = await fold_events(CommitsBetween(conn, another_worker_appends), None, sid)
        assert len(state.nodes) in (1, 2)  # before the commit, or after it: whole
        # The second worker then appends a turn of its own (its first: not cached).
        third = turn([1, 2, 3, 4, 5, 6, 7], [8], r3=r3_b64(7, layers, topk), event_id="e2")
        r = await clients[1].post(f"/v1/sessions/{sid}/turns", json=third)
        assert r.status_code == 201, r.text
        assert r.json()["seq"] == 2
    finally:
        await close_all(apps, clients)


@pytest.mark.postgres_only  # SQLite has one writer and no transaction ids
async def test_writers_of_a_session_queue_before_its_row_lock(client, db_url, sid):
    """Found by stressing two writers on one session (1 run in ~30): a writer woken
    from the session's row lock takes its transaction id, then may find the row locked
    again by a newcomer (READ COMMITTED follows the updated row) and wait once more —
    holding an id older than the newcomer's, whose turn commits first. Its turn then
    carried the older id: the session's events came out of seq order (a 500 on the
    next read; the feed's order wrong). Writers now queue on an advisory lock, which
    takes no id, and reach the row lock one at a time: they wait there, not on the row."""
    await client.post("/v1/sessions", json=open_body(sid))
    await client.post(f"/v1/sessions/{sid}/turns", json=turn([1], [2]))
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as holder, engine.connect() as watcher:
            await holder.begin()
            await holder.execute(sa.text(SESSION_WRITERS), {"session_id": sid})
            await holder.execute(sa.text(
                "SELECT 1 FROM sessions WHERE session_id = :s FOR NO KEY UPDATE"), {"s": sid})
            waiting = asyncio.create_task(client.post(f"/v1/sessions/{sid}/turns",
                                                      json=turn([1, 2, 3], [4])))
            held: list[object] = []
            for _ in range(100):  # until the append waits for the session
                await asyncio.sleep(0.05)
                held = (await watcher.execute(sa.text(
                    "SELECT wait_event, backend_xid::text FROM pg_stat_activity WHERE "
                    "datname = current_database() AND wait_event_type = 'Lock' AND pid <> "
                    "pg_backend_pid()"))).all()
                await watcher.commit()
                if held:
                    break
            # queued for the session, not on its row, and without a transaction id
            assert [tuple(row) for row in held] == [("advisory", None)], held
            await holder.commit()
        reply = await waiting
        assert reply.status_code == 201 and reply.json()["seq"] == 1, reply.text
    finally:
        await engine.dispose()
