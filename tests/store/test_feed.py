"""The global feed and the session list: commit order, cursors, long-poll, no skips."""

import asyncio

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from tests.factory import open_body, turn
from tests.inprocess import served

# An event a test's own transaction writes, to hold it open against the API's writers.
SLOW_OPEN = ("INSERT INTO events (session_id, type, payload, recorded_us) "
             "VALUES (:s, 'session_opened', '{\"session\": {}}', 0)")


async def tail_cursor(client):
    nxt = None
    while True:
        page = (await client.get("/v1/events", params={"limit": 1000, **(
            {"after": nxt} if nxt else {})})).json()
        nxt = page["next"]
        if not page["events"]:
            return nxt


async def test_feed_pages_in_commit_order(client, sid):
    start = await tail_cursor(client)
    await client.post("/v1/sessions", json=open_body(sid))
    for i in range(3):
        await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2 + i], [3]))
    seen = []
    cur = start
    for _ in range(10):
        page = (await client.get("/v1/events", params={"after": cur, "limit": 2})).json()
        seen += page["events"]
        cur = page["next"]
        if not page["events"]:
            break
    assert [e["type"] for e in seen] == ["session_opened"] + ["turn_recorded"] * 3
    assert [e["seq"] for e in seen] == [None, 0, 1, 2]
    assert all(e["session_id"] == sid for e in seen)


async def test_empty_page_keeps_cursor(client):
    cur = await tail_cursor(client)
    page = (await client.get("/v1/events", params={"after": cur})).json()
    assert page == {"events": [], "next": cur}


async def test_bad_cursor_and_limits_are_422(client):
    assert (await client.get("/v1/events", params={"after": "garbage!"})).status_code == 422
    assert (await client.get("/v1/events", params={"limit": 0})).status_code == 422
    assert (await client.get("/v1/events", params={"limit": "x"})).status_code == 422


async def test_wait_long_polls_until_an_event_arrives(client, sid):
    cur = await tail_cursor(client)

    async def later():
        await asyncio.sleep(0.3)
        await client.post("/v1/sessions", json=open_body(sid))

    task = asyncio.create_task(later())
    page = (await client.get("/v1/events", params={"after": cur, "wait": 10})).json()
    await task
    assert [e["session_id"] for e in page["events"]] == [sid]


@pytest.mark.postgres_only  # SQLite has one writer: rowid order is commit order
async def test_feed_never_skips_a_slow_transaction(client, db_url, sid):
    """A transaction that inserted earlier but commits later must still be read."""
    await client.post("/v1/sessions", json=open_body(sid))
    cur = await tail_cursor(client)
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as slow:
            await slow.begin()
            await slow.execute(sa.text(SLOW_OPEN), {"s": sid})
            # a later, faster writer commits while the slow one is still open
            fast = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1], [2]))
            assert fast.status_code == 201
            page = (await client.get("/v1/events", params={"after": cur})).json()
            assert page["events"] == []  # the fence holds both back
            assert page["next"] == cur
            await slow.commit()
    finally:
        await engine.dispose()
    page = (await client.get("/v1/events", params={"after": cur})).json()
    assert [e["type"] for e in page["events"]] == ["session_opened", "turn_recorded"]


@pytest.mark.postgres_only  # SQLite has one writer: rowid order is commit order
async def test_positions_increase_along_the_feed(client, db_url, sid):
    """A transaction that took its id first but inserts after a later one committed:
    the feed (which never skips it) shows it first, and its position is the smaller —
    a position is the event's place in the feed's order (a helper saw them fall)."""
    await client.post("/v1/sessions", json=open_body(sid))
    cur = await tail_cursor(client)
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as slow:
            await slow.begin()
            await slow.execute(sa.text("SELECT pg_current_xact_id()"))  # its id, taken first
            fast = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1], [2]))
            assert fast.status_code == 201
            slow_position = (await slow.execute(sa.text(SLOW_OPEN + " RETURNING position"),
                                                {"s": sid})).scalar_one()
            await slow.commit()
    finally:
        await engine.dispose()
    page = (await client.get("/v1/events", params={"after": cur})).json()
    assert [e["type"] for e in page["events"]] == ["session_opened", "turn_recorded"]
    positions = [e["position"] for e in page["events"]]
    assert positions == [slow_position, fast.json()["position"]]
    assert positions[0] < positions[1]


async def test_positions_increase_along_the_feed_with_concurrent_writers(client, sid):
    sids = [f"{sid}-{i}" for i in range(6)]
    start = await tail_cursor(client)

    async def writer(s: str) -> None:
        assert (await client.post("/v1/sessions", json=open_body(s))).status_code == 201
        for i in range(5):
            r = await client.post(f"/v1/sessions/{s}/turns", json=turn([1, 2 + i], [3]))
            assert r.status_code == 201
        assert (await client.post(f"/v1/sessions/{s}/close", json={})).status_code == 200

    await asyncio.gather(*(writer(s) for s in sids))
    page = (await client.get("/v1/events", params={"after": start, "limit": 1000})).json()
    positions = [e["position"] for e in page["events"]]
    assert len(positions) == 6 * 7 and positions == sorted(set(positions))


@pytest.mark.postgres_only  # SQLite's rows carry no transaction id
async def test_a_database_restored_onto_another_server_keeps_its_feed(fresh_database, backend,
                                                                    sid):
    """A review's finding: PostgreSQL's transaction ids are the server's, not the data's.
    Rows restored (pg_dump) from a server whose ids were far ahead stayed behind the
    feed fence, and new rows' positions fell below theirs (negative, once made from the
    ids). `turnlog migrate` (run by serve and gateway at start) puts the store's clock
    ahead of them. (A database of its own: the clock moves for good.)"""
    import httpx

    from app.main import create_app
    from app.settings import Settings
    from app.store.engine import migrate

    db_url = fresh_database(backend)
    await migrate.upgrade_async(db_url)
    app = create_app(Settings.load(database_url=db_url, migrate_on_start=False, api_tokens=""))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as client:
        try:
            await _restored_rows_are_read_in_order(client, db_url, sid)
        finally:
            await app.state.services.db.dispose()
    # Downgrading past 0012 would hide those rows again: refused, the clock kept.
    with pytest.raises(RuntimeError, match="clock was moved"):
        await asyncio.to_thread(migrate.downgrade, db_url, "0011")


async def _restored_rows_are_read_in_order(client, db_url, sid):
    from app.store.engine import migrate
    from app.store.engine.schema import sessions

    restored = f"{sid}-restored"
    await client.post("/v1/sessions", json=open_body(sid))
    cur = await tail_cursor(client)
    engine = create_async_engine(db_url)
    try:
        async with engine.begin() as conn:
            ahead = 10**7 + (await conn.execute(sa.text(
                "SELECT pg_current_xact_id()::text::bigint"))).scalar_one()
            far = 10**7 * 1024 + (await conn.execute(sa.text(
                "SELECT max(position) FROM events"))).scalar_one()
            columns = ", ".join(c.name for c in sessions.c if c.name not in ("id", "xid",
                                                                             "session_id"))
            await conn.execute(sa.text(
                f"INSERT INTO sessions (session_id, xid, {columns}) "
                f"SELECT :restored, :ahead, {columns} FROM sessions WHERE session_id = :sid"),
                {"restored": restored, "ahead": ahead, "sid": sid})
            await conn.execute(sa.text(
                "INSERT INTO events (session_id, type, event_id, payload, recorded_us, xid, "
                "position) SELECT :restored, type, event_id, payload, recorded_us, :ahead, :far "
                "FROM events WHERE session_id = :sid AND type = 'session_opened'"),
                {"restored": restored, "ahead": ahead, "far": far, "sid": sid})
    finally:
        await engine.dispose()
    page = (await client.get("/v1/events", params={"after": cur})).json()
    assert page["events"] == []  # behind the fence: the server's ids are behind the rows'
    engine = create_async_engine(db_url)
    try:
        async with engine.begin() as conn:
            await _forget_the_check(conn)  # restored: checked under another server's start
    finally:
        await engine.dispose()
    await migrate.upgrade_async(db_url)  # at head already: only the clock moves
    turn_reply = await client.post(f"/v1/sessions/{restored}/turns", json=turn([1], [2]))
    assert turn_reply.status_code == 201, turn_reply.text
    page = (await client.get("/v1/events", params={"after": cur})).json()
    assert [(e["session_id"], e["type"]) for e in page["events"]] == [
        (restored, "session_opened"), (restored, "turn_recorded")]
    assert [e["position"] for e in page["events"]] == [far, turn_reply.json()["position"]]
    assert far < turn_reply.json()["position"]
    events = (await client.get(f"/v1/sessions/{restored}/events")).json()
    assert [e["type"] for e in events] == ["session_opened", "turn_recorded"]


async def _set_offset(db_url: str, offset: int) -> None:
    """The store's clock at `offset`, as the server found it at its last start (a
    restore or a crash: the clock not checked since the server started)."""
    engine = create_async_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("UPDATE turnlog_clock SET xid_offset = :o"),
                               {"o": offset})
            await _forget_the_check(conn)
    finally:
        await engine.dispose()


async def _forget_the_check(conn) -> None:
    """As after a crash, a restart or a restore: the clock not checked since (0014's
    unlogged row, which crash recovery empties and a restore carries from another
    server start)."""
    if (await conn.execute(sa.text(
            "SELECT to_regclass('turnlog_clock_checked') IS NOT NULL"))).scalar_one():
        await conn.execute(sa.text("DELETE FROM turnlog_clock_checked"))


@pytest.mark.postgres_only  # SQLite's rows carry no transaction id
@pytest.mark.parametrize("migrated_to", ["head", "0013"])
async def test_a_store_restored_with_no_row_since_0012_takes_writes(fresh_database, backend,
                                                                    sid, migrated_to):
    """A helper's finding: a store restored onto a server with lower transaction ids,
    with no row written since migration 0012 ran (an empty store, or the documented
    upgrade before a move), kept its clock below 0012's floor: `migrate` moved
    nothing (the reclock looked at the rows' ids only) and every write was a 503 that
    blamed the connection. At head a new connection moves the clock; a store
    restored before 0014 takes writes once `turnlog migrate` has run."""
    from app.store.engine import migrate

    db_url = fresh_database(backend)
    await migrate.upgrade_async(db_url, migrated_to)
    # The restore: this server's ids 10^7 behind those the store was migrated under
    # (the same as the store's clock 10^7 behind).
    await _set_offset(db_url, -10**7)
    async with served(db_url) as (app, client):
        if migrated_to != "head":
            refused = await client.post("/v1/sessions", json=open_body(sid))
            assert refused.status_code == 503
            assert "turnlog migrate" in refused.json()["detail"]
            await migrate.upgrade_async(db_url)  # 0014, then the clock moves
        opened = await client.post("/v1/sessions", json=open_body(sid))
        assert opened.status_code == 201, opened.text
        reply = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1], [2]))
        assert reply.status_code == 201, reply.text
        events = (await client.get("/v1/events")).json()["events"]
        positions = [e["position"] for e in events]
        assert len(positions) == 2 and positions == sorted(set(positions))


@pytest.mark.postgres_only  # SQLite's rows carry no transaction id
async def test_ids_handed_out_again_after_a_crash_move_the_clock_on_reconnect(
        fresh_database, backend, sid):
    """A helper's finding: a Citus coordinator killed (`pg_ctl stop -m immediate`)
    handed out again the transaction ids of its last unflushed commits — its own
    transaction writes no WAL, so its commit is not flushed — while the worker rows
    stamped with them were durable: positions repeated, fell within a session (its
    reads and appends then failed with 500 for good) and the feed skipped events.
    Every connection is new after such a crash, and a new connection moves the clock
    past every stamped row first. Simulated by moving the clock back by 10^7 ids
    under a running server."""
    from app.store.engine import migrate

    db_url = fresh_database(backend)
    await migrate.upgrade_async(db_url)
    async with served(db_url) as (app, client):
        assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 201
        first = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1], [2]))
        assert first.status_code == 201, first.text
        await _set_offset(db_url, -10**7)
        behind = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2, 3], [4]))
        assert behind.status_code == 503  # a connection from before: refused, not stored
        await app.state.services.db.dispose()  # the crash: every connection is gone
        second = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2, 3], [4]))
        assert second.status_code == 201, second.text
        events = (await client.get(f"/v1/sessions/{sid}/events")).json()
        assert [e["seq"] for e in events if e["type"] == "turn_recorded"] == [0, 1]
        positions = [e["position"] for e in (await client.get("/v1/events")).json()["events"]]
        assert len(positions) == 3 and positions == sorted(set(positions))


@pytest.mark.postgres_only  # SQLite's rows carry no transaction id
async def test_only_the_first_connection_after_a_server_start_runs_the_full_reclock(
        fresh_database, backend, sid):
    """A review's finding: the reclock on every new connection read every shard, so
    with one Citus worker down no new connection could be made — sessions on the
    healthy workers failed too as connections turned over. The full reclock runs once
    per server start; other connections read one row of the coordinator's."""
    from app.store.engine import migrate

    db_url = fresh_database(backend)
    await migrate.upgrade_async(db_url)
    async with served(db_url) as (app, client):
        assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 201
        # The full reclock unusable from now on (as with a worker down on Citus).
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                await conn.execute(sa.text(
                    "CREATE OR REPLACE FUNCTION turnlog_reclock() RETURNS bigint "
                    "LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'no worker'; END $$"))
            await app.state.services.db.dispose()  # every connection new
            reply = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1], [2]))
            assert reply.status_code == 201, reply.text
            # Nor does `turnlog migrate` (serve's start) at head: it started with a
            # worker down (a helper's finding).
            await migrate.upgrade_async(db_url)
            # The check's row is UNLOGGED: crash recovery (also the postmaster's
            # reinitialization after one backend died, its start time kept) empties it.
            async with engine.begin() as conn:
                assert (await conn.execute(sa.text(
                    "SELECT relpersistence FROM pg_class "
                    "WHERE relname = 'turnlog_clock_checked'"))).scalar_one() in ("u", b"u")
            # As after a restart: the first connection must check, and cannot.
            async with engine.begin() as conn:
                await _forget_the_check(conn)
            await app.state.services.db.dispose()
            failed = await client.get(f"/v1/sessions/{sid}")
            assert failed.status_code >= 500
        finally:
            await engine.dispose()


@pytest.mark.postgres_only  # SQLite's rows carry no transaction id
async def test_first_connections_at_once_move_the_clock_once_without_deadlock(
        fresh_database, backend):
    """A review's finding: two first connections that both had to move the clock each
    read it, then asked for its exclusive lock: a deadlock (1-3 of 8 connections failed
    in 4 of 5 trials). Reclocks now queue on an advisory lock."""
    import asyncpg
    from sqlalchemy.engine import make_url

    from app.store.engine import migrate
    from app.store.engine.dialect import RECLOCK_ON_CONNECT

    db_url = fresh_database(backend)
    await migrate.upgrade_async(db_url)
    await _set_offset(db_url, -10**7)
    dsn = make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    conns = [await asyncpg.connect(dsn) for _ in range(8)]
    try:
        await asyncio.gather(*(c.execute(RECLOCK_ON_CONNECT) for c in conns))
        offset = await conns[0].fetchval("SELECT xid_offset FROM turnlog_clock")
        assert offset > -10**7  # moved: the store's next id is past the floor now
        assert await conns[0].fetchval(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint + xid_offset "
            "> xid_floor FROM turnlog_clock")
        assert await conns[0].fetchval("SELECT turnlog_reclock()") == offset  # no more
    finally:
        await asyncio.gather(*(c.close() for c in conns))


async def worker_of(conn, session_id):
    return (await conn.execute(sa.text(
        "SELECT nodeport FROM citus_shards WHERE table_name = 'events'::regclass "
        "AND shardid = get_shard_id_for_distribution_column('events', CAST(:s AS text))"),
        {"s": session_id})).scalar_one()


async def test_feed_never_skips_a_slow_transaction_on_another_worker(client, db_url, backend,
                                                                    sid):
    """Citus: transaction ids and snapshots are per node. A writer held open on one
    worker must hold back a later, committed append on the other worker."""
    if backend != "citus":
        pytest.skip("Citus only: needs two workers")
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as conn:
            slow_sid, fast_sid = f"{sid}-slow", None
            slow_port = await worker_of(conn, slow_sid)
            for i in range(64):
                if await worker_of(conn, f"{sid}-fast{i}") != slow_port:
                    fast_sid = f"{sid}-fast{i}"
                    break
        assert fast_sid is not None
        for s in (slow_sid, fast_sid):
            assert (await client.post("/v1/sessions", json=open_body(s))).status_code == 201
        cur = await tail_cursor(client)
        async with engine.connect() as slow:
            await slow.begin()
            await slow.execute(sa.text(SLOW_OPEN), {"s": slow_sid})
            for i in range(3):
                fast = await client.post(f"/v1/sessions/{fast_sid}/turns",
                                         json=turn([1, 2 + i], [3]))
                assert fast.status_code == 201
            page = (await client.get("/v1/events", params={"after": cur})).json()
            assert page == {"events": [], "next": cur}  # the fence holds the fast worker back
            await slow.commit()
    finally:
        await engine.dispose()
    page = (await client.get("/v1/events", params={"after": cur})).json()
    assert [(e["session_id"], e["type"]) for e in page["events"]] == [
        (slow_sid, "session_opened")] + [(fast_sid, "turn_recorded")] * 3


async def test_list_sessions_filters_by_labels_and_status(client, sid):
    run = sid
    await client.post("/v1/sessions", json=open_body(f"{sid}-a", labels={
        "run_id": run, "rollout_id": 12}))
    await client.post("/v1/sessions", json=open_body(f"{sid}-b", labels={
        "run_id": run, "rollout_id": 13}))
    page = (await client.get("/v1/sessions", params={"run_id": run})).json()
    assert [s["session_id"] for s in page["sessions"]] == [f"{sid}-a", f"{sid}-b"]
    page = (await client.get("/v1/sessions", params={"run_id": run, "rollout_id": "12"})).json()
    assert [s["session_id"] for s in page["sessions"]] == [f"{sid}-a"]
    page = (await client.get("/v1/sessions", params={"run_id": run, "status": "closed"})).json()
    assert page["sessions"] == []
    first = (await client.get("/v1/sessions", params={"run_id": run, "limit": 1})).json()
    second = (await client.get("/v1/sessions", params={"run_id": run, "limit": 1,
                                                       "after": first["next"]})).json()
    assert [s["session_id"] for s in second["sessions"]] == [f"{sid}-b"]
    assert (await client.get("/v1/sessions", params={"status": "weird"})).status_code == 422


@pytest.mark.postgres_only
async def test_the_clock_does_not_move_in_normal_operation(client, db_url, sid):
    """A review's finding: the reclock took the server's id in one statement and the
    rows' largest in another, so a writer committing in between moved the clock with no
    restore at all (13 moves in 13,374 calls under 8 writers) — and a move while a
    writer is in flight lets the feed skip its rows. One statement, one snapshot now."""
    sids = [f"{sid}-{i}" for i in range(4)]
    for s in sids:
        await client.post("/v1/sessions", json=open_body(s))
    engine = create_async_engine(db_url)
    stop = asyncio.Event()

    async def writer(s: str) -> None:
        i = 0
        while not stop.is_set():
            r = await client.post(f"/v1/sessions/{s}/turns", json=turn([1, i], [2]))
            assert r.status_code == 201, r.text
            i += 1

    try:
        writers = [asyncio.create_task(writer(s)) for s in sids]
        offsets = set()
        async with engine.connect() as conn:
            for _ in range(150):
                offsets.add((await conn.execute(sa.text("SELECT turnlog_reclock()"))).scalar())
                await conn.commit()
        stop.set()
        await asyncio.gather(*writers)
    finally:
        await engine.dispose()
    assert offsets == {0}
