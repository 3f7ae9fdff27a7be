"""Serving samples of closed sessions: JSON from the fold, R3 tensors streamed.

Arrays are materialized on demand from the log: tokens, loss masks and
log-probs come from the folded state; an R3 tensor is streamed as `.npy`
one patch at a time, so serving it holds one patch in memory, never the
whole tensor twice. Shared ancestors' patches are read from their single
stored row by every leaf that needs them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import sqlalchemy as sa

from app.domain.assembly import R3Plan, plan_shape, take
from app.domain.errors import R3Gap, SessionOpen
from app.domain.r3 import Patch, npy_header
from app.domain.samples import SamplesResult, build_samples
from app.store.db import Database
from app.store.loader import StateCache, load_state, session_row
from app.store.schema import r3_patches


class SampleReader:
    def __init__(self, db: Database, cache: StateCache) -> None:
        self.db = db
        self.cache = cache

    async def result(self, session_id: str) -> SamplesResult:
        async with self.db.read() as conn:
            row = await session_row(conn, session_id)
            state = await load_state(conn, self.cache, row)
        if state.close is None:
            raise SessionOpen(f"session {session_id!r} is still open; close it first",
                              field="session_id", expected="a closed session", actual="open")
        return build_samples(state, state.close)

    async def samples(self, session_id: str, arrays: bool) -> dict[str, Any]:
        return (await self.result(session_id)).to_json(arrays)

    async def r3_plan(self, session_id: str, index: int) -> R3Plan:
        return (await self.result(session_id)).sample(index).read_plan()

    async def _patch(self, session_id: str, seq: int) -> Patch:
        async with self.db.read() as conn:
            row = (await conn.execute(
                sa.select(r3_patches).where(r3_patches.c.session_id == session_id)
                .where(r3_patches.c.seq == seq)
            )).first()
        if row is None:
            raise R3Gap(f"turn {seq}'s patch is missing from the log", field="routed_experts",
                        expected="a stored patch", actual="none", status=422,
                        extra={"seq": seq})
        return Patch(start=row.start_row, end=row.end_row, num_layers=row.num_layers,
                     topk=row.topk, dtype=row.dtype, data=row.data)

    async def first_patch(self, session_id: str, plan: R3Plan) -> Patch | None:
        """Read (and check) the first patch before the response starts, so a broken
        log answers 422 instead of a truncated 200."""
        if not plan.slices:
            return None
        patch = await self._patch(session_id, plan.slices[0].seq)
        take(plan.slices[0], patch, plan)
        return patch

    async def stream(
        self, session_id: str, plan: R3Plan, first: Patch | None
    ) -> AsyncIterator[bytes]:
        yield npy_header(plan_shape(plan))
        for i, piece in enumerate(plan.slices):
            patch = first if i == 0 and first is not None else await self._patch(
                session_id, piece.seq)
            yield take(piece, patch, plan).tobytes()
            del patch
