"""Serving samples of closed sessions: JSON from the fold, R3 tensors streamed.

The samples of a closed session are built once and kept; only their rewards
change (rewards recorded after the close), which the session row's
`num_rewards` tells, so every read asks the row and re-applies the rewards
when it counts more than the kept samples show.

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

import sqlalchemy as sa

from app.domain.errors import R3Gap, R3Pruned, SessionOpen
from app.domain.projection.assembly import (
    PlanSlice,
    R3Plan,
    check_patches,
    check_slice,
    plan_shape,
    take,
)
from app.domain.projection.r3_slices import (
    Bounds,
    parse_bounds,
    restrict,
    slice_blocks,
    slice_shape,
)
from app.domain.projection.samples import SamplesResult, build_samples, with_rewards
from app.domain.projection.samples_wire import WireLayout, wire_layout
from app.domain.wire.r3 import DTYPES, Patch, npy_header
from app.store.engine.db import Database
from app.store.engine.schema import r3_patches
from app.store.fold.loader import StateCache, load_patches, load_state, session_row

# Rows are widened to int32 in blocks of about this size, so a reply never
# holds a second copy of a large tensor.
WIRE_BLOCK_BYTES = 4 << 20


class SampleReader:
    def __init__(self, db: Database, cache: StateCache, capacity: int = 64) -> None:
        self.db = db
        self.cache = cache
        self.capacity = capacity
        # A closed session's samples never change but for their rewards, so they are
        # kept as built, with the number of recorded rewards they show.
        self._closed: OrderedDict[str, tuple[int, SamplesResult]] = OrderedDict()

    @staticmethod
    def _gone(session_id: str) -> R3Pruned:
        return R3Pruned(f"the R3 of session {session_id!r} was freed by retention",
                        field="r3", expected="stored R3", actual="pruned")

    async def result(self, session_id: str) -> SamplesResult:
        return (await self._read(session_id))[0]

    async def _read(self, session_id: str) -> tuple[SamplesResult, bool]:
        """The samples as they stand (rebuilt only when first read, their rewards
        brought up to date whenever the session row counts more rewards) and
        whether retention freed the session's R3, from one read of the row."""
        async with self.db.read() as conn:
            row = await session_row(conn, session_id)
            pruned = row["r3_pruned_bytes"] is not None
            kept = self._closed.get(session_id)
            if kept is not None and kept[0] == row["num_rewards"]:
                self._closed.move_to_end(session_id)
                return kept[1], pruned
            state = await load_state(conn, self.cache, row)
        if state.close is None:
            raise SessionOpen(f"session {session_id!r} is still open; close it first",
                              field="session_id", expected="a closed session", actual="open")
        if kept is not None:
            result = with_rewards(kept[1], state, state.close)
        else:
            result = build_samples(state, state.close)
        if self.capacity > 0:
            self._closed[session_id] = (len(state.rewards), result)
            self._closed.move_to_end(session_id)
            while len(self._closed) > self.capacity:
                self._closed.popitem(last=False)
        return result, pruned

    async def samples(self, session_id: str, arrays: bool) -> dict[str, Any]:
        result, pruned = await self._read(session_id)
        return result.to_json(arrays, pruned)

    async def r3_plan(self, session_id: str, index: int) -> R3Plan:
        result, pruned = await self._read(session_id)
        sample = result.sample(index)
        if sample.r3 is not None and pruned:
            raise self._gone(session_id)
        return sample.read_plan()

    async def _patches(self, session_id: str, seqs: list[int]) -> dict[int, Patch]:
        async with self.db.read() as conn:
            return await load_patches(conn, session_id, seqs)

    async def read_patches(self, session_id: str, *plans: R3Plan) -> dict[int, Patch]:
        """The plans' patches, narrowed as stored (a quarter of the tensor for uint8),
        checked before the response starts so a broken log answers 422, not a
        truncated 200. A patch shared by several plans is read once."""
        patches = await self._patches(
            session_id, sorted({p.seq for plan in plans for p in plan.slices}))
        for plan in plans:
            for piece in plan.slices:
                patch = patches.get(piece.seq)
                if patch is not None and not patch.data and piece.row_to > piece.row_from:
                    raise self._gone(session_id)  # freed after the sample was planned
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

    async def wire(self, session_id: str) -> tuple[WireLayout, dict[int, Patch]]:
        """The samples as a safetensors file: its layout and every patch its R3
        tensors read, checked before the reply starts (a gap is a 422, never a
        truncated 200)."""
        result, pruned = await self._read(session_id)
        if any(s.r3 is not None for s in result.samples) and pruned:
            raise self._gone(session_id)
        layout = wire_layout(result)
        patches = await self.read_patches(session_id, *layout.plans.values())
        return layout, patches

    @staticmethod
    async def stream_wire(
        layout: WireLayout, patches: dict[int, Patch]
    ) -> AsyncIterator[bytes | memoryview]:
        """Header, the small tensors as laid out, and each R3 tensor one widened
        block of at most `WIRE_BLOCK_BYTES` at a time."""
        yield layout.header
        for tensor in layout.tensors:
            if tensor.data is not None:
                yield tensor.data
                continue
            assert tensor.r3_index is not None
            plan = layout.plans[tensor.r3_index]
            for piece in plan.slices:
                patch = patches[piece.seq]
                step = max(1, WIRE_BLOCK_BYTES // (4 * plan.num_layers * max(plan.topk, 1)))
                for row in range(piece.row_from, piece.row_to, step):
                    block = patch.rows_array(row, min(row + step, piece.row_to))
                    yield block.data.cast("B")

    async def r3_slice(self, session_id: str, index: int, rows: str | None,
                       layers: str | None) -> tuple[R3Plan, Bounds, dict[int, Patch]]:
        """Rows `a:b` and layers `c:d` of a sample's R3: the no-R3 and gap answers
        first, then the bounds; only the stored rows the range touches are read."""
        plan = await self.r3_plan(session_id, index)
        row_bounds = parse_bounds(rows, plan.rows, "rows")
        layer_bounds = parse_bounds(layers, plan.num_layers, "layers")
        restricted = restrict(plan, row_bounds)
        patches = await self._patch_rows(session_id, restricted)
        rebased = R3Plan(plan.num_layers, plan.topk, tuple(
            PlanSlice(p.seq, 0, p.row_to - p.row_from) for p in restricted.slices))
        return rebased, layer_bounds, patches

    async def _patch_rows(self, session_id: str, plan: R3Plan) -> dict[int, Patch]:
        """For each slice, only its rows of the stored patch (a byte range of the blob),
        as a patch of its own; each slice of a restricted plan reads a distinct patch."""
        seqs = [p.seq for p in plan.slices]
        if not seqs:
            return {}
        rp = r3_patches.c
        async with self.db.read() as conn:
            shapes = {row.seq: row for row in await conn.execute(
                sa.select(rp.seq, rp.start_row, rp.end_row, rp.num_layers, rp.topk, rp.dtype)
                .where(rp.session_id == session_id, rp.seq.in_(seqs)))}
            out: dict[int, Patch] = {}
            for piece in plan.slices:
                shape = shapes.get(piece.seq)
                if shape is None:
                    raise R3Gap(f"turn {piece.seq}'s patch is missing from the log",
                                field="routed_experts", expected="a stored patch",
                                actual="none", status=422, extra={"seq": piece.seq})
                stored = Patch(start=shape.start_row, end=shape.end_row,
                               num_layers=shape.num_layers, topk=shape.topk,
                               dtype=shape.dtype, data=b"")
                if (stored.num_layers, stored.topk) != (plan.num_layers, plan.topk) or \
                        not 0 <= piece.row_from < piece.row_to <= stored.rows:
                    # The full patch is needed for the exact 422 answer.
                    full = await self._patches(session_id, [piece.seq])
                    check_slice(piece, full[piece.seq], plan)
                row_bytes = shape.num_layers * shape.topk * DTYPES[shape.dtype].itemsize
                data = (await conn.execute(
                    sa.select(sa.func.substr(rp.data, piece.row_from * row_bytes + 1,
                                             (piece.row_to - piece.row_from) * row_bytes,
                                             type_=sa.LargeBinary))
                    .where(rp.session_id == session_id, rp.seq == piece.seq))).scalar_one()
                if len(data) != (piece.row_to - piece.row_from) * row_bytes:
                    raise self._gone(session_id)  # freed after the sample was planned
                out[piece.seq] = Patch(start=shape.start_row + piece.row_from,
                                       end=shape.start_row + piece.row_to,
                                       num_layers=shape.num_layers, topk=shape.topk,
                                       dtype=shape.dtype, data=bytes(data))
        return out

    @staticmethod
    def slice_length(plan: R3Plan, layers: Bounds) -> int:
        rows, width, topk = slice_shape(plan, layers)
        return len(npy_header((rows, width, topk))) + rows * width * topk * 4

    @staticmethod
    async def stream_slice(plan: R3Plan, layers: Bounds, patches: dict[int, Patch]
                           ) -> AsyncIterator[bytes | memoryview]:
        yield npy_header(slice_shape(plan, layers))
        for block in slice_blocks(plan, patches, layers):
            if block.size:  # `layers=c:c` has rows of no bytes: a zero-size view cannot cast
                yield block.data.cast("B")
