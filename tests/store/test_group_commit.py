"""Group commit on plain PostgreSQL (`app/store/append/group.py`, migration 0009).

Oracles: the rebuild from the log and the simulator's in-memory fold (the rows
of grouped appends equal what serial appends compute); the database itself
after a group (what is durable equals what was acknowledged); the feed read
back with a cursor. Groups are made deterministic with row locks held by the
test: a call blocked on a locked session keeps a commit in flight, so the
calls that follow collect into one group (bounded here by `max_appends`).
Off on Citus (a group would span workers), which the last test checks;
SQLite has one writer and no group commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from app.api.problems import database_unavailable
from app.domain.body.session import parse_close
from app.domain.log.events import StoredTurn
from app.domain.projection.samples import build_samples
from app.domain.wire.jsonio import canonical, strict_equal
from app.main import create_app
from app.settings import Settings
from app.sim.simulator import SessionSimulator, SimConfig, SimRates, fold_in_memory
from app.store.append import fastpath
from app.store.append.group import GroupCommit
from app.store.engine.db import Database
from app.store.ops.rebuild import PROJECTIONS, computed_rows, projection_rows
from tests.factory import open_body, turn

pytestmark = pytest.mark.postgres_only

HEAD = {"active_leaf": 1, "topk": None, "spec_correct": 0, "spec_proposed": 0,
        "spec_verify": 0, "spec_completion": 0}
NODE = dict.fromkeys(fastpath.NODE_COLUMNS, 0) | {
    "parent": 0, "depth": 1, "r3_start": None, "r3_end": None, "finish_reason": None,
    "weight_version": None, "cached_tokens": None, "record_ts": None, "record_hour": None,
    "record_day": None}


@pytest.fixture
def plain_postgres(backend: str) -> None:
    if backend == "citus":
        pytest.skip("plain PostgreSQL only: group commit is off on Citus")


@pytest.fixture
async def pool(settings: Settings) -> AsyncIterator[asyncpg.Pool]:
    db = Database(settings.store.database_url, settings)
    try:
        yield await db.driver_pool()
    finally:
        await db.dispose()


def call_args(sid: str, num_nodes: int, seq: int | None = None,
              event_id: str | None = None) -> tuple[Any, ...]:
    """A raw call appending a child of turn 0 to a session holding `num_nodes` turns."""
    stored = StoredTurn(payload="{}", prompt_lcp=1, prompt_delta=b"", patch=None)
    seq = num_nodes if seq is None else seq
    return fastpath.append_args(sid, num_nodes, seq, event_id or f"raw-{uuid.uuid4().hex}",
                                stored, 1, NODE, HEAD)


async def opened(client: httpx.AsyncClient, *sids: str) -> None:
    """Sessions with one turn each (turn count 1)."""
    for s in sids:
        assert (await client.post("/v1/sessions", json=open_body(s))).status_code == 201
        assert (await client.post(f"/v1/sessions/{s}/turns",
                                  json=turn([1], [2]))).status_code == 201


class Blocker:
    """Row locks on sessions, held by a transaction of the test's own."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.conn: asyncpg.Connection | None = None

    async def lock(self, *sids: str) -> None:
        self.conn = await self.pool.acquire()
        await self.conn.execute("BEGIN")
        for s in sids:
            await self.conn.execute(
                "SELECT 1 FROM sessions WHERE session_id = $1 FOR UPDATE", s)

    async def release(self) -> None:
        assert self.conn is not None
        await self.conn.execute("ROLLBACK")
        await self.pool.release(self.conn)
        self.conn = None


async def waiting_on_lock(pool: asyncpg.Pool, count: int) -> list[int]:
    """The pids of the `count` calls waiting on a row lock (polls until they are)."""
    for _ in range(200):
        async with pool.acquire() as conn:
            pids = [r["pid"] for r in await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE 'SELECT turnlog_%append(%' AND datname = current_database()")]
        if len(pids) >= count:
            return pids
        await asyncio.sleep(0.02)
    raise AssertionError(f"{count} calls never blocked on the held row locks")


@contextlib.asynccontextmanager
async def a_group_in_flight(pool: asyncpg.Pool, blocked: str, *held: str, max_appends: int
                            ) -> AsyncIterator[tuple[GroupCommit, asyncio.Task[int | None]]]:
    """A group commit whose first call (an append of `blocked`) is in flight, waiting on
    the row lock a transaction of the test holds on `blocked` (and on `held`): calls
    made inside the block form the next group. The locks go when the block is left."""
    group = GroupCommit(pool, window_s=5.0, max_appends=max_appends, max_bytes=1 << 30)
    blocker = Blocker(pool)
    await blocker.lock(blocked, *held)
    try:
        first = asyncio.create_task(group.append(call_args(blocked, 1)))
        await waiting_on_lock(pool, 1)
        yield group, first
    finally:
        await blocker.release()


async def turn_counts(pool: asyncpg.Pool, sids: list[str]) -> dict[str, int]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT s.session_id, s.num_nodes, (SELECT count(*) FROM events e "
            "WHERE e.session_id = s.session_id AND e.type = 'turn_recorded') AS events "
            "FROM sessions s WHERE s.session_id = ANY($1::text[])", sids)
    for r in rows:
        assert r["num_nodes"] == r["events"], dict(r)
    return {r["session_id"]: r["num_nodes"] for r in rows}


async def test_concurrent_sessions_store_exactly_the_rows_of_serial_appends(
        settings, plain_postgres):
    """Many simulated sessions appended at once (each session's turns in order, as a
    client sends them): the projections equal a rebuild from the log, the samples
    equal the in-memory fold of the same bodies, and groups of several sessions did
    commit together."""
    grouped = settings.replace(group_commit_window_us=20_000, group_commit_max_appends=8,
                               group_commit_siblings=1)
    app = create_app(grouped)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://turnlog")
    sims = []
    for seed in range(24):
        config = SimConfig(session_id=f"gc-{uuid.uuid4().hex}", version=("v1", "v2")[seed % 2],
                           pause_generation_mode=("retract", "in_place")[seed % 2],
                           speculative=True, max_trim_tokens=seed % 2)
        sims.append(SessionSimulator(config, random.Random(seed), SimRates(omit_parent=0.3)))
    sent: dict[str, list[dict[str, Any]]] = {}

    async def play(sim: SessionSimulator) -> None:
        sid = sim.config.session_id
        assert (await client.post("/v1/sessions", json=sim.open_body())).status_code == 201
        sent[sid] = []
        for _ in range(5):
            body = sim.random_turn()
            r = await client.post(f"/v1/sessions/{sid}/turns", json=body)
            assert r.status_code == 201, r.text
            sent[sid].append(body)
        assert (await client.post(f"/v1/sessions/{sid}/close", json={})).status_code == 200

    try:
        await asyncio.gather(*(play(sim) for sim in sims))
        via = await app.state.services.writer.one_trip_via()
        assert isinstance(via, GroupCommit)
        assert via.stats.groups > 0 and via.stats.largest > 1, via.stats
        assert via.stats.failed == 0
        for sim in sims:
            sid = sim.config.session_id
            state, _ = fold_in_memory(sim.open_body(), sent[sid])
            expected = build_samples(state, parse_close({})).to_json(arrays=True)
            got = (await client.get(f"/v1/sessions/{sid}/samples",
                                    params={"arrays": "true"})).json()
            assert strict_equal(got, expected), sid
        db = Database(settings.store.database_url, settings)
        try:
            async with db.read() as conn:
                for sim in sims:
                    sid = sim.config.session_id
                    recomputed = await computed_rows(conn, sid)
                    for name in PROJECTIONS:
                        stored = await projection_rows(conn, name, [sid])
                        assert sorted(stored, key=canonical) == sorted(
                            recomputed[name], key=canonical), (sid, name)
        finally:
            await db.dispose()
    finally:
        await client.aclose()
        await app.state.services.db.dispose()


async def test_a_failing_member_falls_back_alone(client, pool, plain_postgres):
    """One call of the group violates a constraint (a seq the session already has):
    it answers None (the general path decides it alone); the others are committed."""
    blocked, *sids = [f"gf-{i}-{uuid.uuid4().hex}" for i in range(5)]
    await opened(client, blocked, *sids)
    async with a_group_in_flight(pool, blocked, max_appends=4) as (group, first):
        calls = [call_args(s, 1) for s in sids[:3]] + [call_args(sids[3], 1, seq=0)]
        answers = await asyncio.wait_for(
            asyncio.gather(*(group.append(a) for a in calls)), 30)
    assert isinstance(await first, int)
    assert all(isinstance(p, int) for p in answers[:3]) and answers[3] is None, answers
    assert group.stats.groups == 1 and group.stats.largest == 4
    assert await turn_counts(pool, [blocked, *sids]) == {
        blocked: 2, sids[0]: 2, sids[1]: 2, sids[2]: 2, sids[3]: 1}


async def test_a_killed_connection_answers_every_member_an_error_and_stores_none(
        client, pool, plain_postgres):
    """The group's backend is terminated while its batch waits on a lock: every member
    gets the error a lost connection gives a single append (one the API answers 503),
    and nothing of the group is durable; acknowledged = durable."""
    blocked, held, *sids = [f"gk-{i}-{uuid.uuid4().hex}" for i in range(5)]
    held = f"zz-{held}"  # last in session_id order: the others are written before it
    await opened(client, blocked, held, *sids)
    async with a_group_in_flight(pool, blocked, held, max_appends=4) as (group, first):
        members = [asyncio.create_task(group.append(call_args(s, 1))) for s in [*sids, held]]
        pids = await waiting_on_lock(pool, 2)
        async with pool.acquire() as conn:
            batch = await conn.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE pid = ANY($1::int[]) "
                "AND query LIKE 'SELECT turnlog_try_append(%'", pids)
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", batch)
        answers = await asyncio.wait_for(
            asyncio.gather(*members, return_exceptions=True), 30)
    assert isinstance(await first, int)
    assert all(isinstance(a, Exception) and database_unavailable(a) for a in answers), answers
    assert group.stats.failed == 1
    assert await turn_counts(pool, [blocked, held, *sids]) == {
        blocked: 2, held: 1, **dict.fromkeys(sids, 1)}


async def test_calls_run_alone_until_enough_transactions_are_in_flight(
        client, pool, plain_postgres):
    """`siblings` = 3: three calls in flight (blocked on the test's row locks) each ran
    alone, on connections of their own; the fourth opens a group, which the fifth
    fills. With fewer in flight nothing waits for the window (5 s here)."""
    sids = [f"gn-{i}-{uuid.uuid4().hex}" for i in range(5)]
    await opened(client, *sids)
    group = GroupCommit(pool, window_s=5.0, max_appends=2, max_bytes=1 << 30, siblings=3)
    blocker = Blocker(pool)
    await blocker.lock(*sids[:3])
    try:
        alone = [asyncio.create_task(group.append(call_args(s, 1))) for s in sids[:3]]
        await waiting_on_lock(pool, 3)  # three transactions in flight at once: none grouped
        assert group.stats.alone == 3 and group.stats.groups == 0
        grouped = await asyncio.wait_for(asyncio.gather(
            *(group.append(call_args(s, 1)) for s in sids[3:])), 30)
        assert all(isinstance(p, int) for p in grouped), grouped
        assert group.stats.groups == 1 and group.stats.largest == 2
    finally:
        await blocker.release()
    assert all(isinstance(p, int) for p in await asyncio.gather(*alone))
    assert group.stats.alone == 3 and group._in_flight == 0
    assert await turn_counts(pool, sids) == dict.fromkeys(sids, 2)


async def test_two_appends_of_a_session_never_share_a_group(client, pool, plain_postgres):
    """The second call of a session closes the open group and opens the next: the two
    never share a transaction, and only one of them writes."""
    blocked, sid, other = [f"gs-{i}-{uuid.uuid4().hex}" for i in range(3)]
    await opened(client, blocked, sid, other)
    async with a_group_in_flight(pool, blocked, max_appends=8) as (group, first):
        answers = await asyncio.wait_for(asyncio.gather(
            group.append(call_args(sid, 1)), group.append(call_args(other, 1)),
            group.append(call_args(sid, 1)), group.drain()), 30)
    await first
    # The two calls of `sid` were sent together (attached against the same count), so
    # either may take the row lock first, as two single calls would: one writes, the
    # other finds the count moved and writes nothing (the general path would decide it).
    assert isinstance(answers[1], int)
    assert sorted([answers[0] is None, answers[2] is None]) == [False, True], answers
    assert group.stats.groups == 1 and group.stats.largest == 2  # {sid, other}, then {sid}
    assert await turn_counts(pool, [sid, other]) == {sid: 2, other: 2}


async def test_order_and_repeats_hold_through_the_api(settings, plain_postgres):
    """Concurrent appends of one session (and of others around it) keep seq dense and
    every parent existing; each repeat answers 200 with the first reply."""
    app = create_app(settings.replace(group_commit_window_us=20_000, group_commit_siblings=1))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://turnlog")
    try:
        sids = [f"go-{i}-{uuid.uuid4().hex}" for i in range(8)]
        for s in sids:
            assert (await client.post("/v1/sessions", json=open_body(s))).status_code == 201
        bodies = {s: [turn([1, 2, i], [3], event_id=f"e{i}") for i in range(6)] for s in sids}
        sends = [(s, b) for i in range(6) for s in sids for b in [bodies[s][i]]]
        replies = await asyncio.gather(*(client.post(f"/v1/sessions/{s}/turns", json=b)
                                         for s, b in sends))
        assert all(r.status_code == 201 for r in replies), [r.text for r in replies]
        first = {(s, b["event_id"]): r.json() for (s, b), r in zip(sends, replies, strict=True)}
        repeats = await asyncio.gather(*(client.post(f"/v1/sessions/{s}/turns", json=b)
                                         for s, b in sends))
        for (s, b), r in zip(sends, repeats, strict=True):
            assert r.status_code == 200 and r.json() == first[(s, b["event_id"])], r.text
        for s in sids:
            tree = (await client.get(f"/v1/sessions/{s}")).json()["tree"]
            assert sorted(n["seq"] for n in tree) == list(range(6))
            assert all(n["parent"] is None or n["parent"] < n["seq"] for n in tree)
        via = await app.state.services.writer.one_trip_via()
        assert isinstance(via, GroupCommit) and via.stats.groups > 0, via.stats
    finally:
        await client.aclose()
        await app.state.services.db.dispose()


async def test_the_feed_fence_holds_back_commits_behind_an_open_group(
        client, pool, plain_postgres):
    """A group has written some rows and waits on a lock; a later append of another
    session commits. The feed shows neither until the group commits, then every one
    once: a consumer following the feed never skips a committed turn."""
    blocked, held, *sids = [f"gff-{i}-{uuid.uuid4().hex}" for i in range(4)]
    held = f"zz-{held}"
    later = f"gfl-{uuid.uuid4().hex}"
    await opened(client, blocked, held, later, *sids)
    page = {"next": None, "events": [None]}
    while page["events"]:
        page = (await client.get("/v1/events", params={"limit": 1000, **(
            {"after": page["next"]} if page["next"] else {})})).json()
    cursor = page["next"]
    async with a_group_in_flight(pool, blocked, held, max_appends=3) as (group, first):
        members = [asyncio.create_task(group.append(call_args(s, 1))) for s in [*sids, held]]
        await waiting_on_lock(pool, 2)
        r = await client.post(f"/v1/sessions/{later}/turns", json=turn([1, 2, 3], [4]))
        assert r.status_code == 201, r.text
        page = (await client.get("/v1/events", params={"after": cursor})).json()
        assert page == {"events": [], "next": cursor}  # held back by the open group
    await first
    positions = await asyncio.gather(*members)
    seen = []
    while True:
        page = (await client.get("/v1/events", params={"after": cursor, "limit": 2})).json()
        if not page["events"]:
            break
        seen += page["events"]
        cursor = page["next"]
    assert {(e["session_id"], e["seq"]) for e in seen} == {
        (blocked, 1), (held, 1), (later, 1), *((s, 1) for s in sids)}
    assert len(seen) == len({e["position"] for e in seen})  # each once
    assert set(positions) <= {e["position"] for e in seen}


async def test_group_commit_is_off_on_citus(settings, backend):
    """Citus: one transaction per append (a group would span workers: two-phase commit);
    plain PostgreSQL: on by default."""
    app = create_app(settings)
    try:
        via = await app.state.services.writer.one_trip_via()
        assert isinstance(via, asyncpg.Pool if backend == "citus" else GroupCommit)
    finally:
        await app.state.services.db.dispose()
