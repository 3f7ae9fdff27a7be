"""R3 slices equal numpy slicing of the assembled tensor, for any bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.errors import InvalidRequest
from app.domain.projection.assembly import TurnSpan, assemble, plan_r3
from app.domain.projection.r3_slices import Bounds, parse_bounds, restrict, slice_blocks
from app.domain.wire.r3 import Patch, narrow
from tests.fuzz.budget import DERANDOMIZE, examples


@st.composite
def addition_paths(draw):
    """Patches of an addition-mode path, contiguous from row 0, and the sample rows."""
    layers = draw(st.integers(1, 5))
    topk = draw(st.integers(1, 3))
    high = draw(st.sampled_from([200, 60_000, 2**31 - 1]))
    lengths = draw(st.lists(st.integers(0, 7), min_size=1, max_size=5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spans, patches, start = [], {}, 0
    for seq, length in enumerate(lengths):
        values = rng.integers(0, high, size=(length, layers, topk), dtype=np.int64)
        dtype, data = narrow(values.astype(np.int32).ravel())
        patches[seq] = Patch(start, start + length, layers, topk, dtype, data)
        spans.append(TurnSpan(seq, (start, start + length)))
        start += length
    rows = draw(st.integers(0, start))
    return plan_r3(spans, rows, addition=True, num_layers=layers, topk=topk), patches


def bound_text(a, b):
    return f"{'' if a is None else a}:{'' if b is None else b}"


# Seeded (the same examples every run; TURNLOG_FUZZ_EXAMPLES=N explores afresh).
@settings(max_examples=examples(120), deadline=None, derandomize=DERANDOMIZE)
@given(addition_paths(), st.data())
def test_slices_equal_numpy_slicing_for_any_bounds(path, data):
    plan, patches = path
    full = assemble(plan, patches)
    opt = st.one_of(st.none(), st.integers(0, max(plan.rows, plan.num_layers) + 2))
    a, b, c, d = (data.draw(opt) for _ in range(4))
    try:
        rows = parse_bounds(bound_text(a, b), plan.rows, "rows")
        layers = parse_bounds(bound_text(c, d), plan.num_layers, "layers")
    except InvalidRequest:
        lo_r, hi_r = a or 0, plan.rows if b is None else b
        lo_l, hi_l = c or 0, plan.num_layers if d is None else d
        assert not (lo_r <= hi_r <= plan.rows and lo_l <= hi_l <= plan.num_layers)
        return
    expected = full[a:b, c:d, :]
    blocks = list(slice_blocks(restrict(plan, rows), patches, layers,
                               block_bytes=data.draw(st.integers(1, 200))))
    got = (np.concatenate(blocks) if blocks
           else np.empty((0, layers.size, plan.topk), np.int32))
    assert got.dtype == np.dtype("<i4") and got.flags.c_contiguous
    assert got.shape == expected.shape
    assert got.tobytes() == np.ascontiguousarray(expected).tobytes()


@pytest.mark.parametrize("text,expected", [(None, (0, 9)), ("", (0, 9)), (":", (0, 9)),
                                           ("2:", (2, 9)), (":4", (0, 4)), ("3:3", (3, 3)),
                                           ("0:9", (0, 9))])
def test_bounds_syntax(text, expected):
    assert parse_bounds(text, 9, "rows") == Bounds(*expected)


@pytest.mark.parametrize("text", ["5", "-1:", "4:2", "0:10", "a:b", "1:2:3", " 1:2", "1.0:2",
                                  "1:2\n", "١:٢"])
def test_bad_bounds_are_422(text):
    with pytest.raises(InvalidRequest) as exc:
        parse_bounds(text, 9, "rows")
    assert exc.value.field == "rows"
