"""The one-call append on SQLite (`app/store/append/sqlite_path.py`).

Oracle: the general path. The same turns (new nodes, repeats, a refused
conflict, a close and a reward) written once through each path, with the same
clock, leave every table with the same rows. Plus: a stale cache writes
nothing and the general path decides, and a failure inside the transaction
leaves nothing behind and surfaces as SQLAlchemy's error.
"""

from __future__ import annotations

import itertools
import random

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from app.domain.errors import DomainError
from app.settings import Settings
from app.sim.simulator import SessionSimulator, SimConfig, SimRates
from app.store.append import sqlite_path, writes
from app.store.append.writes import Writer
from app.store.engine import migrate
from app.store.engine.db import Database
from app.store.engine.schema import events, metadata, nodes
from app.store.fold.loader import StateCache
from tests.factory import open_body, turn


@pytest.fixture
async def sqlite_db(fresh_database):
    url = fresh_database("sqlite")
    await migrate.upgrade_async(url)
    return url


@pytest.fixture
def calls(monkeypatch):
    """Counts the one-call appends and how many wrote (the real call is made)."""
    seen = {"calls": 0, "written": 0}
    real = sqlite_path.append

    async def counting(*args):
        seen["calls"] += 1
        position = await real(*args)
        seen["written"] += position is not None
        return position

    monkeypatch.setattr(sqlite_path, "append", counting)
    return seen


async def play(url: str, one_call: bool, monkeypatch) -> None:
    """Sessions of random turns, with repeats, a conflicting repeat, a close and a
    reward, on a deterministic clock."""
    clock = itertools.count(1_700_000_000_000_000, 1000)
    monkeypatch.setattr(writes, "now_us", lambda: next(clock))
    monkeypatch.setattr(Database, "one_trip_appends", property(lambda self: one_call))
    db = Database(url, Settings.load(database_url=url))
    writer = Writer(db, StateCache(64), 1024)
    try:
        for seed in range(4):
            sid = f"oc-{seed}"
            config = SimConfig(session_id=sid, version=("v1", "v2")[seed % 2],
                               pause_generation_mode=("retract", "in_place")[seed % 2],
                               speculative=True, max_trim_tokens=seed % 2,
                               labels={"run_id": "oc", "rollout_id": seed})
            sim = SessionSimulator(config, random.Random(seed),
                                   SimRates(no_r3=0.2, omit_parent=0.3))
            await writer.open_session(sim.open_body())
            sent = []
            for _ in range(8):
                body = sim.random_turn()
                assert (await writer.append_turn(sid, body)).created
                sent.append(body)
            assert not (await writer.append_turn(sid, sent[3])).created
            other = {**sent[2], "record": {**sent[2]["record"], "timestamp": 1.0}}
            with pytest.raises(DomainError):
                await writer.append_turn(sid, other)
            if seed % 2:
                await writer.close_session(sid, {"metadata": {"reward": 0.5}})
    finally:
        await db.dispose()


async def table_rows(url: str) -> dict[str, list[tuple]]:
    db = Database(url, Settings.load(database_url=url))
    try:
        async with db.read() as conn:
            return {table.name: sorted((await conn.execute(sa.select(table))).all(), key=repr)
                    for table in metadata.sorted_tables}
    finally:
        await db.dispose()


async def test_one_call_writes_the_rows_the_general_path_writes(
        fresh_database, monkeypatch, calls):
    general, one_call = fresh_database("sqlite"), fresh_database("sqlite")
    for url in (general, one_call):
        await migrate.upgrade_async(url)
    await play(general, False, monkeypatch)
    assert calls == {"calls": 0, "written": 0}
    await play(one_call, True, monkeypatch)
    # Every new turn found its state cached: 4 sessions × 8 turns, in one call each.
    assert calls == {"calls": 32, "written": 32}
    want, got = await table_rows(general), await table_rows(one_call)
    assert want["nodes"] and want["events"] and want["r3_patches"]
    assert got == want


async def test_a_stale_cache_writes_nothing_and_the_general_path_decides(sqlite_db, calls):
    dbs = [Database(sqlite_db, Settings.load(database_url=sqlite_db)) for _ in range(2)]
    writers = [Writer(db, StateCache(8), 1024) for db in dbs]  # two processes' caches
    sid = "stale"
    try:
        await writers[0].open_session(open_body(sid))
        for i, w in enumerate(writers):  # both caches hold the one-turn state
            written = await w.append_turn(sid, turn([1, 2], [3], event_id="root"))
            assert written.created == (i == 0)
        assert (await writers[0].append_turn(sid, turn([1, 2, 3, 4], [5], event_id="a"))
                ).body["seq"] == 1
        before = dict(calls)
        reply = (await writers[1].append_turn(sid, turn([1, 2, 3, 4, 5, 6], [7],
                                                        event_id="b"))).body
        assert (reply["seq"], reply["parent"]) == (2, 1)
        assert calls["calls"] == before["calls"] + 1
        assert calls["written"] == before["written"]  # refused: the cache was behind
    finally:
        for db in dbs:
            await db.dispose()


async def test_a_failure_inside_the_transaction_leaves_nothing(sqlite_db, monkeypatch):
    db = Database(sqlite_db, Settings.load(database_url=sqlite_db))
    writer = Writer(db, StateCache(8), 1024)
    sid = "fails"
    try:
        await writer.open_session(open_body(sid))
        await writer.append_turn(sid, turn([1, 2], [3], event_id="e0"))
        real = sqlite_path.insert_sql

        def broken(table, columns):
            return "INSERT INTO no_such_table VALUES (1)" if table == "nodes" \
                else real(table, columns)

        # After the event insert: the transaction must roll it back.
        monkeypatch.setattr(sqlite_path, "insert_sql", broken)
        with pytest.raises(DBAPIError):
            await writer.append_turn(sid, turn([1, 2, 3, 4], [5], event_id="e1"))
        monkeypatch.setattr(sqlite_path, "insert_sql", real)
        async with db.read() as conn:
            for table, rows in ((events, 2), (nodes, 1)):  # the open and e0; e0
                count = sa.select(sa.func.count()).select_from(table) \
                    .where(table.c.session_id == sid)
                assert (await conn.execute(count)).scalar_one() == rows, table.name
        written = await writer.append_turn(sid, turn([1, 2, 3, 4], [5], event_id="e1"))
        assert written.created and written.body["seq"] == 1
    finally:
        await db.dispose()
