"""turnlog on Citus: the schema is distributed by session_id and an append is one worker's.

Citus only (the `db_url` fixture's third backend); the store and API suites
already run there as they are, this file checks what only Citus has.
"""

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from app.store.engine import citus, migrate
from tests.factory import open_body, r3_b64, turn


@pytest.fixture
def citus_url(db_url, backend):
    if backend != "citus":
        pytest.skip("Citus only")
    return db_url


async def scalar_rows(url, sql, **params):
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return (await conn.execute(sa.text(sql), params)).all()
    finally:
        await engine.dispose()


async def test_session_tables_are_colocated_and_shared_tables_are_references(citus_url):
    rows = await scalar_rows(citus_url, (
        "SELECT logicalrelid::text, partmethod::text, "
        "column_to_column_name(logicalrelid, partkey), colocationid FROM pg_dist_partition"))
    kinds = {name: (method, column, colocation) for name, method, column, colocation in rows}
    colocations = {kinds[t][2] for t in citus.DISTRIBUTED}
    assert len(colocations) == 1
    for table in citus.DISTRIBUTED:
        assert kinds[table][:2] == ("h", "session_id")
    for table in citus.REFERENCE:
        assert kinds[table][0] == "n"
    # partmethod 'n' is also a Citus *local* table's (a table only the coordinator
    # holds): the table type says which (a Citus helper saw metric_points as local).
    types = dict(await scalar_rows(citus_url, (
        "SELECT table_name::text, citus_table_type FROM citus_tables")))
    assert {t: types[t] for t in citus.REFERENCE} == dict.fromkeys(citus.REFERENCE, "reference")
    for table in citus.COORDINATOR_LOCAL:
        assert table not in kinds


async def test_every_shard_of_the_log_carries_the_immutability_trigger(citus_url):
    shards = await scalar_rows(citus_url, (
        "SELECT table_name::text, count(*) FROM citus_shards "
        "WHERE table_name IN ('events'::regclass, 'r3_patches'::regclass) GROUP BY 1"))
    triggers = await scalar_rows(citus_url, (
        "SELECT result FROM run_command_on_shards('events', $$SELECT count(*) FROM pg_trigger "
        "WHERE tgrelid = '%s'::regclass AND tgname LIKE 'events_immutable%%'$$)"))
    assert dict(shards)["events"] == len(triggers) >= 2
    assert all(int(count) == 1 for (count,) in triggers)


async def test_an_append_is_one_worker_transaction(client, citus_url, sid):
    """Opening, appending (with R3) and closing a session never needs two-phase commit
    (which Citus records in pg_dist_transaction); the row lock routes to one shard."""
    before = len(await scalar_rows(citus_url, "SELECT * FROM pg_dist_transaction"))
    await client.post("/v1/sessions", json=open_body(
        sid, pause_generation_mode="in_place", r3={"num_layers": 2}, labels={"run_id": sid}))
    r = await client.post(f"/v1/sessions/{sid}/turns",
                          json=turn([1, 2], [3], r3=r3_b64(2, 2, 2), start=0))
    assert r.status_code == 201
    assert (await client.post(f"/v1/sessions/{sid}/close", json={})).status_code == 200
    after = len(await scalar_rows(citus_url, "SELECT * FROM pg_dist_transaction"))
    assert after == before
    plan = "\n".join(row[0] for row in await scalar_rows(citus_url, (
        "EXPLAIN SELECT * FROM sessions WHERE session_id = :s FOR NO KEY UPDATE"), s=sid))
    assert "Task Count: 1" in plan


async def test_a_two_worker_transaction_would_use_two_phase_commit(client, citus_url, sid):
    """The check above can fail: a transaction over sessions on both workers is recorded."""
    engine = create_async_engine(citus_url)
    try:
        async with engine.connect() as conn:
            ports = {}
            for i in range(64):
                port = (await conn.execute(sa.text(
                    "SELECT nodeport FROM citus_shards WHERE table_name = 'sessions'::regclass "
                    "AND shardid = get_shard_id_for_distribution_column('sessions', "
                    "CAST(:s AS text))"), {"s": f"{sid}-{i}"})).scalar_one()
                ports.setdefault(port, f"{sid}-{i}")
                if len(ports) == 2:
                    break
            for session_id in ports.values():
                await client.post("/v1/sessions", json=open_body(session_id))
            await conn.commit()
            before = (await conn.execute(sa.text(
                "SELECT count(*) FROM pg_dist_transaction"))).scalar_one()
            await conn.commit()
            async with conn.begin():
                for session_id in ports.values():
                    await conn.execute(sa.text(
                        "INSERT INTO session_labels (session_id, key, value_text) "
                        "VALUES (:s, 'k', 'v')"),
                        {"s": session_id})
                    await conn.execute(sa.text(
                        "DELETE FROM session_labels WHERE session_id = :s AND key = 'k'"),
                        {"s": session_id})
            after = (await conn.execute(sa.text(
                "SELECT count(*) FROM pg_dist_transaction"))).scalar_one()
    finally:
        await engine.dispose()
    assert len(ports) == 2
    assert after > before


async def test_a_shared_table_left_local_becomes_a_reference_table(fresh_database, backend):
    """Migration 0013 on a database 0006 left with `metric_points` a Citus local table."""
    if backend != "citus":
        pytest.skip("Citus only: reference and local tables are Citus's")
    url = fresh_database(backend)
    await migrate.upgrade_async(url, "0012")
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text(
                "SELECT undistribute_table('metric_points', cascade_via_foreign_keys => true)"))
            await conn.execute(sa.text(
                "SELECT citus_add_local_table_to_metadata('metric_points', "
                "cascade_via_foreign_keys => true)"))
    finally:
        await engine.dispose()
    found = dict(await scalar_rows(url, "SELECT table_name::text, citus_table_type "
                                        "FROM citus_tables"))
    assert found["metric_points"] == "local"
    await migrate.upgrade_async(url)
    found = dict(await scalar_rows(url, "SELECT table_name::text, citus_table_type "
                                        "FROM citus_tables"))
    assert {t: found[t] for t in citus.REFERENCE} == dict.fromkeys(citus.REFERENCE, "reference")
