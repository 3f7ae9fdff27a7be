"""R3 slices: the sub-tensor `[a:b, c:d, :]` of a sample's R3, by rows and layers.

Owns the bounds syntax (`a:b`, `:b`, `a:`, `:`, blank = not given; Python
slice semantics without negatives or steps, `0 <= a <= b <= size`),
restricting a sample's plan to a row range (so only the patches, and rows of
them, that the range touches are read) and producing the slice one widened
block at a time, widening only the rows and layers asked for. Refuses to own
the sample's plan (`app/domain/projection/assembly.py`) and reading bytes (the store).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np

from app.domain.errors import InvalidRequest
from app.domain.projection.assembly import PlanSlice, R3Plan, check_slice
from app.domain.wire.r3 import DTYPES, WIRE_DTYPE, Patch

BOUNDS_RE = re.compile(r"([0-9]*):([0-9]*)")
BLOCK_BYTES = 4 << 20


class Bounds(NamedTuple):
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def parse_bounds(text: str | None, size: int, field: str) -> Bounds:
    """`a:b` within `[0, size]`; None or "" means the whole axis."""
    if text is None or text == "":
        return Bounds(0, size)
    match = BOUNDS_RE.fullmatch(text)
    start = stop = None
    if match is not None and len(text) <= 40:
        start = int(match.group(1)) if match.group(1) else 0
        stop = int(match.group(2)) if match.group(2) else size
    if start is None or stop is None or not 0 <= start <= stop <= size:
        raise InvalidRequest(f"{field} must be a:b with 0 <= a <= b <= {size} (either may be "
                             "left out)", field=field, expected=f"a:b within [0, {size}]",
                             actual=text[:80])
    return Bounds(start, stop)


def restrict(plan: R3Plan, rows: Bounds) -> R3Plan:
    """The plan of rows `[rows.start, rows.stop)` of the sample's tensor."""
    slices: list[PlanSlice] = []
    at = 0  # the sample row where the current slice begins
    for piece in plan.slices:
        length = piece.row_to - piece.row_from
        lo, hi = max(rows.start, at), min(rows.stop, at + length)
        if lo < hi:
            slices.append(PlanSlice(piece.seq, piece.row_from + lo - at,
                                    piece.row_from + hi - at))
        at += length
    return R3Plan(num_layers=plan.num_layers, topk=plan.topk, slices=tuple(slices))


def slice_shape(plan: R3Plan, layers: Bounds) -> tuple[int, int, int]:
    return plan.rows, layers.size, plan.topk


def slice_blocks(plan: R3Plan, patches: Mapping[int, Patch], layers: Bounds,
                 block_bytes: int = BLOCK_BYTES) -> Iterator[np.ndarray]:
    """The restricted plan's rows, layers `[layers.start, layers.stop)`, as C-ordered
    int32 blocks; each block widens at most about `block_bytes` of output."""
    per_row_out = max(1, layers.size * plan.topk * WIRE_DTYPE.itemsize)
    step = max(1, block_bytes // per_row_out)
    for piece in plan.slices:
        patch = patches[piece.seq]
        check_slice(piece, patch, plan)
        narrow = np.frombuffer(patch.data, dtype=DTYPES[patch.dtype]).reshape(
            patch.rows, patch.num_layers, patch.topk)
        for row in range(piece.row_from, piece.row_to, step):
            block = narrow[row:min(row + step, piece.row_to), layers.start:layers.stop, :]
            yield np.ascontiguousarray(block, dtype=WIRE_DTYPE)
