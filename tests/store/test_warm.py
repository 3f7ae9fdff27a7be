"""`Database.warm`: the driver pool's connections opened before the first requests,
kept while idle, and a database that is down at start is no error."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from app.settings import Settings
from app.store.engine import db as db_module
from app.store.engine.db import Database
from app.store.engine.dialect import IDLE_LIFETIME_S
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
