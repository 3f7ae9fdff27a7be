"""SQLite integrity at start: `PRAGMA quick_check`, once per process.

A SQLite file with damaged pages still opens and answers some reads; without
a check the server reports ready while reads fail. `quick_check` reads every
page (O(file size), seconds per GiB), so it can be turned off for very large
files (`TURNLOG_INTEGRITY_CHECK=false`). PostgreSQL checks its own pages
(checksums, WAL): nothing to do there. The result is cached; `/readyz` reports it.
"""

from __future__ import annotations

import asyncio

import structlog

from app.store.engine.db import Database
from app.store.engine.dialect import file_integrity_checkable

log = structlog.get_logger("turnlog.store")
MAX_REPORTED = 20


class IntegrityCheck:
    def __init__(self, db: Database, enabled: bool) -> None:
        self.db = db
        self.enabled = enabled and file_integrity_checkable(db.url)
        self._result: list[str] | None = None
        self._lock = asyncio.Lock()

    async def problems(self) -> list[str]:
        """What `quick_check` found (empty: the file is sound, or no check applies)."""
        if not self.enabled:
            return []
        async with self._lock:
            if self._result is None:
                self._result = await self._run()
                if self._result:
                    log.error("SQLite integrity check failed", url=self.db.url,
                              problems=self._result[:MAX_REPORTED])
        return self._result

    async def _run(self) -> list[str]:
        import sqlite3

        try:
            async with self.db.read() as conn:
                rows = (await conn.exec_driver_sql(
                    f"PRAGMA quick_check({MAX_REPORTED})")).scalars().all()
        except Exception as exc:
            # A file that is not a database at all fails before it can be checked.
            # (OperationalError, e.g. "locked", is not damage: raised, retried next time.)
            orig = getattr(exc, "orig", exc)
            if isinstance(orig, sqlite3.DatabaseError) and not isinstance(
                    orig, sqlite3.OperationalError):
                return [str(orig)]
            raise
        return [] if list(rows) == ["ok"] else [str(r) for r in rows]
