"""Samples-wire benchmark: a session's samples as safetensors over HTTP vs np.concatenate.

Run by hand (not in CI):

    .venv/bin/python -m bench.wire [--postgres-url URL | --sqlite] [--repeat 10]

The 10-turn addition-mode session of `bench.samples` (~32k final tokens,
48 layers, top-8: ~50 MB of int32 R3) is appended to a `turnlog serve`
subprocess and closed. Then, in the same run:
- HTTP: `GET /v1/sessions/{sid}/samples?format=safetensors`, read fully and
  decoded with `safetensors.numpy.load` (what a miles rollout driver does);
- memory: `np.concatenate` of the same patches (already decoded int32 arrays).
It prints the median times, their ratio (target: within 3x) and the server's
peak resident memory growth while serving, relative to the reply size
(target: at most 2.5x). The decoded R3 is checked against the concatenation,
and the reply against `safetensors.numpy.save` of the decoded tensors.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import time
import uuid

import httpx
import numpy as np
from safetensors.numpy import load, save

from bench.common import postgres, start_server, stop_server
from bench.ingest import LAYERS, TOPK, make_session
from bench.samples import plan_patches, reset_peak, rss_kib, store_closed
from tests.pg import create_database


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres-url", help="admin URL of a PostgreSQL server")
    parser.add_argument("--sqlite", action="store_true", help="serve from a SQLite file")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=3200, help="per turn")
    args = parser.parse_args()

    if args.sqlite:
        url = f"sqlite+aiosqlite:////tmp/turnlog-bench-{uuid.uuid4().hex[:6]}.db"
    else:
        url = create_database(postgres(args.postgres_url), f"bench_wire_{uuid.uuid4().hex[:6]}")

    plan = make_session(np.random.default_rng(3), 10, args.new_tokens)
    patches = plan_patches(plan)
    proc, base = await start_server(url)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            await store_closed(http, plan)
        path = f"/v1/sessions/{plan.session_id}/samples?format=safetensors"
        http_times, mem_times, curl_times, peaks = [], [], [], []
        sync_http = httpx.Client(base_url=base, timeout=120)
        reference = tensors = reply = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            reference = np.concatenate(patches)
            mem_times.append(time.perf_counter() - t0)

            before = rss_kib(proc.pid, "VmRSS")
            reset_peak(proc.pid)
            t0 = time.perf_counter()
            response = sync_http.get(path)
            response.raise_for_status()
            reply = response.content
            tensors = load(reply)
            http_times.append(time.perf_counter() - t0)
            peaks.append(rss_kib(proc.pid, "VmHWM") - before)
            t0 = time.perf_counter()
            subprocess.run(["curl", "-sf", "-o", "/dev/null", f"{base}{path}"], check=True)
            curl_times.append(time.perf_counter() - t0)
        assert reference is not None and tensors is not None and reply is not None
        r3 = tensors["rollout_routed_experts.0"]
        rows = len(tensors["tokens.0"]) - 1
        assert r3.shape == (rows, LAYERS, TOPK)
        assert r3.tobytes() == reference[:rows].tobytes()
        assert save(tensors) == reply, "reply differs from safetensors.numpy.save"
    finally:
        stop_server(proc)

    http_ms = statistics.median(http_times) * 1000
    curl_ms = statistics.median(curl_times) * 1000
    mem_ms = statistics.median(mem_times) * 1000
    peak = max(peaks) * 1024
    backend = "sqlite" if args.sqlite else "postgresql"
    print(f"backend {backend}; reply {len(reply) / 1e6:.1f} MB (R3 [{rows}, {LAYERS}, {TOPK}] "
          f"int32 = {r3.nbytes / 1e6:.1f} MB); {args.repeat} repetitions")
    print(f"HTTP  GET …/samples?format=safetensors + load : {http_ms:8.1f} ms (median)")
    print(f"curl (server side alone, to /dev/null)         : {curl_ms:8.1f} ms (median)")
    print(f"np.concatenate of the patches                  : {mem_ms:8.1f} ms (median)")
    print(f"ratio HTTP / memory : {http_ms / mem_ms:6.2f}x   (target <= 3x)")
    print(f"ratio curl / memory : {curl_ms / mem_ms:6.2f}x")
    print(f"server peak RSS growth while serving: {peak / 1e6:.1f} MB = "
          f"{peak / len(reply):.2f}x the reply   (target <= 2.5x)")


if __name__ == "__main__":
    asyncio.run(main())
