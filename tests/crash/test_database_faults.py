"""The database lost, damaged or tampered with (issue 13, items 4, 10, 11).

- PostgreSQL stopped (`pg_ctl stop -m immediate` on a private cluster): every
  request answers 503 `unavailable` with Retry-After, never 500, the log has
  warnings without tracebacks, and the server recovers once it is back.
- A SQLite file with damaged pages: `/readyz` says so (503), reads answer 503
  problems, never 500.
- `DELETE FROM sessions` from another connection is refused by a trigger on
  both dialects; rows orphaned anyway (trigger dropped) make `turnlog rebuild`
  fail and name them instead of reporting equal checksums.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import sqlite3
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine
from structlog.testing import capture_logs
from typer.testing import CliRunner

from app.cli.main import cli
from app.main import create_app
from app.settings import Settings
from app.store.engine import migrate
from tests.factory import open_body, turn
from tests.pg.stoppable import migrated_stoppable_cluster


def app_client(url: str) -> tuple[Any, httpx.AsyncClient]:
    app = create_app(Settings.load(database_url=url, migrate_on_start=False, api_tokens=""))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                             base_url="http://localhost")
    return app, http


async def fill(http: httpx.AsyncClient, sids: list[str], turns: int = 3) -> None:
    for sid in sids:
        assert (await http.post("/v1/sessions", json=open_body(sid))).status_code == 201
        prompt = [1, 2]
        for i in range(turns):
            r = await http.post(f"/v1/sessions/{sid}/turns", json=turn(prompt, [10 + i]))
            assert r.status_code == 201, r.text
            prompt = [*prompt, 10 + i, 20 + i]


def requests_for(sid: str, n: int) -> list[tuple[str, str, Any]]:
    out: list[tuple[str, str, Any]] = []
    for i in range(n):
        out += [
            ("GET", f"/v1/sessions/{sid}", None),
            ("GET", f"/v1/sessions/{sid}/events?limit=5", None),
            ("GET", "/v1/sessions?limit=5", None),
            ("POST", "/v1/sessions", open_body(f"new-{uuid.uuid4().hex}")),
            ("POST", f"/v1/sessions/{sid}/turns", turn([1, 2, 99, i], [7])),
            ("GET", "/v1/events?limit=5", None),
        ]
    return out


async def test_a_frozen_postgres_makes_readyz_not_ready_within_its_bound(monkeypatch):
    # A helper's finding: with PostgreSQL frozen (SIGSTOP: connections open, no
    # answer) `/readyz` waited as long as the freeze (75 s), so a balancer kept
    # routing to a server whose every request hung.
    from app.api.routes import health

    monkeypatch.setattr(health, "READY_TIMEOUT_S", 1.0, raising=False)
    async with migrated_stoppable_cluster() as cluster:
        app, http = app_client(cluster.url)
        assert (await http.get("/readyz")).status_code == 200
        cluster.freeze()
        try:
            started = time.monotonic()
            ready = await asyncio.wait_for(http.get("/readyz"), 30)
            waited = time.monotonic() - started
        finally:
            cluster.freeze(False)
        assert ready.status_code == 503, ready.text
        assert ready.json()["type"] == "urn:turnlog:not-ready"
        assert ready.json()["reason"] == "database-unreachable"
        assert waited < 5, waited
        # Thawed: ready again.
        deadline = time.monotonic() + 20
        while (await http.get("/readyz")).status_code != 200:
            assert time.monotonic() < deadline, "not ready after the database came back"
            await asyncio.sleep(0.2)
        await http.aclose()
        await app.state.services.db.dispose()


# -- 4. PostgreSQL stopped ------------------------------------------------------------------

async def test_a_stopped_postgres_is_503_with_retry_after_and_no_tracebacks():
    async with migrated_stoppable_cluster() as cluster:
        app, http = app_client(cluster.url)
        sid = f"pg-{uuid.uuid4().hex}"
        await fill(http, [sid])
        await asyncio.to_thread(cluster.stop, "immediate")
        statuses: Counter[int] = Counter()
        with capture_logs() as logs:
            for method, path, body in requests_for(sid, 5):
                r = await http.request(method, path, json=body)
                statuses[r.status_code] += 1
                assert r.status_code == 503, (method, path, r.status_code, r.text)
                assert r.headers["content-type"] == "application/problem+json"
                assert r.json()["type"] == "urn:turnlog:unavailable", r.text
                assert int(r.headers["retry-after"]) >= 1
            # Concurrent appends of several sessions (group commit is on by default):
            # each is the 503 a single append gets, none is told "stored".
            burst = await asyncio.gather(*(
                http.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2, 77, i], [7]))
                for i in range(8)))
            for r in burst:
                statuses[r.status_code] += 1
                assert r.status_code == 503, r.text
                assert r.json()["type"] == "urn:turnlog:unavailable", r.text
            ready = await http.get("/readyz")
        assert ready.status_code == 503 and ready.json()["type"] == "urn:turnlog:not-ready"
        assert "127.0.0.1" not in ready.text and str(cluster.port) not in ready.text
        assert not [e for e in logs if e["log_level"] in ("error", "critical", "exception")]
        assert not [e for e in logs if e.get("exc_info")], "a traceback was logged"
        warnings = [e for e in logs if e["event"] == "database unavailable"]
        assert 1 <= len(warnings) <= 3, warnings  # throttled: not one per request

        await asyncio.to_thread(cluster.start)
        deadline = time.monotonic() + 20
        while True:
            r = await http.get(f"/v1/sessions/{sid}")
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            assert r.status_code == 503, r.text
            await asyncio.sleep(0.1)
        assert r.status_code == 200 and r.json()["num_nodes"] == 3
        r = await http.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2, 10, 20], [5]))
        assert r.status_code == 201, r.text
        await http.aclose()
        await app.state.services.db.dispose()


# -- 10. a damaged SQLite file ------------------------------------------------------------

def damage(path: Path, seed: int, pages: int = 12) -> None:
    """Overwrite random whole pages (never page 1, the header) with garbage."""
    rng = random.Random(seed)
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    size = path.stat().st_size
    count = size // page_size
    with path.open("r+b") as f:
        for page in rng.sample(range(1, count), min(pages, count - 1)):
            f.seek(page * page_size)
            f.write(rng.randbytes(page_size))


async def test_a_damaged_sqlite_file_is_not_ready_and_reads_are_503(tmp_path):
    path = tmp_path / "damaged.db"
    url = f"sqlite+aiosqlite:///{path}"
    await migrate.upgrade_async(url)
    app, http = app_client(url)
    sids = [f"d-{i}-{uuid.uuid4().hex[:8]}" for i in range(40)]
    await fill(http, sids, turns=4)
    await http.aclose()
    await app.state.services.db.dispose()
    shutil.copy(path, tmp_path / "sound.db")

    damage(path, seed=13)
    app, http = app_client(url)
    with capture_logs() as logs:
        ready = await http.get("/readyz")
        statuses: Counter[int] = Counter()
        for sid in sids:
            for route in (f"/v1/sessions/{sid}", f"/v1/sessions/{sid}/events",
                          f"/v1/sessions/{sid}/state"):
                r = await http.get(route)
                statuses[r.status_code] += 1
                assert r.status_code in (200, 404, 503), (route, r.status_code, r.text)
                if r.status_code == 503:
                    assert r.json()["type"] == "urn:turnlog:unavailable"
    assert ready.status_code == 503, ready.text
    assert ready.json()["reason"] == "database-damaged"
    assert statuses[503] > 0, statuses
    assert any(e["event"] == "SQLite integrity check failed" for e in logs)
    await http.aclose()
    await app.state.services.db.dispose()

    # The undamaged copy is ready; the check can be turned off for huge files.
    sound = f"sqlite+aiosqlite:///{tmp_path / 'sound.db'}"
    app, http = app_client(sound)
    assert (await http.get("/readyz")).status_code == 200
    await http.aclose()
    await app.state.services.db.dispose()
    skip = create_app(Settings.load(database_url=url, migrate_on_start=False, api_tokens="",
                               integrity_check=False))
    assert await skip.state.services.integrity.problems() == []
    await skip.state.services.db.dispose()


# -- 11. deletes around the log ------------------------------------------------------------

async def test_deleting_sessions_is_refused_and_rebuild_reports_orphans(db_url, backend, client,
                                                                        sid):
    await fill(client, [sid], turns=2)
    engine = create_async_engine(db_url)
    try:
        if backend == "sqlite":
            # Foreign keys are off on a plain connection: only the trigger stands guard.
            async with engine.connect() as conn:
                assert (await conn.exec_driver_sql("PRAGMA foreign_keys")).scalar() == 0
        with pytest.raises(DBAPIError, match="immutable"):
            async with engine.begin() as conn:
                await conn.execute(sa.text("DELETE FROM sessions WHERE session_id = :s"),
                                   {"s": sid})
        if backend == "postgres":
            with pytest.raises(DBAPIError, match="immutable"):
                async with engine.begin() as conn:
                    await conn.execute(sa.text("TRUNCATE sessions CASCADE"))
    finally:
        await engine.dispose()
    assert (await client.get(f"/v1/sessions/{sid}")).status_code == 200


async def test_rebuild_names_events_whose_session_is_gone(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'orphans.db'}"
    await migrate.upgrade_async(url)
    app, http = app_client(url)
    kept, gone = f"kept-{uuid.uuid4().hex[:6]}", f"gone-{uuid.uuid4().hex[:6]}"
    await fill(http, [kept, gone], turns=2)
    await http.aclose()
    await app.state.services.db.dispose()
    # What an operator's tool could do: drop the guard, delete without foreign keys.
    with sqlite3.connect(tmp_path / "orphans.db") as conn:
        conn.execute("DROP TRIGGER sessions_no_delete")
        conn.execute("DELETE FROM session_labels WHERE session_id = ?", (gone,))
        conn.execute("DELETE FROM sessions WHERE session_id = ?", (gone,))
    result = await asyncio.to_thread(CliRunner().invoke, cli,
                                     ["rebuild", "--database-url", url])
    assert result.exit_code == 1, result.output
    assert "belong to no session" in result.output, result.output
    assert gone in result.output and kept not in result.output.split("belong")[1]
    assert "3 events row(s)" in result.output, result.output
