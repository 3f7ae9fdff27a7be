"""State cache benchmark: cold load and memory of one 1,024-node session.

Run by hand (not in CI):

    .venv/bin/python -m bench.state_cache [--nodes 1024] [--new 24] [--out 8]

Builds, in a temporary SQLite file, one session of `--nodes` turns in a chain
whose context grows by `--new` prompt tokens and `--out` output tokens per
turn (1,024 turns of 32 → a final context of 32,768 tokens, 16.8 M token ids
over all turns, as an agentic rollout near the node cap has). Then, with an
empty cache, folds it from the log (`GET …/state`, a cold load) under
tracemalloc, and reports the seconds it took (wall and process CPU: on a
shared machine the CPU figure is the comparable one; tracemalloc slows both),
the memory the cached state keeps and the peak during the fold. Uses only
the store services, so the same script measures any version of the code
(`PYTHONPATH=<tree>`).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from app.services import build_services
from app.settings import Settings
from app.store.engine import migrate

MB = 1024 * 1024


def chain_turn(index: int, prompt: list[int], out: int) -> dict[str, Any]:
    output = [(index * 7919 + k) % 150_000 + 1 for k in range(out)]
    return {"event_id": f"t{index}", "record": {
        "request": {"input_ids": prompt},
        "response": {"choices": [{"finish_reason": "stop", "meta_info": {
            "output_token_logprobs": [[-0.25, t] for t in output],
            "completion_tokens": len(output)}}]}}}


async def build_session(url: str, session_id: str, nodes: int, new: int, out: int) -> int:
    """A chain of `nodes` turns, each prompt = the previous tokens + `new` fresh ids."""
    svc = build_services(Settings.load(database_url=url, migrate_on_start=False, api_tokens=""))
    await svc.writer.open_session({"session_id": session_id, "version": "v2"})
    tokens: list[int] = []
    total = 0
    for i in range(nodes):
        prompt = tokens + [(i * 31 + k) % 150_000 + 1 for k in range(new)]
        body = chain_turn(i, prompt, out)
        await svc.writer.append_turn(session_id, body)
        output = [t for _lp, t in body["record"]["response"]["choices"][0]["meta_info"]
                  ["output_token_logprobs"]]
        tokens = prompt + output
        total += len(tokens)
    await svc.db.dispose()
    return total


async def cold_load(url: str, session_id: str) -> dict[str, float]:
    svc = build_services(Settings.load(database_url=url, migrate_on_start=False, api_tokens=""))
    await svc.reader.summary(session_id)  # warm the connection, not the state
    svc.cache.clear()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    started, cpu = time.perf_counter(), time.process_time()
    state = await svc.reader.state(session_id, None)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    gc.collect()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    started = time.perf_counter()
    await svc.reader.state(session_id, None)
    warm = time.perf_counter() - started
    assert state["num_nodes"] > 0
    await svc.db.dispose()
    return {"cold_s": seconds, "cold_cpu_s": cpu, "warm_s": warm, "kept_mb": (kept - base) / MB,
            "peak_mb": (peak - base) / MB}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--out", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        await migrate.upgrade_async(url)
        started = time.perf_counter()
        total = await build_session(url, "bench-chain", args.nodes, args.new, args.out)
        print(f"built {args.nodes} nodes ({total / 1e6:.1f} M token ids over all turns) "
              f"in {time.perf_counter() - started:.1f} s")
        result = await cold_load(url, "bench-chain")
    print(f"cold load {result['cold_s']:.3f} s ({result['cold_cpu_s']:.3f} s CPU), "
          f"warm {result['warm_s'] * 1000:.1f} ms; "
          f"cached state keeps {result['kept_mb']:.1f} MB, peak during fold "
          f"{result['peak_mb']:.1f} MB")


if __name__ == "__main__":
    asyncio.run(main())
