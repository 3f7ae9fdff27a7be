"""Liveness and readiness."""

from __future__ import annotations

import sqlalchemy as sa
from fastapi import APIRouter

from app.api.deps import ServicesDep
from app.api.problems import JSONText, problem_response
from app.store.migrate import current_revision, head_revision

router = APIRouter(tags=["service"])


@router.get("/healthz")
async def healthz() -> JSONText:
    return JSONText({"status": "ok"})


@router.get("/readyz")
async def readyz(svc: ServicesDep) -> JSONText:
    try:
        async with svc.db.read() as conn:
            await conn.execute(sa.text("SELECT 1"))
            current = await conn.run_sync(current_revision)
    except Exception as exc:  # any failure to reach the database means "not ready"
        return problem_response({"type": "urn:turnlog:not-ready", "title": "Not ready",
                                 "status": 503, "detail": f"database unreachable: {exc!r}"})
    head = head_revision()
    if current != head:
        return problem_response({"type": "urn:turnlog:not-ready", "title": "Not ready",
                                 "status": 503,
                                 "detail": f"schema at {current}, expected head {head}"})
    return JSONText({"status": "ready", "database": svc.db.dialect, "schema": current})
