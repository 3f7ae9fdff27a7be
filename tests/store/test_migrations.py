"""Migrations run for real: upgrade → downgrade → upgrade on both dialects, no drift."""

import asyncio

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.util.exc import CommandError
from sqlalchemy.ext.asyncio import create_async_engine

from app.store.engine import migrate, revision
from app.store.engine.schema import metadata


@pytest.fixture(params=["sqlite", "postgres", "citus"])
def empty_url(request, fresh_database):
    return fresh_database(request.param)


async def table_names(url):
    engine = create_async_engine(url)
    async with engine.connect() as conn:
        names = await conn.run_sync(lambda c: sa.inspect(c).get_table_names())
    await engine.dispose()
    return set(names) - {"alembic_version"}


async def drift(url):
    engine = create_async_engine(url)
    async with engine.connect() as conn:
        diff = await conn.run_sync(
            lambda c: compare_metadata(MigrationContext.configure(c), metadata))
    await engine.dispose()
    return diff


async def test_upgrade_downgrade_upgrade(empty_url):
    await migrate.upgrade_async(empty_url)
    assert set(metadata.tables) <= await table_names(empty_url)
    await asyncio.to_thread(migrate.downgrade, empty_url, "base")
    assert await table_names(empty_url) == set()
    await migrate.upgrade_async(empty_url)
    assert set(metadata.tables) <= await table_names(empty_url)
    assert await asyncio.to_thread(migrate.current, empty_url) == migrate.head_revision()


async def test_schema_matches_table_definitions(db_url):
    assert await drift(db_url) == []


PAYLOAD_COMPRESSION = ("SELECT attcompression::text FROM pg_attribute "
                       "WHERE attrelid = '{table}'::regclass AND attname = 'payload'")


async def payload_compression(url: str, citus: bool) -> tuple[bool, set[str]]:
    """Whether the server has LZ4, and `events.payload`'s `attcompression` on the table
    and, on Citus, on every shard."""
    engine = create_async_engine(url)
    async with engine.connect() as conn:
        has_lz4 = (await conn.exec_driver_sql(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings "
            "WHERE name = 'default_toast_compression'")).scalar()
        found = [(await conn.exec_driver_sql(PAYLOAD_COMPRESSION.format(table="events"))).scalar()]
        if citus:
            rows = await conn.exec_driver_sql(
                "SELECT result FROM run_command_on_shards('events', $$"
                + PAYLOAD_COMPRESSION.format(table="%s") + "$$)")
            shards = [row[0] for row in rows]
            assert shards, "no shard of events"
            found += shards
    await engine.dispose()
    return bool(has_lz4), set(found)


@pytest.mark.postgres_only
async def test_turn_payload_is_compressed_with_lz4(db_url, backend):
    """Migration 0011: `events.payload` uses LZ4 (`attcompression` 'l'), on every Citus
    shard too; its downgrade gives the default back ('') and the upgrade LZ4 again."""
    has_lz4, found = await payload_compression(db_url, backend == "citus")
    if not has_lz4:
        pytest.skip("this PostgreSQL was built without LZ4: migration 0011 sets nothing")
    assert found == {"l"}
    await asyncio.to_thread(migrate.downgrade, db_url, "0010")
    assert (await payload_compression(db_url, backend == "citus"))[1] == {""}
    await migrate.upgrade_async(db_url)
    assert (await payload_compression(db_url, backend == "citus"))[1] == {"l"}


async def execute(url, statement):
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.execute(sa.text(statement))
    await engine.dispose()


async def test_a_database_with_turnlog_named_tables_but_no_version_is_refused_untouched(
        empty_url):
    # A helper's finding: a file with another `events` table was half-migrated (its
    # SQLite DDL not transactional): `sessions` created, then "table events already
    # exists", and no turnlog command could go on from there.
    await execute(empty_url, "CREATE TABLE events (id integer primary key, x text)")
    with pytest.raises(migrate.NotTurnlogDatabase, match="tables named as turnlog's"):
        await migrate.upgrade_async(empty_url)
    assert await table_names(empty_url) == {"events"}  # nothing written


async def test_a_sqlite_file_of_other_tables_is_refused_untouched(fresh_database):
    url = fresh_database("sqlite")
    await execute(url, "CREATE TABLE mine (x text)")
    with pytest.raises(migrate.NotTurnlogDatabase, match="not turnlog's"):
        await migrate.upgrade_async(url)
    assert await table_names(url) == {"mine"}


def test_two_processes_migrating_one_new_database_both_succeed(empty_url):
    # A helper's finding: `turnlog serve` and `turnlog gateway` started together on a
    # new SQLite file both created tables; one failed ("table sessions already exists").
    # The migration now takes a lock (the file's flock; PostgreSQL's advisory lock).
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "app", "migrate", "--database-url", empty_url]
    procs = [subprocess.Popen(command, cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for _ in range(3)]
    results = [(p.wait(timeout=120), p.stderr.read().decode()) for p in procs]  # type: ignore[union-attr]
    assert all(code == 0 for code, _ in results), results
    assert set(metadata.tables) <= asyncio.run(table_names(empty_url))
    assert migrate.current(empty_url) == migrate.head_revision()


@pytest.mark.postgres_only
async def test_writes_never_wait_for_a_migrating_process(db_url, client, sid):
    """A tester's finding: the migration's lock was the consumer groups' lock's key, which
    a close takes after writing its event: with `turnlog migrate` holding it (its DDL
    waiting for that close), the close waited until the statement timeout and failed.
    Every write — open, turn, close, reward, a group's definition — goes on while
    another process holds the migration's lock."""
    from app.store.engine.dialect import MIGRATION_LOCK
    from tests.factory import open_body, turn

    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as guard:
            await guard.execute(sa.text(f"SELECT pg_advisory_lock({MIGRATION_LOCK})"))
            await guard.commit()

            async def writes() -> None:
                assert (await client.post("/v1/sessions", json=open_body(
                    sid, labels={"run_id": sid}))).status_code == 201
                assert (await client.post(f"/v1/sessions/{sid}/turns",
                                          json=turn([1], [2]))).status_code == 201
                assert (await client.put(f"/v1/consumers/g-{sid[:12]}",
                                         json={"labels": {"run_id": sid}})).status_code == 201
                assert (await client.post(f"/v1/sessions/{sid}/close",
                                          json={})).status_code == 200
                assert (await client.post(f"/v1/sessions/{sid}/rewards", json={
                    "event_id": sid, "reward": 1.0})).status_code == 201

            await asyncio.wait_for(writes(), 20)
            await guard.execute(sa.text(f"SELECT pg_advisory_unlock({MIGRATION_LOCK})"))
    finally:
        await engine.dispose()


# -- the revisions read without alembic (app/store/engine/revision.py) ------------------


def test_the_scripts_head_read_from_their_text_is_alembics():
    assert revision.scripts_head() == migrate.alembic_head() == revision.head_revision()


def _script(name: str, rev: str, down: str | None) -> tuple[str, str]:
    return name, (f'"""{name}"""\nrevision: str = "{rev}"\n'
                  f"down_revision: str | None = {down and repr(down)}\n")


@pytest.mark.parametrize(("scripts", "head"), [
    ([_script("a.py", "0001", None), _script("b.py", "0002", "0001")], "0002"),
    ([_script("a.py", "0001", None)], "0001"),
    # Two heads, a parent no script holds, a revision given twice, a line missing, none:
    # alembic's to answer.
    ([_script("a.py", "0001", None), _script("b.py", "0002", "0001"),
      _script("c.py", "0003", "0001")], None),
    ([_script("a.py", "0001", None), _script("b.py", "0003", "0002")], None),
    ([_script("a.py", "0001", None), _script("b.py", "0001", None)], None),
    ([("a.py", 'revision = "0001"\n')], None),
    ([], None),
    # Read plainly or not at all: unannotated ids are read; a merge's tuple, an id
    # assigned twice (a docstring line that looks like one included), a cycle beside
    # the chain are alembic's.
    ([("a.py", "revision = '0001'\ndown_revision = None  # the first\n"),
      _script("b.py", "0002", "0001")], "0002"),
    ([_script("a.py", "0001", None), _script("b.py", "0002", "0001"),
      _script("c.py", "0003", "0001"),
      ("m.py", 'revision = "0004"\ndown_revision = ("0002", "0003")\n')], None),
    ([_script("a.py", "0001", None),
      ("b.py", '"""\nrevision = "9999"\n"""\nrevision = "0002"\ndown_revision = "0001"\n')],
     None),
    ([_script("a.py", "0001", None),
      ("b.py", 'revision = "0002"\ndown_revision = "0001"\nrevision = "0003"\n')], None),
    ([_script("a.py", "0001", None), _script("b.py", "0002", "0001"),
      _script("c.py", "0003", "0004"), _script("d.py", "0004", "0003")], None),
    ([_script("a.py", "0001", None), _script("__init__.py", "0009", "0001")], "0001"),
], ids=["chain", "one", "two-heads", "missing-parent", "twice", "no-down-line", "none",
        "unannotated", "merge", "docstring", "reassigned", "cycle", "init-skipped"])
def test_scripts_that_are_not_one_chain_are_left_to_alembic(tmp_path, scripts, head):
    for name, text in scripts:
        (tmp_path / name).write_text(text)
    assert revision.scripts_head(tmp_path) == head


def test_an_editors_lock_file_or_an_unreadable_script_does_not_stop_the_reading(tmp_path):
    for name, text in (_script("a.py", "0001", None), _script("b.py", "0002", "0001")):
        (tmp_path / name).write_text(text)
    (tmp_path / ".#b.py").symlink_to(tmp_path / "gone")  # Emacs' lock: a dangling link
    assert revision.scripts_head(tmp_path) == "0002"
    (tmp_path / "c.py").write_bytes(b'revision = "\xff"\n')
    assert revision.scripts_head(tmp_path) is None


def _alembic_current(connection: sa.Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def test_the_current_revision_read_by_one_query_is_alembics(empty_url):
    """Not migrated, at head, downgraded, with an emptied version table: the same answer
    as alembic's migration context; with two rows, alembic's refusal."""
    def both() -> tuple[str | None, str | None]:
        return (migrate.on_connection(empty_url, revision.current_revision),
                migrate.on_connection(empty_url, _alembic_current))

    assert await asyncio.to_thread(both) == (None, None)
    if not empty_url.startswith("sqlite"):
        # Not a table: alembic does not take it for its version table, nor does this.
        engine = create_async_engine(empty_url)
        async with engine.begin() as conn:
            await conn.execute(sa.text("CREATE SEQUENCE alembic_version"))
        assert await asyncio.to_thread(both) == (None, None)
        async with engine.begin() as conn:
            await conn.execute(sa.text("DROP SEQUENCE alembic_version"))
        await engine.dispose()
    await migrate.upgrade_async(empty_url)
    assert await asyncio.to_thread(both) == (revision.head_revision(),) * 2
    await asyncio.to_thread(migrate.downgrade, empty_url, "0005")
    assert await asyncio.to_thread(both) == ("0005", "0005")
    engine = create_async_engine(empty_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("INSERT INTO alembic_version VALUES ('0004')"))
        with pytest.raises(CommandError, match="more than one head"):
            await asyncio.to_thread(migrate.on_connection, empty_url,
                                    revision.current_revision)
        async with engine.begin() as conn:
            await conn.execute(sa.text("DELETE FROM alembic_version"))
    finally:
        await engine.dispose()
    assert await asyncio.to_thread(both) == (None, None)
