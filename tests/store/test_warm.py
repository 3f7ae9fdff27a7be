"""`Database.warm`: the driver pool's connections opened before the first requests,
kept while idle, and a database that is down at start is no error."""

from __future__ import annotations

import pytest

from app.settings import Settings
from app.store.engine.db import Database
from tests.serverproc import free_port


@pytest.mark.postgres_only
async def test_warm_opens_the_whole_driver_pool_and_keeps_it(settings):
    settings = settings.replace(pool_size=3)
    db = Database(settings.store.database_url, settings)
    try:
        await db.warm()
        pool = await db.driver_pool()
        assert (pool.get_size(), pool.get_idle_size()) == (3, 3)
        # Idle connections are not closed after a while (asyncpg's default: 5 minutes).
        assert pool._max_inactive_connection_lifetime == 0
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT 1") == 1
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
