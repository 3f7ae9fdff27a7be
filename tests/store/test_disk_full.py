"""SQLite on a full disk: each write is 503 ("the database's disk is full") and stores
nothing, and `/readyz` says `disk-full` until there is room again (a helper's
finding: `/readyz` answered 200 while a full disk failed every append and close,
so neither a balancer nor the suggested alert noticed).

The disk fills for real as far as SQLite can tell: `PRAGMA max_page_count` makes the
file unable to grow, and SQLite answers SQLITE_FULL exactly as on a full
filesystem. What `/readyz` reads of the filesystem's free space is the one thing
set here (`disk.free_bytes`): a test cannot fill the machine's disk.
"""

import sqlite3

import pytest
import sqlalchemy as sa

from app.store.engine import disk, migrate
from tests.factory import open_body, turn
from tests.inprocess import served

LONG = list(range(1, 30_001))  # ~200 KB of JSON: many more pages than the room left
MIB = 1 << 20


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


@pytest.fixture
def filesystem_free(monkeypatch):
    free = {"bytes": MIB}
    monkeypatch.setattr(disk, "free_bytes", lambda _path: free["bytes"])
    return free


async def is_full(http) -> bool:
    ready = await http.get("/readyz")
    if ready.status_code == 200:
        return False
    assert ready.status_code == 503 and ready.json()["reason"] == "disk-full", ready.text
    return True


async def test_a_full_disk_is_not_ready_until_there_is_room(tmp_path, filesystem_free):
    url = f"sqlite+aiosqlite:///{tmp_path / 't.db'}"
    await migrate.upgrade_async(url)
    async with served(url) as (app, http):
        assert (await http.post("/v1/sessions", json=open_body("a"))).status_code == 201
        assert not await is_full(http)
        await room_for(app, 1)
        refused = await http.post("/v1/sessions/a/turns", json=turn(LONG, [2]))
        assert refused.status_code == 503 and "disk is full" in refused.json()["detail"]
        assert await is_full(http)
        assert "MiB of room" in (await http.get("/readyz")).json()["detail"]
        # Room made outside (a backup moved away): ready again without a write.
        filesystem_free["bytes"] = disk.ROOM_AFTER_FULL
        assert not await is_full(http)
        # Full again; then a write that fits, although the filesystem looks as full as
        # before: its commit unmarks it.
        filesystem_free["bytes"] = MIB
        assert (await http.post("/v1/sessions/a/turns",
                                json=turn(LONG, [2]))).status_code == 503
        assert await is_full(http)
        await room_for(app, None)
        assert (await http.post("/v1/sessions/a/turns",
                                json=turn(LONG, [2]))).status_code == 201
        assert not await is_full(http)
        # Only the one that fit was stored.
        events = (await http.get("/v1/sessions/a/events")).json()
        assert [e["type"] for e in events] == ["session_opened", "turn_recorded"]


async def test_only_a_committed_change_unmarks_a_full_disk(tmp_path, filesystem_free):
    """A review's finding: a write that changed nothing (a repeated ack, a dry run) made
    `/readyz` 200 again while every real write still failed. The failure here is a
    close's, on `Database.write()` (the append above is the one-call path's)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 't.db'}"
    await migrate.upgrade_async(url)
    async with served(url) as (app, http):
        assert (await http.post("/v1/sessions", json=open_body("a"))).status_code == 201
        # A trainer's session, acked before the disk filled.
        assert (await http.post("/v1/sessions", json=open_body("b"))).status_code == 201
        assert (await http.post("/v1/sessions/b/close", json={})).status_code == 200
        assert (await http.put("/v1/consumers/g", json={"from": "beginning"})).status_code == 201
        claimed = await http.post("/v1/consumers/g/claims", json={"claim_id": "c1"})
        assert claimed.json()["sessions"] == ["b"], claimed.text
        ack = "/v1/consumers/g/claims/c1/ack"
        assert (await http.post(ack, json={"step": 1})).status_code == 200
        await room_for(app, 0)
        refused = await http.post("/v1/sessions/a/close",
                                  json={"metadata": {"note": "x" * 200_000}})
        assert refused.status_code == 503, refused.text
        assert await is_full(http)
        # A trainer repeating its ack (200, nothing new): the disk still counts as full.
        assert (await http.post(ack, json={"step": 1})).status_code == 200
        assert await is_full(http)
        # A dry run of R3 retention (reads in a write transaction).
        dry = await http.post("/v1/retention/r3", json={
            "consumer": "g", "acked_before": "2100-01-01T00:00:00", "dry_run": True})
        assert dry.status_code == 200, dry.text
        assert await is_full(http)
        # An identical repeat of the open (200, nothing written), a conflicting one
        # (409, refused inside the transaction): the disk still counts as full.
        assert (await http.post("/v1/sessions", json=open_body("a"))).status_code == 200
        assert await is_full(http)
        conflict = await http.post("/v1/sessions", json=open_body("a", version="v1"))
        assert conflict.status_code == 409, conflict.text
        assert await is_full(http)


def test_the_watch_marks_only_a_full_disk(tmp_path, filesystem_free):
    watch = disk.DiskWatch(str(tmp_path / "t.db"))
    watch.failed(sqlite3.OperationalError("database is locked"))
    assert watch.filesystem_room() == MIB and watch.still_full(MIB) is None
    watch.failed(sqlite3.OperationalError("database or disk is full"))
    assert watch.still_full(MIB) == MIB
    # Room in the file (pages freed inside it) counts with the filesystem's.
    assert watch.still_full(disk.ROOM_AFTER_FULL) is None and watch.full_since is None
    # Plenty on the filesystem ends a mark without asking the file.
    watch.failed(sqlite3.OperationalError("database or disk is full"))
    filesystem_free["bytes"] = disk.ROOM_AFTER_FULL
    assert watch.filesystem_room() is None and watch.full_since is None
    # Next to nothing is full, whether this process met it or not.
    assert watch.still_full(disk.ROOM_MIN - 1) == disk.ROOM_MIN - 1
    memory = disk.DiskWatch(None)  # a database in memory has no disk to watch
    memory.failed(sqlite3.OperationalError("database or disk is full"))
    assert memory.filesystem_room() is None and memory.still_full(0) is None


async def test_a_disk_another_process_filled_is_not_ready_either(tmp_path, filesystem_free):
    """A tester's finding: with `serve --workers 2` the worker whose write had not failed
    answered 200 on a disk with 0 bytes free (and `serve` did while only the gateway
    on the same file met the full disk)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 't.db'}"
    await migrate.upgrade_async(url)
    async with served(url) as (_app, http):
        filesystem_free["bytes"] = 0
        assert await is_full(http)
        filesystem_free["bytes"] = 2 * disk.ROOM_MIN  # short, but no write failed here
        assert not await is_full(http)
