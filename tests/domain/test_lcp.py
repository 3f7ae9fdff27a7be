"""`lcp` against a plain loop, on arrays built to meet its fast path and miss it."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from app.domain.log.tree import lcp


def plain_lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = 0
    for x, y in zip(a.tolist(), b.tolist(), strict=False):
        if x != y:
            break
        n += 1
    return n


tokens = st.lists(st.integers(0, 3), max_size=40)
dtypes = st.sampled_from([np.int32, np.int64, np.uint32, np.float64])


@given(tokens, tokens, dtypes, dtypes, st.integers(0, 3))
def test_lcp_is_the_plain_loop(a: list[int], b: list[int], da: type, db: type,
                               step: int) -> None:
    # Shared prefixes are likely (small alphabet, b often extends a); strided views
    # and mixed dtypes take the comparison path, equal dtypes the bytes one.
    if step:
        b = a + b
    x = np.asarray(a, da)
    y = np.asarray(b, db)[:: max(step, 1)] if step > 1 else np.asarray(b, db)
    assert lcp(x, y) == plain_lcp(x, y) == lcp(y, x)


def test_equal_values_of_different_widths_match_in_full() -> None:
    a = np.arange(1000, dtype=np.int32)
    assert lcp(a, a.astype(np.int64)) == 1000
    b = a.astype(np.int64)
    b[999] = -1
    assert lcp(a, b) == 999
    assert lcp(a, a[:0]) == 0


def test_a_tail_that_differs_at_once_and_one_that_differs_late() -> None:
    # A sibling's tail (a retry's own tokens) meets the prompt's at its first token;
    # a long shared prefix ends at its last.
    prompt = np.arange(4000, dtype=np.int64)
    assert lcp(np.array([7], np.int64), prompt) == 0
    late = prompt.copy()
    late[3000] = -1
    assert lcp(late, prompt) == 3000 == lcp(prompt, late)
