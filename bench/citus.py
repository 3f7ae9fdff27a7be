"""Citus benchmark: what distribution costs per append, and analytics over Citus vs one PG.

Run by hand (not in CI):

    .venv/bin/python -m bench.citus [--sessions 8 --turns 5] [--analytics-turns 1000000]

Starts, in one run, a throwaway single PostgreSQL (tests/pgserver.py) and a
throwaway Citus cluster of a coordinator and two workers on loopback
(tests/citusserver.py), both with production durability (fsync,
synchronous_commit, full_page_writes on) unless --fast-unsafe.

Ingest: the turns of `bench/ingest.py` (Qwen3-30B-A3B R3 geometry, addition
mode, ~2k new tokens per turn) appended over HTTP to one `turnlog serve`
per store by the same concurrent clients, into three fresh databases:
single PostgreSQL, Citus, and Citus with the feed fence's transaction-id
stamp switched off (the `xid` defaults set to 0: what the coordinator-side
fence costs — without it the coordinator's part of an append writes
nothing and commits without a WAL flush). The phases alternate `--rounds`
times so a change of load on the shared machine hits all alike.

Analytics (with --analytics-turns N): `bench/analytics.py`'s loader and
timing of `GET /v1/analytics/spec` (every group_by) on the single
PostgreSQL and on Citus.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import asyncpg
import numpy as np
from sqlalchemy.engine import make_url

from bench.common import pg_dsn, postgres, show_durability
from bench.ingest import LAYERS, TOPK, TURNLOG_TABLES, bench_turnlog, make_session
from tests.citusserver import create_citus_database, start_citus, start_durable_citus
from tests.pgserver import create_database


async def stored(url: str, citus: bool) -> int:
    size = "citus_total_relation_size" if citus else "pg_total_relation_size"
    conn = await asyncpg.connect(pg_dsn(url))
    try:
        return sum([int(await conn.fetchval(f"SELECT {size}($1)", t)) for t in TURNLOG_TABLES])
    finally:
        await conn.close()


async def no_fence(url: str) -> None:
    conn = await asyncpg.connect(pg_dsn(url))
    try:
        for table in ("events", "sessions"):
            await conn.execute(f"ALTER TABLE {table} ALTER COLUMN xid SET DEFAULT 0")
    finally:
        await conn.close()


async def micro(url: str, count: int) -> float:
    """Median seconds of one append-shaped transaction (lock the session row, insert an
    event, update the session), serially, on one connection: no HTTP, no JSON."""
    conn = await asyncpg.connect(pg_dsn(url))
    sid = f"micro-{uuid.uuid4().hex[:8]}"
    try:
        await conn.execute(
            "INSERT INTO sessions (session_id, version, pause_generation_mode, spec, "
            "max_trim_tokens, labels, open_fingerprint, created_us, status, num_nodes, "
            "spec_correct, spec_proposed, spec_verify, spec_completion) VALUES "
            "($1, 'v2', 'retract', false, 0, '{}', 'x', 0, 'open', 0, 0, 0, 0, 0)", sid)
        times = []
        for i in range(count):
            t0 = time.perf_counter()
            async with conn.transaction():
                await conn.execute("SELECT 1 FROM sessions WHERE session_id = $1 "
                                   "FOR NO KEY UPDATE", sid)
                await conn.execute("INSERT INTO events (session_id, seq, type, event_id, "
                                   "payload, recorded_us) VALUES ($1, $2, 'turn_recorded', "
                                   "$3, '{}', 0)", sid, i, str(i))
                await conn.execute("UPDATE sessions SET num_nodes = $2 WHERE session_id = $1",
                                   sid, i + 1)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        await conn.close()


def _report(results: dict[str, list[float]], sizes: dict[str, int], turns: int, raw: int,
            clients: int) -> None:
    print()
    print(f"{'store':14s} {'turns/s':>8s} {'ms/append':>10s} {'stored/raw int32':>17s}")
    median = {name: statistics.median(times) for name, times in results.items()}
    for name, elapsed in median.items():
        print(f"{name:14s} {turns / elapsed:8.2f} {elapsed * 1000 * clients / turns:10.1f} "
              f"{sizes[name] / raw:17.3f}")
    print(f"\nCitus / PostgreSQL time per append: {median['citus'] / median['postgres']:.2f}x; "
          f"the fence stamp: {median['citus'] / median['citus-nofence']:.2f}x of Citus "
          "without it")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--analytics-turns", type=int, default=0,
                        help="also time /v1/analytics/spec over this many turns (0: skip)")
    parser.add_argument("--analytics-sessions", type=int, default=0,
                        help="sessions for the analytics load (default: turns / 20)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--micro", type=int, default=0,
                        help="also time this many serial append-shaped transactions on "
                        "PostgreSQL, Citus and Citus without the stamp (no HTTP)")
    parser.add_argument("--fast-unsafe", action="store_true",
                        help="keep the test clusters' fsync=off")
    args = parser.parse_args()

    from app.store.engine import migrate

    # Durability is set on each server's command line: `ALTER SYSTEM` cannot
    # override the test clusters' `-c fsync=off`.
    pg = postgres(None, durable=not args.fast_unsafe)
    cluster = start_citus() if args.fast_unsafe else start_durable_citus()
    print(f"PostgreSQL: {await show_durability(pg.url)}")
    for node in cluster.nodes:
        print(f"Citus node {make_url(node).port}: {await show_durability(node)}", flush=True)
    rng = np.random.default_rng(7)
    results: dict[str, list[float]] = {"postgres": [], "citus": [], "citus-nofence": []}
    sizes: dict[str, int] = {}
    turns = args.sessions * args.turns
    rows = 0
    for round_ in range(args.rounds):
        plans = [make_session(rng, args.turns, args.new_tokens) for _ in range(args.sessions)]
        rows = sum(t.r3_rows for p in plans for t in p.turns)
        order = list(results) if round_ % 2 == 0 else list(reversed(results))
        for name in order:
            tag = uuid.uuid4().hex[:6]
            if name == "postgres":
                url = create_database(pg, f"bench_pg_{tag}")
            else:
                url = create_citus_database(cluster, f"bench_citus_{tag}")
            await migrate.upgrade_async(url)
            if name == "citus-nofence":
                await no_fence(url)
            elapsed, cpu = await bench_turnlog(url, plans, args.clients, 1)
            results[name].append(elapsed)
            sizes[name] = await stored(url, name != "postgres")
            print(f"  round {round_}: {name:14s} {turns / elapsed:7.2f} turns/s "
                  f"({elapsed * 1000 * args.clients / turns:7.1f} ms per append at "
                  f"{args.clients} clients; server CPU {cpu * 1000 / turns:.1f} ms/turn)",
                  flush=True)
    raw = rows * LAYERS * TOPK * 4
    if args.rounds:
        _report(results, sizes, turns, raw, args.clients)

    if args.micro:
        print(f"\n{args.micro} serial append-shaped transactions, median ms "
              "(3 interleaved rounds):")
        micro_urls = {}
        for name in results:
            tag = uuid.uuid4().hex[:6]
            url = (create_database(pg, f"bench_mi_{tag}") if name == "postgres"
                   else create_citus_database(cluster, f"bench_mi_{tag}"))
            await migrate.upgrade_async(url)
            if name == "citus-nofence":
                await no_fence(url)
            micro_urls[name] = url
        medians: dict[str, list[float]] = {name: [] for name in results}
        for round_ in range(3):
            for name in (list(results) if round_ % 2 == 0 else list(reversed(results))):
                medians[name].append(await micro(micro_urls[name], args.micro))
        for name, values in medians.items():
            print(f"  {name:14s} {statistics.median(values) * 1000:7.2f} ms")

    if args.analytics_turns:
        from bench.analytics import bench as analytics_bench
        from bench.analytics import load

        sessions = args.analytics_sessions or max(1, args.analytics_turns // 20)
        timings = {}
        for name in ("postgres", "citus"):
            tag = uuid.uuid4().hex[:6]
            url = (create_database(pg, f"bench_an_{tag}") if name == "postgres"
                   else create_citus_database(cluster, f"bench_an_{tag}"))
            await migrate.upgrade_async(url)
            print(f"\nanalytics on {name}: loading {args.analytics_turns:,} turns", flush=True)
            await load(url, sessions, args.analytics_turns)
            timings[name] = await analytics_bench(url, args.repeat)
        print()
        print(f"{'query':44s} {'PG api ms':>10s} {'Citus api ms':>13s} {'Citus/PG':>9s}")
        for (label, t_pg, _), (_, t_citus, _) in zip(timings["postgres"], timings["citus"],
                                                     strict=True):
            print(f"{label:44s} {t_pg * 1000:10.1f} {t_citus * 1000:13.1f} "
                  f"{t_citus / t_pg:9.2f}")


if __name__ == "__main__":
    asyncio.run(main())
