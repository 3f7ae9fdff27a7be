"""Alembic as a library: upgrade, downgrade and inspect, from sync or async code.

The migration scripts ship inside the package (`app/store/migrations/`), so an
installed wheel migrates without a source checkout. The configuration is built
here in code; the URL is handed over, never read from a file. (`migrations.ini`
and `alembic/` at the top of a clone point at the same scripts, for people who
run the `alembic` command by hand.)
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

from alembic import command
from app.store.engine.dialect import normalize_url
from app.store.engine.revision import current, current_revision, head_revision, on_connection

SCRIPTS = Path(__file__).resolve().parents[1] / "migrations"
_lock = threading.Lock()


def config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPTS))
    cfg.set_main_option("path_separator", "os")
    if url is not None:
        cfg.attributes["url"] = normalize_url(url)
    return cfg


def alembic_head() -> str | None:
    """The newest migration, as alembic reads the scripts (`revision.head_revision`
    reads it without alembic, and asks this only when it cannot)."""
    return ScriptDirectory.from_config(config()).get_current_head()


def knows(revision: str) -> bool:
    """`revision` is one of this turnlog's migrations (a newer turnlog's is not)."""
    from alembic.util.exc import CommandError

    try:
        return ScriptDirectory.from_config(config()).get_revision(revision) is not None
    except CommandError:
        return False


def newer_schema(current: str) -> str:
    """A database migrated by a newer turnlog: migrating cannot help, upgrading can."""
    return (f"schema at revision {current}, which this turnlog does not know (its newest "
            f"is {head_revision()}): a newer turnlog migrated this database; upgrade "
            "turnlog, or use the one that migrated it")


class NotTurnlogDatabase(Exception):
    """A database the migrations must not write into (`foreign_tables` says why)."""


def foreign_tables(connection: Connection) -> str | None:
    """Why a database must not be migrated, or None: one at a revision this turnlog
    does not know (a newer turnlog's), or one without a turnlog schema version and:

    Tables named as turnlog's there: another application's database, or a turnlog
    migration that stopped midway (SQLite's DDL is not transactional), which the
    next run could only fail on ("table sessions already exists"), half-written.
    A SQLite file holding other tables: most likely the wrong file. (A PostgreSQL
    database may be shared with other applications' tables.)
    """
    import sqlalchemy as sa

    from app.store.engine.schema import metadata

    current = current_revision(connection)
    if current is not None:
        return None if knows(current) else newer_schema(current)
    names = set(sa.inspect(connection).get_table_names())
    clash = sorted(names & set(metadata.tables))
    if clash:
        return (f"the database has tables named as turnlog's ({', '.join(clash[:4])}) but "
                "no turnlog schema version: another application's database, or a turnlog "
                "migration that stopped midway; restore it from a backup, or use a new "
                "database")
    other = sorted(n for n in names if n != "alembic_version" and not n.startswith("sqlite_"))
    if connection.dialect.name == "sqlite" and other:
        return (f"the SQLite file holds tables that are not turnlog's "
                f"({', '.join(other[:4])}): point --database-url (TURNLOG_DATABASE_URL) at "
                "a new file, or at turnlog's own")
    return None


def upgrade(url: str, revision: str = "head") -> None:
    with _lock:
        command.upgrade(config(url), revision)


def downgrade(url: str, revision: str) -> None:
    with _lock:
        command.downgrade(config(url), revision)


# Data nothing else can give back, by the revision whose downgrade drops it: (what the
# refusal names, the rows that hold it): the event log (and everything projected from
# it), the metric history, the consumer groups' acks, which sessions' R3 retention
# freed (without the mark, a version before 0005 reads their R3 as present: 500s), and
# which groups wait for rewarded sessions (upgraded again, they would not).
DATA_TABLES = {
    "0001": ("events", "events"),
    "0002": ("metric_submissions", "metric_submissions"),
    "0004": ("consumer_groups", "consumer_groups"),
    "0005": ("sessions.r3_pruned_bytes", "sessions WHERE r3_pruned_bytes IS NOT NULL"),
    "0007": ("consumer_groups.require_reward", "consumer_groups WHERE require_reward"),
}


def data_a_downgrade_drops(url: str, revision: str) -> list[tuple[str, int]]:
    """(table, rows) of each table holding rows that downgrading to `revision` drops
    (rows counted up to 1,001)."""
    from alembic.util.exc import CommandError

    now = current(url)
    if now is None or not knows(now):
        return []  # nothing to drop, or a newer turnlog's schema: the downgrade says so
    try:
        # The steps `command.downgrade` runs from `now` (a relative target, -1 or
        # 0011+1, resolved as it resolves them: against the current revision).
        steps = ScriptDirectory.from_config(config(url))._downgrade_revs(revision, now)
    except CommandError:
        return []  # a target alembic cannot reach from here: the downgrade says so
    reverted = [step.revision.revision for step in steps]
    tables = [DATA_TABLES[r] for r in reverted if r in DATA_TABLES]

    def count(connection: Connection) -> list[tuple[str, int]]:
        from sqlalchemy import text

        counts: list[tuple[str, int]] = []
        # At most 1,001 rows counted: no count of a big log (a filtered one may scan).
        for name, rows_of in tables:
            rows = connection.execute(text(
                f"SELECT count(*) FROM (SELECT 1 FROM {rows_of} LIMIT 1001) AS first_rows"
            )).scalar()
            if rows:
                counts.append((name, int(rows)))
        return counts

    return on_connection(url, count) if tables else []


def why_not_turnlog(url: str) -> str | None:
    """`foreign_tables` of the database at `url`: why migrating it is refused, or None."""
    return on_connection(url, foreign_tables)


async def upgrade_async(url: str, revision: str = "head") -> None:
    """Upgrade from inside a running loop (env.py runs its own loop in a thread)."""
    await asyncio.to_thread(upgrade, url, revision)
