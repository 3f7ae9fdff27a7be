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
# alembic's default version table: the one the connection sees (its search path).
VERSION_TABLE = "alembic_version"
# A script's identifiers, as `script.py.mako` writes them (`revision: str = "0011"`),
# each alone on its line but for a comment. Any other form is not read (`scripts_head`).
_REVISION = re.compile(
    r'^revision(?:\s*:\s*str)?\s*=\s*["\']([\w.-]+)["\']\s*(?:#.*)?$', re.M)
_DOWN = re.compile(
    r'^down_revision(?:\s*:[^=\n]+)?\s*=\s*(None|["\']([\w.-]+)["\'])\s*(?:#.*)?$', re.M)
# Any assignment to either name, read or not: one of each is all a script may hold.
_ASSIGNED = re.compile(r'^(down_)?revision\b[^=\n]*=', re.M)


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
    """The revision at the head of the one chain the scripts in `versions` form, read
    from their text; None when that reading is not sure of it (alembic answers then):
    a script it cannot read, an id it cannot read plainly (given twice, a merge's
    tuple, an expression), or scripts that are not one chain from a root to a head.
    Skips the files alembic skips (editors' `.#` lock files, `__init__`)."""
    down_of: dict[str, str | None] = {}
    for script in versions.glob("*.py"):
        if script.name.startswith((".#", "__init__")):
            continue
        try:
            text = script.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        revision, down = _REVISION.findall(text), _DOWN.findall(text)
        if len(revision) != 1 or len(down) != 1 or revision[0] in down_of \
                or len(_ASSIGNED.findall(text)) != 2:
            return None
        down_of[revision[0]] = down[0][1] if down[0][0] != "None" else None
    heads = set(down_of) - set(down_of.values())
    if len(heads) != 1:
        return None
    # From the head down to a root, every script once: one chain, no cycle, no stray.
    head = heads.pop()
    node: str | None = head
    seen: set[str] = set()
    while node is not None and node not in seen and node in down_of:
        seen.add(node)
        node = down_of[node]
    return head if node is None and seen == set(down_of) else None


def current_revision(connection: Connection) -> str | None:
    """The revision the database's schema is at; None when it has no version table (or
    an empty one): not migrated by turnlog."""
    # The table looked up as alembic looks it up (SQLAlchemy's inspector: on SQLite the
    # main and temp schemas, on PostgreSQL the tables and views the search path shows).
    if not sa.inspect(connection).has_table(VERSION_TABLE):
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
