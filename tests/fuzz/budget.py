"""Example budgets of the fuzz tests: bounded and seeded for CI, deeper by hand.

`TURNLOG_FUZZ_EXAMPLES=500 make test PYTEST_ARGS=tests/fuzz` multiplies nothing: it sets
the examples per HTTP test (and per schemathesis operation) and draws random seeds.
"""

import os

_OVERRIDE = os.environ.get("TURNLOG_FUZZ_EXAMPLES")
DERANDOMIZE = _OVERRIDE is None


def examples(default: int) -> int:
    return default if _OVERRIDE is None else int(_OVERRIDE)
