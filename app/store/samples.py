"""Serving samples of closed sessions: JSON from the fold, R3 tensors streamed.

Arrays are materialized on demand from the log: tokens, loss masks and
log-probs come from the folded state; an R3 tensor is streamed as `.npy`
one patch at a time, so serving it holds one patch in memory, never the
whole tensor twice. Shared ancestors' patches are read from their single
stored row by every leaf that needs them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from app.domain.assembly import R3Plan, check_patches, plan_shape, take
from app.domain.errors import SessionOpen
from app.domain.r3 import Patch, npy_header
from app.domain.samples import SamplesResult, build_samples
from app.store.db import Database
from app.store.loader import StateCache, load_patches, load_state, session_row


class SampleReader:
    def __init__(self, db: Database, cache: StateCache, capacity: int = 64) -> None:
        self.db = db
        self.cache = cache
        self.capacity = capacity
        # A closed session never changes, so its samples can be kept as built.
        self._closed: OrderedDict[str, SamplesResult] = OrderedDict()

    async def result(self, session_id: str) -> SamplesResult:
        kept = self._closed.get(session_id)
        if kept is not None:
            self._closed.move_to_end(session_id)
            return kept
        async with self.db.read() as conn:
            row = await session_row(conn, session_id)
            state = await load_state(conn, self.cache, row)
        if state.close is None:
            raise SessionOpen(f"session {session_id!r} is still open; close it first",
                              field="session_id", expected="a closed session", actual="open")
        result = build_samples(state, state.close)
        if self.capacity > 0:
            self._closed[session_id] = result
            while len(self._closed) > self.capacity:
                self._closed.popitem(last=False)
        return result

    async def samples(self, session_id: str, arrays: bool) -> dict[str, Any]:
        return (await self.result(session_id)).to_json(arrays)

    async def r3_plan(self, session_id: str, index: int) -> R3Plan:
        return (await self.result(session_id)).sample(index).read_plan()

    async def _patches(self, session_id: str, seqs: list[int]) -> dict[int, Patch]:
        async with self.db.read() as conn:
            return await load_patches(conn, session_id, seqs)

    async def read_patches(self, session_id: str, plan: R3Plan) -> dict[int, Patch]:
        """The plan's patches, narrowed as stored (a quarter of the tensor for uint8),
        checked before the response starts so a broken log answers 422, not a
        truncated 200."""
        patches = await self._patches(session_id, sorted({p.seq for p in plan.slices}))
        check_patches(plan, patches)
        return patches

    @staticmethod
    def content_length(plan: R3Plan) -> int:
        rows, layers, topk = plan_shape(plan)
        return len(npy_header(plan_shape(plan))) + rows * layers * topk * 4

    async def stream(
        self, plan: R3Plan, patches: dict[int, Patch]
    ) -> AsyncIterator[bytes | memoryview]:
        """Header, then one int32 block per slice: only one block is widened at a time."""
        yield npy_header(plan_shape(plan))
        for piece in plan.slices:
            # A memoryview hands the widened block to the transport without a copy.
            yield take(piece, patches[piece.seq], plan).data.cast("B")
