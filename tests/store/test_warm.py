"""`Database.warm`: the driver pool's connections opened before the first requests,
kept while idle, and a database that is down at start is no error."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from app.services import build_services
from app.settings import Settings
from app.store.append import warm
from app.store.engine import db as db_module
from app.store.engine.db import Database
from app.store.engine.dialect import IDLE_LIFETIME_S
from tests.factory import turn
from tests.pg.admin import connect
from tests.serverproc import free_port


@pytest.mark.postgres_only
async def test_warm_opens_the_whole_driver_pool_and_keeps_it(settings):
    settings = settings.replace(pool_size=3)
    db = Database(settings.store.database_url, settings)
    try:
        await db.warm()
        pool = await db.driver_pool()
        assert (pool.get_size(), pool.get_idle_size()) == (3, 3)
        # Idle connections are kept 30 minutes (asyncpg's default: 5), READ COMMITTED.
        assert pool._max_inactive_connection_lifetime == IDLE_LIFETIME_S
        async with pool.acquire() as conn:
            assert await conn.fetchval("SHOW transaction_isolation") == "read committed"
    finally:
        await db.dispose()


@pytest.mark.postgres_only
async def test_the_driver_pool_plans_once_on_postgresql_and_as_citus_does_on_citus(
        settings, backend):
    """Its calls carry a 0.8 MB R3 patch, and PostgreSQL's default plans each of a
    connection's first five calls anew for its values (`dialect.GENERIC_PLANS`); Citus
    routes by the parameters, so its connections keep the server's default."""
    db = Database(settings.store.database_url, settings)
    try:
        pool = await db.driver_pool()
        async with pool.acquire() as conn:
            mode = await conn.fetchval("SHOW plan_cache_mode")
        assert mode == ("auto" if backend == "citus" else "force_generic_plan")
    finally:
        await db.dispose()


async def test_warm_with_the_database_down_is_quiet():
    url = f"postgresql+asyncpg://turnlog@127.0.0.1:{free_port()}/nothing"
    settings = Settings.load(database_url=url, migrate_on_start=False)
    db = Database(url, settings)
    try:
        await db.warm()  # nothing listens there: no error, connections on demand later
    finally:
        await db.dispose()


@pytest.mark.postgres_only
async def test_a_shutdown_while_warming_gives_every_connection_back(settings, monkeypatch):
    """Cancelled mid-way (a shutdown right after start: five connections held, the
    other connects still pending), the warm-up releases what it holds: the pool's
    close, which waits for every acquired connection, returns."""
    settings = settings.replace(pool_size=8)
    monkeypatch.setattr(db_module, "WARM_HOLD_S", 600.0)  # only the cancel lets them go
    real_connect = asyncpg.pool.PoolConnectionHolder.connect
    started = 0
    never = asyncio.Event()

    async def connect_five(holder: asyncpg.pool.PoolConnectionHolder) -> None:
        nonlocal started
        started += 1
        if started > 5:
            await never.wait()  # a connect that does not finish (until cancelled)
        await real_connect(holder)

    monkeypatch.setattr(asyncpg.pool.PoolConnectionHolder, "connect", connect_five)
    db = Database(settings.store.database_url, settings)
    warming = asyncio.create_task(db.warm())
    pool = await db.driver_pool()
    for _ in range(1000):
        if pool.get_size() - pool.get_idle_size() == 5:
            break
        await asyncio.sleep(0.01)
    assert pool.get_size() - pool.get_idle_size() == 5
    warming.cancel()
    with pytest.raises(asyncio.CancelledError):
        await warming
    assert pool.get_size() == pool.get_idle_size() == 5  # every held one given back
    await asyncio.wait_for(db.dispose(), 10)


@pytest.mark.postgres_only
async def test_each_new_driver_connection_runs_the_functions_once_and_writes_nothing(
        settings, backend, monkeypatch):
    """A connection's first `turnlog_open` / `turnlog_append` compile and plan the
    functions (5-10 ms more than later calls, `app/store/append/warm.py`): every new
    connection of the writer's pool runs both once, for a throwaway session, rolled
    back. Citus connections are left as they are (its calls route by their values)."""
    ran: list[bool] = []
    real = warm.warm_connection

    async def watched(conn: asyncpg.Connection, max_nodes: int) -> bool:
        ran.append(await real(conn, max_nodes))
        return ran[-1]

    monkeypatch.setattr(warm, "warm_connection", watched)
    services = build_services(settings.replace(pool_size=2))
    try:
        await services.db.warm()
        assert ran == ([] if backend == "citus" else [True, True])
        pool = await services.db.driver_pool()
        async with pool.acquire() as conn:
            if backend != "citus":  # the three calls are prepared here, their plans made
                planned = {row["statement"].split("(")[0]: row["generic_plans"]
                           for row in await conn.fetch(
                               "SELECT statement, generic_plans FROM pg_prepared_statements")}
                for call in ("SELECT turnlog_open", "SELECT turnlog_append",
                             "SELECT turnlog_try_append"):
                    assert planned.get(call, 0) >= 1, (call, planned)
            for table in ("sessions", "session_labels", "events", "nodes", "r3_patches"):
                left = await conn.fetchval(
                    f"SELECT count(*) FROM {table} WHERE session_id LIKE $1",  # noqa: S608
                    warm.PREFIX + "%")
                assert left == 0, table
        # The warmed connections append as any other.
        sid = f"after-warm-{uuid.uuid4().hex}"
        await services.writer.open({"session_id": sid, "version": "v2"})
        written = await services.writer.append_turn(sid, turn([1, 2], [3]))
        assert written.created
    finally:
        await services.db.dispose()


@pytest.mark.postgres_only
async def test_a_server_that_refuses_the_warm_calls_leaves_the_connection_usable(settings):
    """Functions missing (a schema without them on the search path): not warmed, no
    error, and the connection's transaction is rolled back for its next call."""
    conn = await connect(make_url(settings.store.database_url))
    try:
        await conn.execute("CREATE SCHEMA IF NOT EXISTS warm_test_empty")
        await conn.execute("SET search_path = warm_test_empty")
        assert await warm.warm_connection(conn, max_nodes=100) is False
        assert not conn.is_in_transaction()
        assert await conn.fetchval("SELECT 1") == 1
    finally:
        await conn.execute("DROP SCHEMA IF EXISTS warm_test_empty")
        await conn.close()


def test_the_throwaway_calls_follow_the_rules_of_a_real_open_and_append():
    """Built by the domain, as `Writer.open` and the one-trip append build theirs: a v2
    session with one label, its first turn with R3 (every statement of both runs)."""
    open_args, append_args = warm.calls(max_nodes=100)
    session_id = open_args[0]
    assert session_id.startswith(warm.PREFIX) and append_args[0] == session_id
    assert open_args[-3:-1] == (["warm"], ["1"])  # the label's key and value
    assert append_args[1] == 0 and append_args[2] == 0  # expected nodes, seq
    assert append_args[13] is not None  # the R3 patch's bytes
    assert warm.calls(max_nodes=100)[0][0] != session_id  # a new session each time


@pytest.mark.postgres_only
async def test_a_warm_up_that_fails_leaves_appends_working(settings, monkeypatch):
    """Best effort: a failure of the warm-up itself (here a bug building its calls)
    costs the speed-up, never the connection: it opens, and appends go through."""
    def broken(max_nodes: int) -> tuple[tuple[object, ...], tuple[object, ...]]:
        raise RuntimeError("a bug in the warm-up")

    monkeypatch.setattr(warm, "calls", broken)
    services = build_services(settings.replace(pool_size=1))
    try:
        sid = f"warm-failed-{uuid.uuid4().hex}"
        await services.writer.open({"session_id": sid, "version": "v2"})
        written = await services.writer.append_turn(sid, turn([1, 2], [3]))
        assert written.created
        pool = await services.db.driver_pool()
        assert pool.get_size() == 1
    finally:
        await services.db.dispose()
