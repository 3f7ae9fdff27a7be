"""The schema revision a database is at, and the newest this turnlog ships, without alembic.

Every command that reads or writes a database first checks that its schema is
this turnlog's newest (`app.cli.common.check_database`), and `/readyz` asks on
every probe. Importing alembic's migration runtime for that costs ~0.2 s of CPU
per command (it imports its DDL layer, Mako and Pygments), and reading the
migration scripts through alembic executes every one of them; both answers are
one row and a few lines of text. So: the version table is read with one query
(alembic writes it; a linear history keeps one row), and the newest revision is
the one no script names as its `down_revision`, read from the scripts' text.
Whatever this reading cannot settle (scripts that are not one chain, a version
table with several rows) is alembic's to answer, as before. Alembic stays the
only author of the schema and of the version table (`app.store.engine.migrate`);
`tests/store/test_migrations.py` checks both answers against alembic's own.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from app.store.engine.dialect import normalize_url

T = TypeVar("T")

VERSIONS = Path(__file__).resolve().parents[1] / "migrations" / "versions"
# alembic's default version table, in the connection's default schema.
VERSION_TABLE = "alembic_version"
# A script's identifiers, as `script.py.mako` writes them (`revision: str = "0011"`).
_REVISION = re.compile(r'^revision(?:\s*:\s*str)?\s*=\s*["\']([^"\']+)["\']', re.M)
_DOWN = re.compile(r'^down_revision(?:\s*:[^=]+)?\s*=\s*(None|["\']([^"\']+)["\'])', re.M)


@functools.lru_cache(maxsize=1)
def head_revision() -> str | None:
    """The newest migration this turnlog ships. Read once: `/readyz` asks on every
    probe."""
    read = scripts_head()
    if read is not None:
        return read
    from app.store.engine.migrate import alembic_head

    return alembic_head()


def scripts_head(versions: Path = VERSIONS) -> str | None:
    """The one revision no script in `versions` names as its `down_revision`, read from
    the scripts' text; None when they are not one chain this reading can follow."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for script in versions.glob("*.py"):
        text = script.read_text(encoding="utf-8")
        revision, down = _REVISION.search(text), _DOWN.search(text)
        if revision is None or down is None or revision.group(1) in revisions:
            return None
        revisions.add(revision.group(1))
        if down.group(2) is not None:
            parents.add(down.group(2))
    heads = revisions - parents
    if len(heads) != 1 or not parents <= revisions:
        return None
    return heads.pop()


def current_revision(connection: Connection) -> str | None:
    """The revision the database's schema is at; None when it has no version table (or
    an empty one): not migrated by turnlog."""
    if connection.dialect.name == "sqlite":
        exists = connection.execute(sa.text(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :name"),
            {"name": VERSION_TABLE}).first() is not None
    else:
        exists = connection.execute(sa.text("SELECT to_regclass(:name) IS NOT NULL"),
                                    {"name": VERSION_TABLE}).scalar_one()
    if not exists:
        return None
    rows = connection.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).all()
    if len(rows) > 1:  # several heads: alembic refuses them in its own words
        from alembic.runtime.migration import MigrationContext

        return MigrationContext.configure(connection).get_current_revision()
    return str(rows[0][0]) if rows else None


def on_connection(url: str, work: Callable[[Connection], T]) -> T:
    """`work` run on one connection of a short-lived engine on `url` (from a command,
    outside any event loop)."""
    result: list[T] = []

    async def _run() -> None:
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(normalize_url(url))
        try:
            async with engine.connect() as conn:
                result.append(await conn.run_sync(work))
        finally:
            await engine.dispose()

    asyncio.run(_run())
    return result[0]


def current(url: str) -> str | None:
    """`current_revision` of the database at `url`."""
    return on_connection(url, current_revision)
