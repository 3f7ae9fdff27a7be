"""`app.settle`: what a serving process does before its first request (in a fresh
interpreter, where nothing has imported anyio's worker-thread path yet)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import asyncio, gc, sys, threading
before = "anyio._backends._asyncio" in sys.modules
from app.settle import settle

async def main():
    await settle()
    # Inside the loop: anyio stops its idle worker threads when the loop ends.
    print(before, "anyio._backends._asyncio" in sys.modules, threading.active_count() > 1,
          gc.get_freeze_count() > 0)

asyncio.run(main())
"""


def test_settle_imports_the_worker_thread_path_and_freezes_what_exists() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    # Not imported by importing the module; imported, a worker started, and frozen after.
    assert out == ["False", "True", "True", "True"]
