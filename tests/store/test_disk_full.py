"""SQLite on a full disk: each write is 503 `disk-full` and stores nothing, and `/readyz`
says so until there is room again (a helper's finding: `/readyz` answered 200 while a
full disk failed every append and close, so neither a balancer nor the suggested
alert noticed).

The disk fills for real as far as SQLite can tell: `PRAGMA max_page_count` makes the
file unable to grow, and SQLite answers SQLITE_FULL exactly as on a full
filesystem. What `/readyz` reads of the filesystem's free space is the one thing
set here (`disk.free_bytes`): a test cannot fill the machine's disk.
"""

import pytest
import sqlalchemy as sa

from app.store.engine import disk, migrate
from tests.factory import open_body, turn
from tests.inprocess import served

LONG = list(range(1, 30_001))  # ~200 KB of JSON: many more pages than the room left


async def room_for(app, pages: int | None) -> None:
    """Let the file grow by `pages` pages more than it has now (None: unbounded)."""
    writer = app.state.services.db.writer
    async with writer.connect() as conn:
        count = (await conn.execute(sa.text("PRAGMA page_count"))).scalar_one()
    limit = 1_073_741_823 if pages is None else count + pages

    def bounded(dbapi_connection, _record):
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA max_page_count = {limit}")
        cursor.close()

    sa.event.listen(writer.sync_engine, "connect", bounded)
    await writer.dispose()  # the next connection is bounded


async def test_a_full_disk_is_not_ready_until_there_is_room(tmp_path, monkeypatch):
    url = f"sqlite+aiosqlite:///{tmp_path / 't.db'}"
    await migrate.upgrade_async(url)
    free = {"bytes": 1 << 20}
    monkeypatch.setattr(disk, "free_bytes", lambda _path: free["bytes"])
    async with served(url) as (app, http):
        assert (await http.post("/v1/sessions", json=open_body("a"))).status_code == 201
        assert (await http.get("/readyz")).status_code == 200
        await room_for(app, 1)
        refused = await http.post("/v1/sessions/a/turns", json=turn(LONG, [2]))
        assert refused.status_code == 503 and "disk is full" in refused.json()["detail"]
        ready = await http.get("/readyz")
        assert ready.status_code == 503, ready.text
        assert ready.json()["reason"] == "disk-full" and "1.0 MiB free" in ready.json()["detail"]
        # Room made outside (a backup moved away): ready again without a write.
        free["bytes"] = disk.ROOM_AFTER_FULL
        assert (await http.get("/readyz")).status_code == 200
        # Full again; then a write that fits, although the filesystem looks as full as
        # before (the file had free pages of its own): a commit unmarks it.
        free["bytes"] = 1 << 20
        assert (await http.post("/v1/sessions/a/turns",
                                json=turn(LONG, [2]))).status_code == 503
        assert (await http.get("/readyz")).json()["reason"] == "disk-full"
        await room_for(app, None)
        assert (await http.post("/v1/sessions/a/turns",
                                json=turn(LONG, [2]))).status_code == 201
        assert (await http.get("/readyz")).status_code == 200
        # Only the one that fit was stored.
        events = (await http.get("/v1/sessions/a/events")).json()
        assert [e["type"] for e in events] == ["session_opened", "turn_recorded"]


async def test_a_write_refused_for_another_reason_leaves_readiness_alone(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 't.db'}"
    await migrate.upgrade_async(url)
    async with served(url) as (_app, http):
        assert (await http.post("/v1/sessions/none/turns",
                                json=turn([1], [2]))).status_code == 404
        assert (await http.get("/readyz")).status_code == 200


@pytest.mark.parametrize("raised", [True, False])
def test_the_watch_marks_only_a_full_disk(tmp_path, raised):
    import sqlite3

    watch = disk.DiskWatch(str(tmp_path / "t.db"))
    watch.failed(sqlite3.OperationalError("database or disk is full" if raised
                                          else "database is locked"))
    assert (watch.full_since is not None) is raised
