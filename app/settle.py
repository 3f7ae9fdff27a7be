"""The last step of a serving process's start (`turnlog serve` workers, `turnlog gateway`).

Two costs that would otherwise land on the first turns a process serves:
- anyio imports its worker-thread machinery on the first `to_thread` call, and a
  large turn is the first to make one: modules imported and classes built, ~50 ms
  of the event loop's time in a fresh process (measured on the development
  machine), all of it in that turn's latency. One empty call here imports them
  and starts the first worker thread.
- Everything imported and built by then lives as long as the process: frozen out
  of the collector's sight, a full collection (triggered by the containers a
  2k-token turn decodes into) costs ~0.1 ms on the event loop instead of 20-50
  (docs/ingest.md).

Refuses: anything about requests; it runs once, before the first.
"""

from __future__ import annotations

import gc

import anyio.to_thread


def _nothing() -> None:
    return None


async def settle() -> None:
    """Import the worker-thread path and start a worker; then freeze what exists."""
    await anyio.to_thread.run_sync(_nothing)
    gc.collect()
    gc.freeze()
