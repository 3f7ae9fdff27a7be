"""R3 serving benchmark: one sample's tensor over HTTP vs np.concatenate in memory.

Run by hand (not in CI):

    .venv/bin/python -m bench.samples [--postgres-url URL | --sqlite] [--repeat 10]

A 10-turn addition-mode session of ~32k final tokens with Qwen3-30B-A3B
geometry (48 layers, top-8) is appended to a `turnlog serve` subprocess and
closed. Then, in the same run:
- HTTP: `GET /v1/sessions/{sid}/samples/0/r3`, read fully and `np.load`ed;
- client: `SyncTurnlogClient.r3()` (streams the `.npy` into one preallocated
  array), the way a trainer reads it;
- memory: `np.concatenate` of the same patches (already decoded int32 arrays).
It prints the median times, their ratio (target: within 3x) and the server's
peak resident memory while serving, relative to the tensor size (target:
under 2.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import postgres, start_server, stop_server
from bench.ingest import LAYERS, TOPK, make_session
from tests.pg import create_database
from turnlog_client import SyncTurnlogClient


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def reset_peak(pid: int) -> None:
    # Writing 5 resets the peak resident set size (VmHWM) on Linux.
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def plan_patches(plan: Any) -> list[np.ndarray]:
    """The int32 R3 patches a planned session's turns carry (the concatenate baseline)."""
    return [np.frombuffer(base64.b64decode(json.loads(t.body)["record"]["response"]
                                           ["choices"][0]["meta_info"]["routed_experts"]),
                          "<i4").reshape(-1, LAYERS, TOPK) for t in plan.turns]


async def store_closed(http: httpx.AsyncClient, plan: Any) -> None:
    """Open the planned session, append its turns and close it (JSON wire)."""
    headers = {"content-type": "application/json"}
    (await http.post("/v1/sessions", content=plan.open_body,
                     headers=headers)).raise_for_status()
    for turn in plan.turns:
        (await http.post(f"/v1/sessions/{plan.session_id}/turns", content=turn.body,
                         headers=headers)).raise_for_status()
    (await http.post(f"/v1/sessions/{plan.session_id}/close", json={})).raise_for_status()


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
        url = create_database(postgres(args.postgres_url),
                              f"bench_samples_{uuid.uuid4().hex[:6]}")

    plan = make_session(np.random.default_rng(3), 10, args.new_tokens)
    patches = plan_patches(plan)
    proc, base = await start_server(url)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            await store_closed(http, plan)
            path = f"/v1/sessions/{plan.session_id}/samples/0/r3"

            http_times, mem_times, curl_times, peaks = [], [], [], []
            client_times = []
            sync_http = httpx.Client(base_url=base, timeout=120)
            trainer = SyncTurnlogClient(base, timeout=120)
            reference = None
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                reference = np.concatenate(patches)
                mem_times.append(time.perf_counter() - t0)

                before = rss_kib(proc.pid, "VmRSS")
                reset_peak(proc.pid)
                t0 = time.perf_counter()
                # A trainer's read: the synchronous httpx client, then np.load.
                reply = sync_http.get(path)
                reply.raise_for_status()
                tensor = np.load(io.BytesIO(reply.content), allow_pickle=False)
                http_times.append(time.perf_counter() - t0)
                peaks.append(rss_kib(proc.pid, "VmHWM") - before)
                t0 = time.perf_counter()
                subprocess.run(["curl", "-sf", "-o", "/dev/null", f"{base}{path}"], check=True)
                curl_times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                streamed = trainer.r3(plan.session_id, 0)
                client_times.append(time.perf_counter() - t0)
                assert streamed.tobytes() == tensor.tobytes()
            trainer.shutdown()
            assert reference is not None
            rows = reference.shape[0]
            tensor_bytes = reference.nbytes
            assert tensor.shape == (rows, LAYERS, TOPK)
            assert tensor.tobytes() == reference.tobytes()
    finally:
        stop_server(proc)

    http_ms = statistics.median(http_times) * 1000
    curl_ms = statistics.median(curl_times) * 1000
    mem_ms = statistics.median(mem_times) * 1000
    client_ms = statistics.median(client_times) * 1000
    peak = max(peaks) * 1024
    backend = "sqlite" if args.sqlite else "postgresql"
    print(f"backend {backend}; tensor [{rows}, {LAYERS}, {TOPK}] int32 = "
          f"{tensor_bytes / 1e6:.1f} MB; {args.repeat} repetitions")
    print(f"HTTP  GET …/samples/0/r3 + np.load : {http_ms:8.1f} ms (median)")
    print(f"SyncTurnlogClient.r3 (streamed)    : {client_ms:8.1f} ms (median)")
    print(f"curl (server side alone, to /dev/null): {curl_ms:5.1f} ms (median)")
    print(f"np.concatenate of the patches      : {mem_ms:8.1f} ms (median)")
    print(f"ratio HTTP / memory                : {http_ms / mem_ms:8.2f}x   (target <= 3x)")
    print(f"ratio client r3() / memory         : {client_ms / mem_ms:8.2f}x   (target <= 3x)")
    print(f"ratio curl / memory                : {curl_ms / mem_ms:8.2f}x")
    print(f"server peak RSS growth while serving: {peak / 1e6:.1f} MB = "
          f"{peak / tensor_bytes:.2f}x the tensor   (target < 2.5x)")


if __name__ == "__main__":
    asyncio.run(main())
