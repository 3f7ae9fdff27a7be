"""SQLite: a server whose database file or `-wal` was removed or replaced under it
refuses writes (503) and is not ready, rather than acknowledging writes that the next
start cannot see (a helper's finding: 95 turns answered 201 after `rm t.db-wal`, all
gone after a restart)."""

import asyncio
import os
import shutil

import pytest

from app.store.engine import migrate
from tests.factory import open_body, turn
from tests.inprocess import served


@pytest.mark.parametrize("fault", ["wal-removed", "file-replaced"])
async def test_a_replaced_sqlite_file_is_503_and_not_ready(tmp_path, fault):
    path = tmp_path / "t.db"
    url = f"sqlite+aiosqlite:///{path}"
    await migrate.upgrade_async(url)
    async with served(url) as (_app, http):
        assert (await http.post("/v1/sessions", json=open_body("a"))).status_code == 201
        assert (await http.post("/v1/sessions/a/turns",
                                json=turn([1], [2]))).status_code == 201
        assert (await http.get("/readyz")).status_code == 200
        if fault == "wal-removed":
            os.unlink(f"{path}-wal")
        else:  # a copy put in its place, as `mv backup.db t.db` does
            shutil.copy(path, tmp_path / "copy.db")
            os.replace(tmp_path / "copy.db", path)
        refused = await http.post("/v1/sessions", json=open_body("b"))
        assert refused.status_code == 503, refused.text
        assert str(path) in refused.json()["detail"]
        again = await http.post("/v1/sessions/a/turns", json=turn([1, 2, 3], [4]))
        assert again.status_code == 503, again.text
        ready = await http.get("/readyz")
        assert ready.status_code == 503 and ready.json()["reason"] == "database-replaced"
    # What a restarted server sees holds nothing the refused writes would have claimed.
    async with served(url) as (_app, http):
        assert (await http.get("/v1/sessions/b")).status_code == 404


async def test_readyz_is_not_queued_behind_the_writes(tmp_path):
    """A review's finding: the file check waited for the process's write lock, which a
    write holds while it waits up to a minute for another process's SQLite lock, so
    `/readyz` was no longer bounded by its 5 s."""
    url = f"sqlite+aiosqlite:///{tmp_path / 't.db'}"
    await migrate.upgrade_async(url)
    async with served(url) as (app, http):
        assert (await http.get("/readyz")).status_code == 200
        async with app.state.services.db._write_lock, asyncio.timeout(3):  # a write
            assert (await http.get("/readyz")).status_code == 200


async def test_a_connection_opened_after_the_replace_refuses_too(tmp_path):
    """A review's finding: with the writer's pooled connection busy, `/readyz` opened a
    new one, which took the replacing file for its own and passed; the pool then held
    a connection to each file and writes alternated 201 / 503. Every connection of the
    process now compares the path with the file its first connection opened."""
    path = tmp_path / "t.db"
    url = f"sqlite+aiosqlite:///{path}"
    await migrate.upgrade_async(url)
    async with served(url) as (app, http):
        assert (await http.post("/v1/sessions", json=open_body("a"))).status_code == 201
        shutil.copy(path, tmp_path / "copy.db")
        os.replace(tmp_path / "copy.db", path)
        async with app.state.services.db.writer.connect():  # the pooled one, busy
            ready = await http.get("/readyz")
            assert ready.status_code == 503 and ready.json()["reason"] == "database-replaced"
        for sid in ("b", "c", "d"):
            refused = await http.post("/v1/sessions", json=open_body(sid))
            assert refused.status_code == 503, refused.text
