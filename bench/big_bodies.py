"""Big bodies vs everyone else: does a large turn or reply stall small requests?

Run by hand (not in CI):

    .venv/bin/python -m bench.big_bodies [--turn-mb 100] [--nodes 1024]

Against a real `turnlog serve` (one worker, SQLite in a temporary directory):
1. the latency of `GET /healthz`, polled every 10 ms, with nothing else going on;
2. the same while `GET …/events?limit=100000` reads a `--nodes`-node session
   of growing contexts (bench.state_cache's chain, written before the server
   starts), and how much the server's peak RSS grows (VmHWM) during it;
3. the same while one ~`--turn-mb` MB turn (R3 for 48 layers × top-8, base64)
   is appended.
Figures are max and p99 of the probe latency; run it on a quiet machine, or
compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from app.store.engine import migrate
from bench.common import start_server, stop_server
from bench.state_cache import build_session

LAYERS, TOPK = 48, 8


def big_turn(mb: int) -> bytes:
    rows = mb * 1024 * 1024 * 3 // 4 // (LAYERS * TOPK * 4)
    tokens = rows + 1
    prompt = [int(t) for t in np.arange(tokens - 16) % 150_000 + 1]
    output = list(range(1, 17))
    r3 = np.random.default_rng(0).integers(0, 128, (rows, LAYERS, TOPK), dtype=np.int32)
    body = {"event_id": "big", "record": {
        "request": {"input_ids": prompt, "return_routed_experts": True},
        "response": {"choices": [{"finish_reason": "stop", "meta_info": {
            "output_token_logprobs": [[-0.5, t] for t in output],
            "completion_tokens": len(output),
            "routed_experts": base64.b64encode(r3.astype("<i4").tobytes()).decode()}}]}}}
    return json.dumps(body).encode()


async def probe(http: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    out: list[float] = []
    while not stop.is_set():
        started = time.perf_counter()
        r = await http.get("/healthz")
        out.append(time.perf_counter() - started)
        assert r.status_code == 200
        await asyncio.sleep(0.01)
    return out


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (f"n={len(samples)} median {statistics.median(samples) * 1000:.1f} ms, "
            f"p99 {p99 * 1000:.1f} ms, max {max(samples) * 1000:.1f} ms")


async def while_running(base: str, work: Any) -> tuple[list[float], Any]:
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        prober = asyncio.create_task(probe(http, stop))
        await asyncio.sleep(0.2)
        result = await work
        await asyncio.sleep(0.1)
        stop.set()
        return await prober, result


def vm(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) // 1024
    return 0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turn-mb", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        await migrate.upgrade_async(url)
        await build_session(url, "chain", args.nodes, 24, 8)
        body = big_turn(args.turn_mb)
        proc, base = await start_server(url)
        try:
            async with httpx.AsyncClient(base_url=base, timeout=600) as http:
                await http.post("/v1/sessions", json={
                    "session_id": "big", "version": "v2", "pause_generation_mode": "retract",
                    "r3": {"num_layers": LAYERS}})
                idle, _ = await while_running(base, asyncio.sleep(2))
                print(f"idle:           {summary(idle)}")

                rss = vm(proc.pid, "VmRSS")

                async def events() -> tuple[float, int]:
                    started = time.perf_counter()
                    r = await http.get("/v1/sessions/chain/events?limit=100000")
                    assert r.status_code == 200
                    return time.perf_counter() - started, len(r.content)

                during, (took, size) = await while_running(base, events())
                grew = vm(proc.pid, "VmHWM") - rss
                print(f"events?limit=100000 ({size / 2**20:.0f} MB in {took:.2f} s, "
                      f"peak RSS +{grew} MB): {summary(during)}")
                async def append() -> float:
                    started = time.perf_counter()
                    r = await http.post("/v1/sessions/big/turns", content=body,
                                        headers={"content-type": "application/json"})
                    assert r.status_code == 201, r.text[:300]
                    return time.perf_counter() - started

                during, took = await while_running(base, append())
                print(f"{len(body) / 2**20:.0f} MB append ({took:.2f} s): {summary(during)}")

        finally:
            stop_server(proc)


if __name__ == "__main__":
    asyncio.run(main())
