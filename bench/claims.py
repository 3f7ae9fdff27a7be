"""Consumer-group benchmark: sessions handed out per second to 8 concurrent claimers.

Run by hand (not in CI):

    .venv/bin/python -m bench.claims [--postgres-url URL | --sqlite] [--sessions 3000]
                                     [--claimers 8] [--limit 16] [--workers 1]

Closes `--sessions` sessions (written in-process through the store), starts
`turnlog serve`, defines a consumer group over them, then runs `--claimers`
trainers over HTTP, each looping claim(limit) → ack(step) until a claim
comes back empty. Prints sessions acknowledged per second (target: >= 500
with 8 claimers on PostgreSQL) and checks that every session was
acknowledged exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections import Counter

import httpx

from app.services import build_services
from app.settings import Settings
from app.store.engine import migrate
from bench.common import postgres, start_server, stop_server
from tests.pgserver import create_database


async def close_sessions(url: str, run_id: str, n: int) -> None:
    svc = build_services(Settings.load(database_url=url))
    try:
        sem = asyncio.Semaphore(8)

        async def one(i: int) -> None:
            async with sem:
                sid = f"{run_id}-{i:06d}"
                await svc.writer.open_session({"session_id": sid, "version": "v2",
                                               "labels": {"run_id": run_id}})
                await svc.writer.close_session(sid, {})

        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await svc.db.dispose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres-url", help="admin URL of a PostgreSQL server")
    parser.add_argument("--sqlite", action="store_true")
    parser.add_argument("--sessions", type=int, default=3000)
    parser.add_argument("--claimers", type=int, default=8)
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()

    if args.sqlite:
        url = f"sqlite+aiosqlite:////tmp/turnlog-bench-{uuid.uuid4().hex[:6]}.db"
    else:
        url = create_database(postgres(args.postgres_url), f"bench_claims_{uuid.uuid4().hex[:6]}")
    await migrate.upgrade_async(url)
    run_id = f"claims-{uuid.uuid4().hex[:6]}"
    t0 = time.perf_counter()
    await close_sessions(url, run_id, args.sessions)
    print(f"closed {args.sessions} sessions in {time.perf_counter() - t0:.1f} s")

    proc, base = await start_server(url, workers=args.workers)
    acked: Counter[str] = Counter()
    claims = 0
    try:
        async with httpx.AsyncClient(base_url=base, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as http:
            (await http.put("/v1/consumers/bench", json={"labels": {"run_id": run_id}})
             ).raise_for_status()

            async def trainer(k: int) -> None:
                nonlocal claims
                step = 0
                while True:
                    r = await http.post("/v1/consumers/bench/claims", json={
                        "claim_id": f"t{k}-{step}", "limit": args.limit})
                    r.raise_for_status()
                    claims += 1
                    sessions = r.json()["sessions"]
                    if not sessions:
                        return
                    a = await http.post(f"/v1/consumers/bench/claims/t{k}-{step}/ack",
                                        json={"step": step})
                    a.raise_for_status()
                    acked.update(a.json()["acked"])
                    step += 1

            t0 = time.perf_counter()
            await asyncio.gather(*(trainer(k) for k in range(args.claimers)))
            elapsed = time.perf_counter() - t0
            doc = (await http.get("/v1/consumers/bench")).json()
    finally:
        stop_server(proc)

    assert len(acked) == args.sessions and set(acked.values()) == {1}, "not exactly once"
    assert doc["acked"] == args.sessions and doc["available"] == 0
    backend = "sqlite" if args.sqlite else "postgresql"
    print(f"backend {backend}, {args.workers} server worker(s); {args.claimers} claimers, "
          f"limit {args.limit}: {args.sessions} sessions in {claims} claims, {elapsed:.2f} s")
    print(f"handed out and acknowledged: {args.sessions / elapsed:8.0f} sessions/s "
          f"(target >= 500); {claims / elapsed:.0f} claims/s; each session exactly once")


if __name__ == "__main__":
    asyncio.run(main())
