"""Rebuild benchmark: `turnlog rebuild` over many small turns, SQLite and PostgreSQL.

Run by hand (not in CI):

    .venv/bin/python -m bench.rebuild [--sessions 500] [--turns 10] [--backend both]

Each session is a simulated addition-mode rollout (app/sim/simulator.py: 2
layers, top-2, a few dozen tokens per turn, closed with a reward), written
through the store's own writer. Then the whole store is rebuilt, as the CLI
does it (checksums before and after included), and the rate is reported in
turns per second of the log (target: >= 5,000 on both backends). The rebuild
must reproduce the projections bit for bit.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid

from bench.common import postgres
from tests.pgserver import create_database


async def fill(url: str, sessions: int, turns: int) -> int:
    from app.settings import Settings
    from app.sim.simulator import SessionSimulator, SimConfig
    from app.store.append.writes import Writer
    from app.store.engine.db import Database
    from app.store.fold.loader import StateCache

    db = Database(url, Settings.load(database_url=url))
    writer = Writer(db, StateCache(64), 1024)
    written = 0
    try:
        for i in range(sessions):
            config = SimConfig(session_id=f"rb-{uuid.uuid4().hex[:12]}", version="v2",
                               pause_generation_mode="in_place",
                               labels={"run_id": "bench", "rollout_id": i})
            sim = SessionSimulator(config, random.Random(i))
            await writer.open_session(sim.open_body())
            parent = None
            for _ in range(turns):
                body = sim.turn(parent)
                written_turn = await writer.append_turn(config.session_id, body)
                parent = written_turn.body["seq"]
                written += 1
            await writer.close_session(config.session_id, {"metadata": {"reward": 1.0}})
    finally:
        await db.dispose()
    return written


async def measure(url: str, parallel: int = 2) -> tuple[float, bool, int, float]:
    from app.settings import Settings
    from app.store.engine.db import Database
    from app.store.ops.rebuild import checksums, rebuild

    db = Database(url, Settings.load(database_url=url))
    try:
        t0 = time.perf_counter()
        await checksums(db)
        print(f"  (one checksum pass over all projections: {time.perf_counter() - t0:.2f} s; "
              f"a rebuild takes two)", flush=True)
        t0, cpu0 = time.perf_counter(), time.process_time()
        report = await rebuild(db, parallel=parallel)
        # CPU seconds of this process (all threads): what the rebuild costs on a free
        # core, whatever else the machine runs (PostgreSQL's own work is not in it).
        return (time.perf_counter() - t0, report.equal, report.sessions,
                time.process_time() - cpu0)
    finally:
        await db.dispose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--postgres-url", help="admin URL of a PostgreSQL server")
    parser.add_argument("--profile", action="store_true", help="cProfile the rebuild")
    parser.add_argument("--parallel", type=int, default=2,
                        help="batches at once on PostgreSQL (as `turnlog rebuild --parallel`)")
    parser.add_argument("--only-rebuild", metavar="URL",
                        help="rebuild this already filled database and stop (for profilers)")
    args = parser.parse_args()
    if args.only_rebuild:
        elapsed, equal, sessions, cpu = await measure(args.only_rebuild, args.parallel)
        print(f"rebuilt {sessions} sessions in {elapsed:.2f} s ({cpu:.2f} CPU s), checksums "
              f"{'equal' if equal else 'DIFFER'}")
        return

    from app.store.engine import migrate

    backends = ("sqlite", "postgres") if args.backend == "both" else (args.backend,)
    results = []
    for backend in backends:
        if backend == "sqlite":
            url = f"sqlite+aiosqlite:////tmp/turnlog-bench-rebuild-{uuid.uuid4().hex[:6]}.db"
        else:
            url = create_database(postgres(args.postgres_url, durable=True),
                                  f"bench_rebuild_{uuid.uuid4().hex[:6]}")
        await migrate.upgrade_async(url)
        t0 = time.perf_counter()
        turns = await fill(url, args.sessions, args.turns)
        print(f"{backend}: wrote {args.sessions} sessions, {turns} turns in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        if args.profile:
            import cProfile
            import pstats

            profile = cProfile.Profile()
            profile.enable()
            elapsed, equal, sessions, cpu = await measure(url, args.parallel)
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        else:
            elapsed, equal, sessions, cpu = await measure(url, args.parallel)
        results.append((backend, sessions, turns, elapsed, equal, cpu))

    print()
    print(f"{'backend':9s} {'sessions':>8s} {'turns':>7s} {'seconds':>8s} {'turns/s':>8s} "
          f"{'CPU s':>6s} {'turns/CPU s':>11s} {'checksums':>9s}")
    for backend, sessions, turns, elapsed, equal, cpu in results:
        print(f"{backend:9s} {sessions:8d} {turns:7d} {elapsed:8.2f} {turns / elapsed:8.0f} "
              f"{cpu:6.2f} {turns / cpu:11.0f} {'equal' if equal else 'DIFFER':>9s}"
              f"   (target >= 5000 turns/s)")


if __name__ == "__main__":
    asyncio.run(main())
