"""Example budgets of the fuzz tests (and of the slowest domain property tests,
tests/domain/test_event_codec.py and test_r3_slices.py): bounded and seeded in
CI, deeper by hand.

`TURNLOG_FUZZ_EXAMPLES=N` sets the examples of every test using this budget
(per operation for schemathesis) to N and draws fresh random seeds instead of
the fixed ones.
"""

import os

_OVERRIDE = os.environ.get("TURNLOG_FUZZ_EXAMPLES")
DERANDOMIZE = _OVERRIDE is None


def examples(default: int) -> int:
    return default if _OVERRIDE is None else int(_OVERRIDE)
