"""Liveness and readiness.

`/readyz` answers 503 problem+json when the database cannot be reached (or does
not answer within `READY_TIMEOUT_S`), its
schema is not at head, or (SQLite) the file failed its integrity check, was
removed or replaced under the running server, or its disk is full (`DiskWatch`); the
problem names the reason but never carries the driver's error text, which
may hold host names, paths or credentials (that text goes to the log).
"""

from __future__ import annotations

import asyncio

import sqlalchemy as sa
import structlog
from fastapi import APIRouter

from app.api.deps import ServicesDep
from app.api.problems import JSONText, damaged_sqlite, problem_response
from app.store.engine.disk import ROOM_AFTER_FULL
from app.store.engine.revision import current_revision, head_revision
from app.store.engine.sqlite_files import DatabaseFileReplaced

router = APIRouter(tags=["service"], default_response_class=JSONText)
# How long `/readyz` waits for the database's answer before it says "not ready".
READY_TIMEOUT_S = 5.0
log = structlog.get_logger("turnlog.api")


def not_ready(detail: str, reason: str) -> JSONText:
    return problem_response({"type": "urn:turnlog:not-ready", "title": "Not ready",
                             "status": 503, "detail": detail, "reason": reason},
                            headers={"Retry-After": "5"})


@router.get("/healthz")
async def healthz() -> JSONText:
    return JSONText({"status": "ok"})


@router.get("/readyz")
async def readyz(svc: ServicesDep) -> JSONText:
    room: int | None = None
    try:
        # The integrity check first: damage can also break the reads below.
        damage = await svc.integrity.problems()
        if not damage:
            # Bounded: a database that stops answering without closing its connections
            # (a frozen host, a partition without resets) would hold the probe as long
            # as the driver's command timeout, and the balancer would keep routing here.
            async with asyncio.timeout(READY_TIMEOUT_S):
                await svc.db.files_intact()
                async with svc.db.read() as conn:
                    await conn.execute(sa.text("SELECT 1"))
                    current = await conn.run_sync(current_revision)
                room = await svc.db.disk_room()
    except TimeoutError:
        log.warning("not ready: the database did not answer", timeout_s=READY_TIMEOUT_S)
        return not_ready(f"the database did not answer within {READY_TIMEOUT_S:g} s",
                         "database-unreachable")
    except DatabaseFileReplaced:
        # The path names other files than this server writes: its writes would be lost.
        log.error("not ready: the SQLite file or its -wal was removed or replaced under "
                  "this server; restart it")
        return not_ready("the SQLite file or its -wal file was removed or replaced while "
                         "this server had it open: restart the server", "database-replaced")
    except Exception as exc:  # any failure to reach the database means "not ready"
        if damaged_sqlite(exc):
            damage = [str(exc)[:200]]
        else:
            log.warning("not ready: database unreachable", error=type(exc).__name__,
                        detail=str(exc)[:500])
            return not_ready("the database cannot be reached; see the server log",
                             "database-unreachable")
    if damage:
        return not_ready(f"the SQLite file failed its integrity check ({len(damage)} "
                         "problem(s); see the server log): restore it from a backup",
                         "database-damaged")
    if room is not None:
        return not_ready(
            f"the database's disk is full ({room / 2**20:.1f} MiB of room): writes answer 503 "
            "and store nothing; free space on it (R3 retention needs a few MB itself, see "
            f"docs/operations.md); ready again at {ROOM_AFTER_FULL // 2**20} MiB of room or "
            "once a write commits", "disk-full")
    head = head_revision()
    if current != head:
        return not_ready(f"schema at {current}, expected head {head}", "schema-not-at-head")
    return JSONText({"status": "ready", "database": svc.db.dialect, "schema": current})
