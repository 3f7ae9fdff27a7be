"""Hostile and big bodies: peak server memory per body size and wire, `/healthz` under each.

Run by hand (not in CI):

    .venv/bin/python -m bench.hostile_bodies [--mb 8 32] [--app-root DIR]

Each case starts a fresh `turnlog serve` (one worker, SQLite in a temporary
directory) so its peak RSS (VmHWM) belongs to that case alone, polls
`/healthz` every 10 ms while the case runs, and prints: status, seconds,
peak RSS growth over the idle server, and the probe's max latency.

- `wide-json` / `wide-msgpack`: a body of N MB of empty arrays (issue 21's width
  amplification); refused 413 before decoding since the width bound.
- `r3-json` / `r3-msgpack`: an ordinary turn with an N MB R3 payload.
- `cache-json` / `cache-msgpack`: 8 such turns appended one after another
  (each a new root, TURNLOG_STATE_CACHE_BYTES=10000000): what the state cache keeps.
- `trickle`: two clients hold both upload slots, declaring N MB and sending
  64 bytes every 2 s, while a 2 MB turn waits (TURNLOG_UPLOAD_GRACE_S=3 here).

`--app-root` serves another checkout's `app` (e.g. /work/main) with this
venv, for the before/after figures.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

from bench.big_bodies import vm
from bench.common import free_port

LAYERS, TOPK = 48, 8


def r3_turn(mb: float, wire: str, event_id: str) -> bytes:
    rows = max(1, int(mb * 1024 * 1024 // (LAYERS * TOPK * 4)))
    prompt = [int(t) for t in np.arange(rows - 15) % 150_000 + 1]
    output = list(range(1, 17))
    r3 = np.random.default_rng(0).integers(0, 128, (rows, LAYERS, TOPK), dtype=np.int32)
    raw = r3.astype("<i4").tobytes()
    body: dict[str, Any] = {"event_id": event_id, "parent": None, "record": {
        "request": {"input_ids": prompt, "return_routed_experts": True,
                    "routed_experts_start_len": 0},
        "response": {"choices": [{"finish_reason": "stop", "meta_info": {
            "output_token_logprobs": [[-0.5, t] for t in output],
            "completion_tokens": len(output),
            "routed_experts": raw if wire == "msgpack" else base64.b64encode(raw).decode()}}]}}}
    return msgspec.msgpack.encode(body) if wire == "msgpack" else json.dumps(body).encode()


def wide(mb: float, wire: str) -> bytes:
    n = int(mb * 1024 * 1024)
    if wire == "msgpack":  # a map {"event_id", "record": [[], [], ...]}
        count = n
        return (b"\x82\xa8event_id\xa4wide\xa6record\xdd" + count.to_bytes(4, "big")
                + b"\x90" * count)
    count = n // 3
    return b'{"event_id":"wide","record":[' + b"[]," * (count - 1) + b"[]]}"


def content_type(wire: str) -> str:
    return "application/msgpack" if wire == "msgpack" else "application/json"


async def serve(url: str, root: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--port", str(port)], cwd=root,
        env=dict(os.environ, TURNLOG_DATABASE_URL=url, **env),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        for _ in range(1800):
            try:
                if (await http.get("/readyz")).status_code == 200:
                    return proc, base
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    proc.terminate()
    raise RuntimeError("turnlog did not become ready within 180 s")


async def probe(base: str, stop: asyncio.Event) -> float:
    worst = 0.0
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        while not stop.is_set():
            started = time.perf_counter()
            await http.get("/healthz")
            worst = max(worst, time.perf_counter() - started)
            await asyncio.sleep(0.01)
    return worst


async def case(name: str, root: Path, env: dict[str, str],
               work: Callable[[httpx.AsyncClient], Awaitable[str]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, base = await serve(f"sqlite+aiosqlite:///{Path(tmp) / 'b.db'}", root, env)
        try:
            async with httpx.AsyncClient(base_url=base, timeout=600) as http:
                r = await http.post("/v1/sessions", json={
                    "session_id": "s", "version": "v2", "pause_generation_mode": "in_place",
                    "r3": {"num_layers": LAYERS}})
                assert r.status_code == 201, r.text
                await asyncio.sleep(0.5)
                idle = vm(proc.pid, "VmRSS")
                stop = asyncio.Event()
                prober = asyncio.create_task(probe(base, stop))
                started = time.perf_counter()
                outcome = await work(http)
                took = time.perf_counter() - started
                stop.set()
                worst = await prober
                peak, now = vm(proc.pid, "VmHWM") - idle, vm(proc.pid, "VmRSS") - idle
                print(f"{name:28s} {outcome:14s} {took:7.2f} s  peak RSS +{peak:5d} MB"
                      f"  (now +{now:5d} MB)  /healthz max {worst * 1000:7.1f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(10)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[8, 32])
    parser.add_argument("--app-root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--cases", nargs="+",
                        default=["wide", "r3", "cache", "trickle"])
    args = parser.parse_args()
    root = args.app_root
    print(f"serving {root}")
    for mb in args.mb:
        for wire in ("json", "msgpack"):
            if "wide" in args.cases:
                body = wide(mb, wire)

                async def send_wide(http: httpx.AsyncClient, body: bytes = body,
                                    wire: str = wire) -> str:
                    r = await http.post("/v1/sessions/s/turns", content=body,
                                        headers={"content-type": content_type(wire)})
                    return str(r.status_code)

                await case(f"wide-{wire} {len(body) / 2**20:.0f} MB", root, {}, send_wide)
            if "r3" in args.cases:
                body = r3_turn(mb, wire, "r3")

                async def send_r3(http: httpx.AsyncClient, body: bytes = body,
                                  wire: str = wire) -> str:
                    r = await http.post("/v1/sessions/s/turns", content=body,
                                        headers={"content-type": content_type(wire)})
                    return str(r.status_code)

                await case(f"r3-{wire} {len(body) / 2**20:.0f} MB", root, {}, send_r3)
            if "cache" in args.cases:
                bodies = [r3_turn(mb, wire, f"c{i}") for i in range(8)]

                async def send_many(http: httpx.AsyncClient, bodies: list[bytes] = bodies,
                                    wire: str = wire) -> str:
                    codes = set()
                    for body in bodies:
                        r = await http.post("/v1/sessions/s/turns", content=body,
                                            headers={"content-type": content_type(wire)})
                        codes.add(r.status_code)
                    return "/".join(map(str, sorted(codes))) + " x8"

                await case(f"cache-{wire} 8x{len(bodies[0]) / 2**20:.0f} MB", root,
                           {"TURNLOG_STATE_CACHE_BYTES": "10000000"}, send_many)
        if "trickle" in args.cases:
            async def trickling(http: httpx.AsyncClient, mb: float = mb) -> str:
                return await trickle(http, mb)

            await case(f"trickle 2x{mb:.0f} MB + 2 MB turn", root,
                       {"TURNLOG_UPLOAD_GRACE_S": "3"}, trickling)


async def trickle(http: httpx.AsyncClient, mb: float) -> str:
    declared = int(mb * 1024 * 1024)

    async def slow() -> AsyncIterator[bytes]:
        for _ in range(10):  # 20 s at most, then the bench gives up on it
            yield b" " * 64
            await asyncio.sleep(2)

    async def holder() -> int:
        try:
            r = await http.post("/v1/sessions/s/turns", content=slow(), headers={
                "content-type": "application/json", "content-length": str(declared)})
            return r.status_code
        except Exception:  # noqa: BLE001  (cut off by the server, or the client gave up)
            return 0

    holders = [asyncio.create_task(holder()) for _ in range(2)]
    await asyncio.sleep(0.5)
    started = time.perf_counter()
    r = await http.post("/v1/sessions/s/turns", content=r3_turn(2, "json", "legit"),
                        headers={"content-type": "application/json"})
    waited = time.perf_counter() - started
    codes = await asyncio.gather(*holders)
    return f"{r.status_code} in {waited:.1f}s, holders {codes}"


if __name__ == "__main__":
    asyncio.run(main())
