"""R3 for one sample: which rows of which stored patches make its tensor.

Owns the strict assembly rule of docs/api.md §2.4 step 6. Planning only looks at
patch geometry (`[start, end)` per kept turn), so the store can check a sample
at close time and later stream the tensor one patch at a time without ever
holding it whole; `assemble` applies a plan in memory for tests and small
reads. Refuses to own decoding payloads (`app/domain/wire/r3.py`), deciding which
turns a sample keeps (`app/domain/projection/samples.py`) and reading bytes (the store).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from app.domain.errors import R3Gap
from app.domain.wire.r3 import WIRE_DTYPE, Patch

# R3Gap is a 409 when an append would open a gap; reading a stored path that
# cannot yield its tensor is the client's unanswerable request: 422.
READ_GAP_STATUS = 422


class PatchSpan(Protocol):
    """What planning needs of a kept turn; `app.domain.log.tree.Node` is one."""

    @property
    def seq(self) -> int: ...

    @property
    def r3_span(self) -> tuple[int, int] | None: ...


@dataclass(frozen=True)
class TurnSpan:
    """A `PatchSpan` from plain values (the store's rows, tests)."""

    seq: int
    r3_span: tuple[int, int] | None


class PlanSlice(NamedTuple):
    """Rows `[row_from, row_to)` of node `seq`'s patch, counted from the patch's
    own first row (row 0 of the slice source is the patch's `start`)."""

    seq: int
    row_from: int
    row_to: int


@dataclass(frozen=True)
class R3Plan:
    num_layers: int
    topk: int
    slices: tuple[PlanSlice, ...]

    @property
    def rows(self) -> int:
        return sum(piece.row_to - piece.row_from for piece in self.slices)


def plan_shape(plan: R3Plan) -> tuple[int, int, int]:
    """The tensor's shape `[rows, num_layers, topk]` (the `.npy` header's)."""
    return plan.rows, plan.num_layers, plan.topk


def _gap(detail: str, index: int, seq: int, rows: tuple[int, int], expected: object,
         actual: object) -> R3Gap:
    return R3Gap(detail, field=f"path[{index}]", expected=expected, actual=actual,
                 status=READ_GAP_STATUS, extra={"seq": seq, "rows": list(rows)})


def _plan_full(kept: Sequence[PatchSpan], rows: int) -> tuple[PlanSlice, ...] | None:
    # Every full-mode turn re-routes its whole prefix, so the last kept turn
    # alone holds the sample's rows; earlier payloads are never read.
    index = len(kept) - 1
    last = kept[index]
    span = last.r3_span
    if span is None:
        return None
    start, end = span
    if start != 0:
        raise _gap(f"turn {last.seq} holds rows [{start}, {end}); a full-mode payload must "
                   f"start at row 0", index, last.seq, (0, rows), 0, start)
    if end < rows:
        raise _gap(f"turn {last.seq} holds {end} rows; the sample needs rows [0, {rows})",
                   index, last.seq, (end, rows), rows, end)
    return (PlanSlice(last.seq, 0, rows),) if rows else ()


def _plan_addition(kept: Sequence[PatchSpan], rows: int,
                   path: Sequence[PatchSpan]) -> tuple[PlanSlice, ...] | None:
    # Null only when no turn of the whole path carries R3: a path whose R3 sits
    # only in turns truncation or a stopped merge left out still owes its kept
    # turns' rows, so it is a gap (422), never a sample silently without replay data.
    if all(turn.r3_span is None for turn in path):
        return None
    covered = 0
    slices: list[PlanSlice] = []
    for index, turn in enumerate(kept):
        # Turns after coverage is reached are not read at all, so their R3
        # (or its absence) cannot spoil the tensor.
        if covered >= rows:
            break
        span = turn.r3_span
        if span is None:
            raise _gap(f"turn {turn.seq} carries no routed experts; rows [{covered}, {rows}) "
                       f"are missing", index, turn.seq, (covered, rows),
                       f"a patch starting at row {covered}", "no routed experts")
        start, end = span
        if start != covered:
            # Gaps and overlaps are both refused: replaying rows routed under
            # another prefix would be silently wrong, never merely redundant.
            raise _gap(f"turn {turn.seq}'s patch starts at row {start}; the rows before it "
                       f"end at {covered}", index, turn.seq, (covered, rows), covered, start)
        if end == start:
            continue
        take = min(end, rows) - start
        slices.append(PlanSlice(turn.seq, 0, take))
        covered = start + take
    if covered < rows:
        index = len(kept) - 1
        raise _gap(f"the path's patches cover rows [0, {covered}); the sample needs "
                   f"[0, {rows})", index, kept[index].seq, (covered, rows), rows, covered)
    return tuple(slices)


def plan_r3(
    kept: Sequence[PatchSpan], rows: int, *, addition: bool, num_layers: int, topk: int,
    path: Sequence[PatchSpan] | None = None,
) -> R3Plan | None:
    """Plan the R3 tensor of a sample made of `kept` turns (root first).

    `rows = len(sample tokens) - 1`; after truncation that is fewer rows than
    the kept turns hold, and the plan cuts to it. `path`: every turn of the
    sample's path, kept or not (default: `kept`); in addition mode the sample
    has R3 when any of them carries it. Returns None when the sample has no R3;
    raises `R3Gap` (422, naming the turn and rows) when the log cannot yield it.
    """
    if not kept:
        raise ValueError("a sample keeps at least one turn")
    if rows < 0:
        raise ValueError(f"rows must be non-negative, got {rows}")
    slices = (_plan_addition(kept, rows, kept if path is None else path) if addition
              else _plan_full(kept, rows))
    if slices is None:
        return None
    return R3Plan(num_layers=num_layers, topk=topk, slices=slices)


def check_slice(piece: PlanSlice, patch: Patch, plan: R3Plan) -> None:
    """The stored patch can yield this slice of the plan (else `R3Gap`, 422)."""
    if (patch.num_layers, patch.topk) != (plan.num_layers, plan.topk):
        raise R3Gap(f"turn {piece.seq}'s patch is [{patch.num_layers}, {patch.topk}] per row; "
                    f"the sample needs [{plan.num_layers}, {plan.topk}]",
                    field="routed_experts", expected=[plan.num_layers, plan.topk],
                    actual=[patch.num_layers, patch.topk], status=READ_GAP_STATUS,
                    extra={"seq": piece.seq})
    if not 0 <= piece.row_from < piece.row_to <= patch.rows:
        raise R3Gap(f"turn {piece.seq}'s patch has {patch.rows} rows; the plan reads "
                    f"[{piece.row_from}, {piece.row_to})", field="routed_experts",
                    expected=piece.row_to, actual=patch.rows, status=READ_GAP_STATUS,
                    extra={"seq": piece.seq})


def check_patches(plan: R3Plan, patches: Mapping[int, Patch]) -> None:
    """Every slice of the plan has a stored patch that can yield it (else `R3Gap`, 422)."""
    for piece in plan.slices:
        patch = patches.get(piece.seq)
        if patch is None:
            raise R3Gap(f"turn {piece.seq}'s patch is missing from the log",
                        field="routed_experts", expected="a stored patch", actual="none",
                        status=READ_GAP_STATUS, extra={"seq": piece.seq})
        check_slice(piece, patch, plan)


def take(piece: PlanSlice, patch: Patch, plan: R3Plan) -> np.ndarray:
    """One slice of a plan as int32 `[row_to - row_from, num_layers, topk]`.

    Cut while still narrow, then widen only the rows the sample needs.
    """
    check_slice(piece, patch, plan)
    return patch.rows_array(piece.row_from, piece.row_to)


def assemble(plan: R3Plan, patches: Mapping[int, Patch]) -> np.ndarray:
    """Apply a plan in memory: C-ordered little-endian int32 `[rows, L, topk]`."""
    check_patches(plan, patches)
    blocks = [take(piece, patches[piece.seq], plan) for piece in plan.slices]
    if not blocks:
        return np.empty((0, plan.num_layers, plan.topk), dtype=WIRE_DTYPE)
    return np.ascontiguousarray(np.concatenate(blocks, axis=0), dtype=WIRE_DTYPE)
