"""Analytics benchmark: `GET /v1/analytics/spec` vs a hand-written SUM/GROUP BY, on PostgreSQL.

Run by hand (not in CI):

    .venv/bin/python bench/analytics.py [--postgres-url postgresql://...] \\
        [--turns 1000000 --sessions 50000 --repeat 5]

Setup bulk-loads `sessions`, `session_labels` and `nodes` rows with COPY
into a fresh database migrated to head (events are not needed: analytics
read only the projections), then ANALYZEs. Then, for every `group_by` (and
one label-filtered query), in the same run: the API call (in-process ASGI,
so HTTP parsing, SQLAlchemy and JSON are all counted) and a hand-written
SUM/GROUP BY on the raw `nodes` table through asyncpg, each repeated
`--repeat` times after a warm-up. Prints the medians and the ratio API /
hand-written (target: at most 1.5) and checks both answered the same sums.
Without --postgres-url a throwaway cluster is started from the installed
PostgreSQL binaries (tests/pg/). The scratch database is dropped
at the end unless --keep.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import numpy as np

from bench.common import pg_dsn, postgres
from tests.pg import create_database, drop_database

RUNS, ROLLOUTS_PER_RUN, MODELS, VERSIONS = 20, 100, 3, 200
DAY0 = 1764374400  # 2025-11-29T00:00:00Z
SPAN_S = 7 * 86400
CHUNK = 100_000
SUMS = ("spec_correct", "spec_proposed", "spec_verify", "spec_completion")
API_SUMS = ("spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_verify_ct",
            "completion_tokens")
NODE_COLUMNS = ("session_id", "seq", "parent", "depth", "num_tokens", "prompt_len",
                "prompt_lcp", "output_len", "finish_reason", "weight_version", *SUMS,
                "record_ts", "record_hour", "record_day", "position", "recorded_us")
LABEL_GROUPS = {"model", "run_id", "rollout_id"}
COLUMN = {"weight_version": "weight_version", "hour": "record_hour", "day": "record_day"}


def sid(i: int) -> str:
    return f"bench-{i:08d}"


def session_labels_of(i: int) -> dict[str, str]:
    run = i % RUNS
    return {"run_id": f"run-{run}", "rollout_id": str(run * ROLLOUTS_PER_RUN
                                                    + (i // RUNS) % ROLLOUTS_PER_RUN),
            "model": f"model-{i % MODELS}"}


def node_chunks(rng: np.random.Generator, sessions: int, turns: int):
    """`nodes` rows in chunks of about CHUNK, with the per-session carrier sums."""
    per = turns // sessions
    extra = turns - per * sessions
    counts = np.full(sessions, per, dtype=np.int64)
    counts[:extra] += 1
    carrier = np.zeros((sessions, 4), dtype=np.int64)
    position = 0
    first = 0
    while first < sessions:
        last = min(sessions, first + max(1, CHUNK // max(per, 1)))
        n = int(counts[first:last].sum())
        owner = np.repeat(np.arange(first, last), counts[first:last])
        seq = np.concatenate([np.arange(c) for c in counts[first:last]])
        output = rng.integers(50, 500, n)
        prompt = 400 + seq * 600
        verify = np.where(rng.random(n) < 0.1, 0, rng.integers(1, 200, n))
        proposed = verify * 3
        correct = rng.binomial(proposed, 0.6)
        ts = DAY0 + (owner / sessions) * SPAN_S + seq * 7.5
        version = np.minimum(VERSIONS - 1, (owner * VERSIONS) // sessions + (seq >= per // 2))
        guarded = np.stack([correct, proposed, verify, output], axis=1) * (verify > 0)[:, None]
        np.add.at(carrier, owner, guarded)
        records = []
        for k in range(n):
            stamp = datetime.fromtimestamp(float(ts[k]), UTC)
            s = int(seq[k])
            records.append((
                sid(int(owner[k])), s, None if s == 0 else s - 1, s,
                int(prompt[k] + output[k]), int(prompt[k]), int(prompt[k]) - 200 if s else 0,
                int(output[k]), "stop", str(int(version[k])), int(correct[k]),
                int(proposed[k]), int(verify[k]), int(output[k]), float(ts[k]),
                stamp.strftime("%Y-%m-%dT%H:00:00Z"), stamp.strftime("%Y-%m-%d"),
                position + k, int(ts[k] * 1_000_000)))
        position += n
        yield records
        first = last
    yield carrier


async def load(url: str, sessions: int, turns: int) -> None:
    rng = np.random.default_rng(42)
    conn = await asyncpg.connect(pg_dsn(url))
    try:
        t0 = time.perf_counter()
        loaded = 0
        carrier = None
        # The carrier sums are known only after the nodes: load them first, FK re-added after.
        await conn.execute("ALTER TABLE nodes DROP CONSTRAINT fk_nodes_session_id_sessions")
        for chunk in node_chunks(rng, sessions, turns):
            if isinstance(chunk, np.ndarray):
                carrier = chunk
                continue
            await conn.copy_records_to_table("nodes", records=chunk, columns=NODE_COLUMNS)
            loaded += len(chunk)
            print(f"\r  nodes {loaded:,}/{turns:,}", end="", flush=True)
        print()
        assert carrier is not None
        created = DAY0 * 1_000_000
        await conn.copy_records_to_table("sessions", columns=(
            "session_id", "version", "pause_generation_mode", "spec", "max_trim_tokens",
            "labels", "open_fingerprint", "created_us", "status", "num_nodes",
            "spec_correct", "spec_proposed", "spec_verify", "spec_completion"), records=[
            (sid(i), "v2", "retract", True, 0, "{}", "0" * 64, created, "open",
             int((turns // sessions) + (1 if i < turns % sessions else 0)),
             *(int(v) for v in carrier[i]))
            for i in range(sessions)])
        await conn.copy_records_to_table("session_labels", columns=(
            "session_id", "key", "value_text"), records=[
            (sid(i), key, value) for i in range(sessions)
            for key, value in session_labels_of(i).items()])
        await conn.execute("ALTER TABLE nodes ADD CONSTRAINT fk_nodes_session_id_sessions "
                           "FOREIGN KEY (session_id) REFERENCES sessions (session_id)")
        await conn.execute("ANALYZE")
        print(f"  loaded {turns:,} turns / {sessions:,} sessions in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        await conn.close()


def hand_written(group_by: str, filtered: bool) -> tuple[str, list[Any]]:
    sums = ", ".join(f"SUM(CASE WHEN n.spec_verify > 0 THEN n.{c} ELSE 0 END) AS {c}"
                     for c in SUMS)
    params: list[Any] = []
    if group_by in LABEL_GROUPS:
        key = "l.value_text"
        source = ("nodes n LEFT JOIN session_labels l ON l.session_id = n.session_id "
                  "AND l.key = $1")
        params.append(group_by)
    else:
        key = f"n.{COLUMN[group_by]}"
        source = "nodes n"
    where = ""
    if filtered:
        params.append("run-3")
        where = (" WHERE EXISTS (SELECT 1 FROM session_labels f WHERE f.session_id = "
                 f"n.session_id AND f.key = 'run_id' AND f.value_text = ${len(params)})")
    return (f"SELECT {key} AS key, COUNT(DISTINCT n.session_id) AS sessions, "
            f"COUNT(*) AS turns, {sums} FROM {source}{where} GROUP BY {key} ORDER BY 1",
            params)


async def timed_pair(api: Callable[[], Awaitable[Any]], raw: Callable[[], Awaitable[Any]],
                     repeat: int) -> tuple[float, float, Any, Any]:
    """Medians of `repeat` runs of each, interleaved (alternating which goes first) so a
    change of load on the machine hits both alike; one warm-up each gives the answers."""
    answers = (await api(), await raw())
    times: dict[int, list[float]] = {0: [], 1: []}
    for rep in range(repeat):
        order = (0, 1) if rep % 2 == 0 else (1, 0)
        for which in order:
            t0 = time.perf_counter()
            await (api, raw)[which]()
            times[which].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1]), *answers


async def bench(url: str, repeat: int) -> list[tuple[str, float, float]]:
    from app.main import create_app
    from app.settings import Settings

    app = create_app(Settings.load(database_url=url, migrate_on_start=False))
    conn = await asyncpg.connect(pg_dsn(url))
    results = []
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench",
                                     timeout=600) as http:
            cases = [(g, False) for g in ("weight_version", "model", "run_id", "rollout_id",
                                          "hour", "day")] + [("weight_version", True)]
            for group_by, filtered in cases:
                params = {"group_by": group_by, **({"run_id": "run-3"} if filtered else {})}

                async def api(params: dict[str, str] = params) -> Any:
                    r = await http.get("/v1/analytics/spec", params=params)
                    r.raise_for_status()
                    return r.json()["groups"]

                sql, args = hand_written(group_by, filtered)

                async def raw(sql: str = sql, args: list[Any] = args) -> Any:
                    return await conn.fetch(sql, *args)

                t_api, t_raw, groups, rows = await timed_pair(api, raw, repeat)
                by_key = {g["key"]: [g["sessions"], g["turns"], *(g[s] for s in API_SUMS)]
                          for g in groups}
                assert by_key == {r["key"]: [r["sessions"], r["turns"], *(int(r[c])
                                  for c in SUMS)] for r in rows}, group_by
                name = group_by + (" (run_id filter)" if filtered else "")
                results.append((f"{name} [{len(groups)} groups]", t_api, t_raw))
                print(f"  {name:32s} api {t_api * 1000:9.1f} ms   hand-written "
                      f"{t_raw * 1000:9.1f} ms   ratio {t_api / t_raw:5.2f}", flush=True)
    finally:
        await conn.close()
        await app.state.services.db.dispose()
    return results


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres-url", help="admin URL of a PostgreSQL server (a scratch "
                        "database is created on it; default: a throwaway cluster)")
    parser.add_argument("--turns", type=int, default=1_000_000)
    parser.add_argument("--sessions", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the scratch database")
    args = parser.parse_args()
    if args.sessions < 1 or args.turns < args.sessions:
        parser.error("need at least one turn per session")

    server = postgres(args.postgres_url)
    name = f"bench_analytics_{uuid.uuid4().hex[:6]}"
    url = create_database(server, name)
    try:
        from app.store.engine import migrate

        await migrate.upgrade_async(url)
        print(f"loading into {name} ...", flush=True)
        await load(url, args.sessions, args.turns)
        print(f"timing medians of {args.repeat} interleaved runs after a warm-up:", flush=True)
        results = await bench(url, args.repeat)
    finally:
        if not args.keep:
            drop_database(server, name)
    print()
    print(f"{'query':48s} {'api ms':>9s} {'raw ms':>9s} {'ratio':>6s}")
    for label, t_api, t_raw in results:
        print(f"{label:48s} {t_api * 1000:9.1f} {t_raw * 1000:9.1f} {t_api / t_raw:6.2f}")
    worst = max(t_api / t_raw for _, t_api, t_raw in results)
    print(f"\nworst API / hand-written ratio: {worst:.2f}   (target <= 1.5)")


if __name__ == "__main__":
    asyncio.run(main())
