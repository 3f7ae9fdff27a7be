"""PostgreSQL connection loss mid-append: the server's backends are terminated
(`pg_terminate_backend`) over and over while four clients append. The server
answers 503 `unavailable` (never 500, never a half-written turn), the clients'
retries land every turn exactly once, and the server recovers by itself."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter

import asyncpg
import httpx
from sqlalchemy.engine import make_url

from app.main import create_app
from app.settings import Settings
from app.store.engine import migrate
from tests.crash.conftest import Played, check_session, play, simulator
from turnlog_client import TurnlogClient

TERMINATE = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
    "WHERE application_name = 'turnlog' AND pid <> pg_backend_pid() "
    "AND datname = current_database()"
)


class RecordingTransport(httpx.AsyncBaseTransport):
    """Counts the statuses the app answered (the retries hide them from the caller)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.statuses: Counter[int] = Counter()
        self.unavailable: list[dict] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        self.statuses[response.status_code] += 1
        if response.status_code >= 500:
            await response.aread()
            self.unavailable.append({"status": response.status_code,
                                     "body": response.content.decode(errors="replace"),
                                     "retry_after": response.headers.get("retry-after")})
        return response


async def test_terminated_connections_answer_503_and_retries_land_each_turn_once(
    fresh_database,
):
    url = fresh_database("postgres")
    await migrate.upgrade_async(url)
    app = create_app(Settings.load(database_url=url, migrate_on_start=False))
    transport = RecordingTransport(httpx.ASGITransport(app=app, raise_app_exceptions=False))
    client = TurnlogClient("http://turnlog", transport=transport, retries=100,
                           retry_deadline=30, backoff=0.01, max_backoff=0.1)
    admin = await asyncpg.connect(make_url(url).set(drivername="postgresql")
                                  .render_as_string(hide_password=False))
    await client.ready()  # a warm pool: the cuts hit appends, not the dialect's first connect
    stop = asyncio.Event()
    played: list[Played] = []
    terminated = 0

    async def worker(index: int) -> None:
        rng = random.Random(index)
        n = 0
        while not stop.is_set() or n == 0:
            sim = simulator(f"loss-{index}-{n}-{uuid.uuid4().hex[:8]}", index + n,
                            rng.randrange(2**32))
            played.append(await play(client, sim, 8, generated_ids=index % 2 == 1))
            n += 1

    async def killer() -> None:
        nonlocal terminated
        rng = random.Random(7)
        deadline = time.monotonic() + 20
        # Keep cutting until several appends were caught mid-flight.
        while time.monotonic() < deadline and (len(transport.unavailable) < 5
                                               or terminated < 10):
            await asyncio.sleep(rng.uniform(0.002, 0.03))
            terminated += await admin.fetchval(TERMINATE)
        stop.set()

    try:
        await asyncio.wait_for(asyncio.gather(killer(), *(worker(i) for i in range(4))), 90)
        assert terminated >= 10
        errors = [u for u in transport.unavailable if u["status"] != 503]
        assert not errors, errors[:3]
        assert len(transport.unavailable) >= 1, "no append was caught mid-flight"
        assert all(u["retry_after"] for u in transport.unavailable)
        assert all("urn:turnlog:unavailable" in u["body"] for u in transport.unavailable)
        # Recovered: ready again, and everything the clients sent is there exactly once.
        assert (await client.ready())["status"] == "ready"
        for item in played:
            await check_session(client, item)
    finally:
        await admin.close()
        await client.aclose()
        await app.state.services.db.dispose()


async def test_a_connection_whose_protocol_broke_answers_503_and_is_not_reused(
    fresh_database, monkeypatch,
):
    """The race the test above catches now and then, made certain: a pool connection
    whose backend was ended between two calls is handed out before the driver read
    the socket's end, and its next call raises asyncpg's InternalClientError. The
    append answers 503 (nothing reached the server), the connection is closed rather
    than handed out again, and the retry lands the turn once."""
    url = fresh_database("postgres")
    await migrate.upgrade_async(url)
    app = create_app(Settings.load(database_url=url, migrate_on_start=False))
    transport = RecordingTransport(httpx.ASGITransport(app=app, raise_app_exceptions=False))
    client = TurnlogClient("http://turnlog", transport=transport, retries=3, backoff=0.01)
    broken: list[asyncpg.Connection] = []
    real_fetchval = asyncpg.pool.PoolConnectionProxy.fetchval

    async def fetchval_once_broken(self: asyncpg.pool.PoolConnectionProxy, query: str,
                                   *args: object, **kwargs: object) -> object:
        if "turnlog_append(" in query and not broken:
            broken.append(self._con)
            raise asyncpg.exceptions.InternalClientError(
                "cannot switch to state 11; another operation (2) is in progress")
        return await real_fetchval(self, query, *args, **kwargs)

    monkeypatch.setattr(asyncpg.pool.PoolConnectionProxy, "fetchval", fetchval_once_broken)
    try:
        sim = simulator(f"broken-{uuid.uuid4().hex[:8]}", 0, 1)
        item = await play(client, sim, 3, generated_ids=True)
        assert broken, "the append never went through the one-round-trip call"
        assert broken[0].is_closed()
        assert [u["status"] for u in transport.unavailable] == [503]
        assert transport.unavailable[0]["retry_after"]
        assert "urn:turnlog:unavailable" in transport.unavailable[0]["body"]
        await check_session(client, item)
    finally:
        await client.aclose()
        await app.state.services.db.dispose()
