"""The feed-fence lag gauge is right for a role without `pg_read_all_stats`.

Such a role sees NULL `xact_start` for other roles' backends in
`pg_stat_activity`; the gauge used to read 0.0 while another role's open
transaction held every later event back. It now also measures how long the
oldest committed event behind the fence has waited, which needs no grant."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from app.services import build_services
from app.settings import Settings
from app.store.append.writes import now_us
from app.store.engine import migrate
from app.store.engine.dialect import fence_lag_seconds
from tests.factory import open_body


@pytest.fixture
def unprivileged_url(fresh_database):
    """A migrated PostgreSQL database and a login role that may only use its tables."""
    admin_url = fresh_database("postgres")
    migrate.upgrade(admin_url)
    role = f"lag_{uuid.uuid4().hex[:8]}"

    async def setup(statements: list[str]) -> None:
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(admin_url, isolation_level="AUTOCOMMIT")
        async with engine.connect() as conn:
            for statement in statements:
                await conn.execute(sa.text(statement))
        await engine.dispose()

    asyncio.run(setup([
        f"CREATE ROLE {role} LOGIN PASSWORD 'lag-test-pw'",
        f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO {role}",
        f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}",
    ]))
    url = make_url(admin_url).set(username=role, password="lag-test-pw")
    yield admin_url, url.render_as_string(hide_password=False)
    asyncio.run(setup([f"DROP OWNED BY {role}", f"DROP ROLE {role}"]))


async def test_lag_counts_another_roles_transaction_without_pg_read_all_stats(
        unprivileged_url):
    admin_url, url = unprivileged_url
    admin = build_services(Settings.load(database_url=admin_url, api_tokens=""))
    app = build_services(Settings.load(database_url=url, api_tokens=""))
    try:
        async with app.db.read() as conn:
            assert not (await conn.execute(sa.text(
                "SELECT pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')"))).scalar()
        async with admin.db.write() as held:
            await held.execute(sa.text("SELECT pg_current_xact_id()"))  # holds the fence
            await app.writer.open_session(open_body(f"s-{uuid.uuid4().hex}"))  # behind it
            await asyncio.sleep(0.5)
            async with app.db.read() as conn:
                lag = await fence_lag_seconds(conn, now_us())
            assert lag >= 0.5
        async with app.db.read() as conn:
            assert await fence_lag_seconds(conn, now_us()) < 0.5  # released
    finally:
        await admin.db.dispose()
        await app.db.dispose()
