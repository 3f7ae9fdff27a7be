"""Ingest benchmark: turnlog over HTTP (JSON and MessagePack) vs a naive JSONB store vs
the raw-bytes floor, and the server's peak memory on one very large turn.

Run by hand (not in CI):

    .venv/bin/python -m bench.ingest [--postgres-url postgresql://...] [--sessions 8]
                                     [--workers 1,2] [--big-turn-mb 100]
                                     [--curve 1,4,16,64 --curve-turns 4]
                                     [--group-commit 0,1000]
    .venv/bin/python -m bench.ingest --sqlite [--baseline DIR] [--new-tokens 50]

Addition-mode (in_place) sessions with Qwen3-30B-A3B geometry (48 layers,
top-8, 128 experts), 10 turns per session, ~2k new tokens per turn, appended
by 4 concurrent clients. turnlog runs once per wire and per `--workers`
count: JSON bodies as the session server writes them (base64 R3),
MessagePack bodies with R3 as int32 bytes (`TurnlogClient(wire="msgpack")`),
and the narrowed MessagePack `TurnlogClient` sends by default (R3 as uint8
values: a quarter of the bytes).
In the same run, with the same turns and concurrency, two references:
- naive: one row per record as received (base64 R3 inside) in a JSONB column,
  inserted with asyncpg;
- floor: raw asyncpg INSERTs of only the bytes turnlog must keep (the narrowed
  R3 and the token delta as bytea), no HTTP, no JSON.
Without --postgres-url a throwaway cluster is started from the installed
PostgreSQL binaries (tests/pg/). Every phase gets its own database so
the stored sizes are clean. Last, `--big-turn-mb`: one turn of that many MB
of JSON (and its two MessagePack twins) is appended to a fresh `serve --workers 1`
and the server's peak resident memory growth is reported against the body.

`--py-spy DIR` samples each turnlog phase's server into DIR (`$PY_SPY_RATE`
samples/s, default 200; `$PY_SPY_FLAGS`, default `--subprocesses --gil`:
the Python CPU; `--subprocesses --native` shows C frames and every thread).

Beside each turnlog phase's ratios: the server's CPU per turn, the user +
system CPU seconds of the `turnlog serve` process tree (/proc/<pid>/stat,
read before and after the phase) divided by the turns appended. Unlike the
wall-clock rates it barely moves with the machine's other load. `--curve`
adds turns/s against client count, for turnlog (`--curve-wire`, default the
narrowed MessagePack) and the floor.
`--in-process 0,1000` adds the same MessagePack turns appended in the
benchmark's own process through the store's services (decode, validate,
`Writer.append_parsed`; no HTTP), once per group commit window: what the
append costs without the HTTP hop.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

from bench.common import (
    ROOT,
    RawHttp,
    add_warm_wal_option,
    cpu_split,
    free_port,
    pg_dsn,
    postgres,
    py_spy_exe,
    show_durability,
    start_py_spy,
    start_server,
    stop_server,
    warm_wal_for,
)
from tests.pg import create_database, drop_database
from turnlog_client.async_client import _encode_turn

LAYERS, TOPK, EXPERTS = 48, 8, 128
TURNLOG_TABLES = ("events", "r3_patches", "nodes", "sessions", "session_labels", "samples")


MSGPACK = "application/msgpack"
NARROW = "application/vnd.turnlog.narrow-r3+msgpack"


@dataclass
class Turn:
    body: bytes  # the JSON the session server sends
    msgpack: bytes  # what TurnlogClient sends on its "msgpack" wire (R3 as int32 bytes)
    narrow: bytes  # what it sends by default (R3 as uint8 values: a width byte, then them)
    r3_rows: int
    r3_narrow: bytes  # what the floor keeps
    token_delta: bytes


def on_wire(turn: Turn, wire: str) -> tuple[bytes, str]:
    """A turn's body and content type on `wire` (json, msgpack or narrow)."""
    if wire == "msgpack":
        return turn.msgpack, MSGPACK
    if wire == "narrow":
        return turn.narrow, NARROW
    return turn.body, "application/json"


@dataclass
class SessionPlan:
    session_id: str
    open_body: bytes
    turns: list[Turn]


def make_session(rng: np.random.Generator, turns: int, new_tokens: int) -> SessionPlan:
    sid = f"bench-{uuid.uuid4().hex[:12]}"
    open_body = json.dumps({
        "session_id": sid, "version": "v2", "pause_generation_mode": "in_place",
        "r3": {"num_layers": LAYERS}, "spec": True,
        "labels": {"run_id": "bench", "model": "qwen3-30b-a3b"},
    }).encode()
    tokens: list[int] = rng.integers(0, 150_000, 400).tolist()  # system prompt
    plan: list[Turn] = []
    for t in range(turns):
        user = int(new_tokens * 0.3)
        output = new_tokens - user
        prompt = tokens + rng.integers(0, 150_000, user).tolist()
        out = rng.integers(0, 150_000, output).tolist()
        start = 0 if t == 0 else len(tokens) - 1
        end = len(prompt) + len(out) - 1
        rows = end - start
        r3 = rng.integers(0, EXPERTS, (rows, LAYERS, TOPK), dtype=np.int32)
        body = {
            "event_id": uuid.uuid4().hex,
            "record": {
                "timestamp": 1755800000.0 + t, "request_timestamp": 1755800000.0 + t,
                "method": "POST", "path": "/v1/chat/completions", "status_code": 200,
                "request": {"model": "default", "messages": [{"role": "user", "content": "x"}],
                            "logprobs": True, "return_meta_info": True,
                            "input_ids": prompt, "return_routed_experts": True,
                            "routed_experts_start_len": start},
                "response": {"id": f"chatcmpl-{t}", "object": "chat.completion", "choices": [{
                    "index": 0, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "y"},
                    "meta_info": {
                        "output_token_logprobs": [[round(-float(i % 97) / 50, 6), tok]
                                                  for i, tok in enumerate(out)],
                        "completion_tokens": len(out), "prompt_tokens": len(prompt),
                        "cached_tokens": len(tokens), "weight_version": str(t // 3),
                        "spec_verify_ct": 400, "spec_num_correct_drafts": 900,
                        "spec_num_proposed_drafts": 1200,
                        "routed_experts": base64.b64encode(r3.tobytes()).decode(),
                    }}]},
            },
        }
        delta = np.asarray(prompt[len(tokens):], dtype="<i4").tobytes()
        packed, _ = _encode_turn(body, "msgpack")
        narrow, _ = _encode_turn(body, "narrow")
        plan.append(Turn(json.dumps(body).encode(), packed, narrow, rows,
                         r3.astype(np.uint8).tobytes(), delta))
        tokens = prompt + out
    return SessionPlan(sid, open_body, plan)


# The machine's CPU over the last `run_workers`, by who spent it (`machine_cpu`),
# and the WAL the PostgreSQL server wrote meanwhile (`wal_bytes`, when `WAL_DSN` is set).
last_split: dict[str, float] = {}
WAL_DSN: list[str] = []


async def wal_position() -> int:
    """The server's WAL insert position in bytes (0 without `WAL_DSN`)."""
    if not WAL_DSN:
        return 0
    import asyncpg

    conn = await asyncpg.connect(WAL_DSN[0])
    try:
        return int(await conn.fetchval("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"))
    finally:
        await conn.close()


async def run_workers(plans: list[SessionPlan], clients: int, work) -> float:  # noqa: ANN001
    queue: asyncio.Queue[SessionPlan] = asyncio.Queue()
    for p in plans:
        queue.put_nowait(p)

    async def worker(i: int) -> None:
        while not queue.empty():
            await work(i, queue.get_nowait())

    wal = await wal_position()
    before = machine_cpu()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    elapsed = time.perf_counter() - t0
    after = machine_cpu()
    last_split.clear()
    last_split.update({key: after[key] - before[key] for key in after})
    last_split["wal_bytes"] = await wal_position() - wal
    return elapsed


async def bench_turnlog(url: str, plans: list[SessionPlan], clients: int, workers: int,
                        wire: str = "json", py_spy: str | None = None,
                        root: Path | None = None,
                        settings: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, server CPU seconds) of appending every turn of `plans`."""
    proc, base = await start_server(url, workers, root, settings)
    spy = None
    try:
        if py_spy:
            # Sample the server (and its worker processes) for the whole phase: by
            # default where its Python CPU goes (the thread holding the GIL).
            spy = start_py_spy(f"{py_spy}/{wire}-w{workers}.txt", proc.pid,
                               "--subprocesses", "--gil")
            await asyncio.sleep(1.0)
        connections = [RawHttp(base) for _ in range(clients)]
        for conn in connections:
            await conn.__aenter__()

        async def work(i: int, plan: SessionPlan) -> None:
            http = connections[i]
            status, reply = await http.post_json("/v1/sessions", plan.open_body)
            if status not in (200, 201):
                raise RuntimeError(reply.decode())
            for turn in plan.turns:
                path = f"/v1/sessions/{plan.session_id}/turns"
                status, reply = await http.post_json(path, *on_wire(turn, wire))
                if status != 201:
                    raise RuntimeError(reply.decode())

        # Counted from here: the appends and each plan's one open (a few % of a turn's work).
        cpu0 = cpu_seconds(proc.pid)
        try:
            elapsed = await run_workers(plans, clients, work)
            return elapsed, cpu_seconds(proc.pid) - cpu0
        finally:
            for conn in connections:
                await conn.__aexit__()
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        stop_server(proc)


async def bench_in_process(url: str, plans: list[SessionPlan], clients: int,
                           window_us: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of the same MessagePack turns appended
    in this process through the store's services, as the hot route does after it has
    the body (decode, validate, `Writer.append_parsed`), `clients` at a time, with a
    group commit window of `window_us`: the append without HTTP (no body sent or
    received, no middleware), for telling the two costs apart."""
    from app.domain.wire import msgpackio
    from app.logs import configure_logging
    from app.services import build_services
    from app.settings import Settings
    from app.store.append.writes import parse_prepared

    configure_logging("warning")  # as `serve` logs, without a line per group
    settings = Settings.load(database_url=url, migrate_on_start=False, api_tokens="",
                             group_commit_window_us=window_us)
    services = build_services(settings)
    writer = services.writer

    async def work(_i: int, plan: SessionPlan) -> None:
        opened = await writer.open(json.loads(plan.open_body))
        for turn in plan.turns:
            raw = bytearray(turn.msgpack)
            value = msgpackio.loads(raw, settings.limits.max_body_values,
                                    found=msgpackio.layout(raw))
            body, prepared = parse_prepared(value, opened.definition)
            written = await writer.append_parsed(plan.session_id, opened.definition, body,
                                                 False, prepared)
            assert written.created

    try:
        cpu0 = time.process_time()
        elapsed = await run_workers(plans, clients, work)
        cpu_s = time.process_time() - cpu0
        last_split["clients"] -= cpu_s  # this process is the server here, not a client
        return elapsed, cpu_s
    finally:
        await services.db.dispose()


async def bench_http_floor(plans: list[SessionPlan], clients: int,
                           wire: str) -> tuple[float, float]:
    """(wall seconds, server CPU seconds) of the same requests to `bench.http_floor`
    (uvicorn reading the body, nothing else)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "bench.http_floor:app", "--port", str(port),
         "--log-level", "warning", "--no-access-log"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                async with RawHttp(base) as probe:
                    await probe.post_json("/readyz", b"{}")
                break
            except OSError:
                await asyncio.sleep(0.1)
        connections = [RawHttp(base) for _ in range(clients)]
        for conn in connections:
            await conn.__aenter__()

        async def work(i: int, plan: SessionPlan) -> None:
            for turn in plan.turns:
                status, _reply = await connections[i].post_json("/turns", *on_wire(turn, wire))
                assert status == 201

        cpu0 = cpu_seconds(proc.pid)
        try:
            elapsed = await run_workers(plans, clients, work)
            return elapsed, cpu_seconds(proc.pid) - cpu0
        finally:
            for conn in connections:
                await conn.__aexit__()
    finally:
        stop_server(proc)


async def bench_naive(url: str, plans: list[SessionPlan], clients: int) -> float:
    pool = await asyncpg.create_pool(pg_dsn(url), min_size=clients, max_size=clients)
    await pool.execute("CREATE TABLE records (id bigserial PRIMARY KEY, session_id text, "
                       "seq int, record jsonb)")

    async def work(_i: int, plan: SessionPlan) -> None:
        for seq, turn in enumerate(plan.turns):
            await pool.execute("INSERT INTO records (session_id, seq, record) "
                               "VALUES ($1, $2, $3::jsonb)", plan.session_id, seq,
                               turn.body.decode())

    try:
        return await run_workers(plans, clients, work)
    finally:
        await pool.close()


async def bench_floor(url: str, plans: list[SessionPlan], clients: int) -> float:
    pool = await asyncpg.create_pool(pg_dsn(url), min_size=clients, max_size=clients)
    await pool.execute("CREATE TABLE turns (session_id text, seq int, tokens bytea, r3 bytea, "
                       "PRIMARY KEY (session_id, seq))")
    await pool.execute("ALTER TABLE turns ALTER COLUMN r3 SET STORAGE EXTERNAL")

    async def work(_i: int, plan: SessionPlan) -> None:
        for seq, turn in enumerate(plan.turns):
            await pool.execute("INSERT INTO turns VALUES ($1, $2, $3, $4)", plan.session_id,
                               seq, turn.token_delta, turn.r3_narrow)

    try:
        return await run_workers(plans, clients, work)
    finally:
        await pool.close()


async def stored_bytes(url: str, tables: tuple[str, ...]) -> int:
    conn = await asyncpg.connect(pg_dsn(url))
    try:
        await conn.execute("CHECKPOINT")
        total = 0
        for table in tables:
            total += int(await conn.fetchval("SELECT pg_total_relation_size($1)", table))
        return total
    finally:
        await conn.close()


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (uvicorn's worker processes with `--workers N`)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError):  # the process ended meanwhile
                todo += [int(c) for c in (task / "children").read_text().split()]
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants (/proc/<pid>/stat)."""
    total = 0.0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):  # the process ended meanwhile
            total += cpu_seconds_of(member)
    return total


def machine_cpu() -> dict[str, float]:
    """CPU seconds so far: the whole machine busy, and its idle; every PostgreSQL
    process (the benchmark's cluster is the only one it starts); this process (the
    clients). Two snapshots' difference splits a phase's CPU by who spent it."""
    ticks = os.sysconf("SC_CLK_TCK")
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    postgres = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if (entry / "comm").read_text().strip() == "postgres":
                postgres += cpu_seconds_of(int(entry.name))
    own = os.times()
    return {"busy": (sum(fields[:8]) - idle) / ticks, "idle": idle / ticks,
            "postgres": postgres, "clients": own.user + own.system}


def cpu_seconds_of(pid: int) -> float:
    """User + system CPU seconds of `pid` alone."""
    return sum(cpu_split(pid))


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


async def big_turn_memory(url: str, megabytes: float) -> list[tuple[str, int, int]]:
    """(wire, body bytes, peak RSS growth in bytes) for one turn of ~`megabytes` MB."""
    tokens = int(megabytes * 1e6 / 2150)
    rng = np.random.default_rng(11)
    out: list[tuple[str, int, int]] = []
    proc, base = await start_server(url, 1)
    try:
        async with RawHttp(base) as http:
            for wire in ("json", "msgpack", "narrow"):
                plan = make_session(rng, 1, tokens)
                turn = plan.turns[0]
                body, kind = on_wire(turn, wire)
                status, reply = await http.post_json("/v1/sessions", plan.open_body)
                assert status == 201, reply
                before = rss_kib(proc.pid, "VmRSS")
                Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # reset VmHWM
                status, reply = await http.post_json(
                    f"/v1/sessions/{plan.session_id}/turns", body, kind)
                assert status == 201, reply[:300]
                peak = rss_kib(proc.pid, "VmHWM")
                out.append((wire, len(body), (peak - before) * 1024))
                del plan, turn, body
    finally:
        stop_server(proc)
    return out


async def wal_syncs(server: Any) -> int:
    """WAL fsyncs of the whole (benchmark's own) cluster so far (pg_stat_wal)."""
    conn = await asyncpg.connect(pg_dsn(server.url))
    try:
        return int(await conn.fetchval("SELECT wal_sync FROM pg_stat_wal"))
    finally:
        await conn.close()


async def transactions_per_turn(url: str) -> float:
    """Write transactions per stored turn: distinct transaction ids of the turn events
    (1.0 = one transaction per append; below 1 = appends shared commits)."""
    conn = await asyncpg.connect(pg_dsn(url))
    try:
        return float(await conn.fetchval(
            "SELECT count(DISTINCT xid)::float8 / count(*) FROM events "
            "WHERE type = 'turn_recorded'"))
    finally:
        await conn.close()


async def clients_curve(server: Any, rng: np.random.Generator, args: argparse.Namespace,
                        counts: list[int]) -> None:
    """turns/s of MessagePack turnlog (1 worker) and of the floor at each client count;
    with `--group-commit`, turnlog once per group-commit window, with the write
    transactions and the WAL fsyncs per turn."""
    from app.store.engine import migrate

    windows: list[int | None] = ([int(w) for w in args.group_commit.split(",")]
                                 if args.group_commit else [None])
    most = max(max(counts), args.sessions)
    print(f"\nclients curve: generating {most} sessions x {args.curve_turns} turns ...",
          flush=True)
    pool = [make_session(rng, args.curve_turns, args.new_tokens) for _ in range(most)]
    kinds = ["turnlog" if w is None else f"gc={w}us" for w in windows]
    print(f"{'clients':>7s} " + " ".join(f"{k + '/s':>12s} {'x floor':>7s} {'CPU ms':>7s} "
                                         f"{'xacts/turn':>10s} {'fsyncs/turn':>11s}"
                                         for k in kinds)
          + f" {'floor/s':>9s}")
    for clients in counts:
        plans = pool[:max(clients, args.sessions)]
        turns = sum(len(p.turns) for p in plans)
        best: dict[str, float] = {}
        cpu_best: dict[str, float] = {}
        fsyncs: dict[str, float] = {}
        xacts: dict[str, float] = {}
        for _ in range(args.rounds):
            for kind, window in [*zip(kinds, windows, strict=True), ("floor", None)]:
                url = create_database(server, f"bench_curve_{uuid.uuid4().hex[:6]}")
                if kind != "floor":
                    await migrate.upgrade_async(url)
                    settings = (None if window is None
                                else {"TURNLOG_GROUP_COMMIT_WINDOW_US": str(window)})
                    before = await wal_syncs(server)
                    elapsed, cpu_s = await bench_turnlog(url, plans, clients, 1,
                                                         args.curve_wire, settings=settings)
                    await asyncio.sleep(0.5)  # the server's backends report as they exit
                    fsyncs[kind] = (await wal_syncs(server) - before) / turns
                    xacts[kind] = await transactions_per_turn(url)
                    cpu_best[kind] = min(cpu_best.get(kind, cpu_s), cpu_s)
                else:
                    elapsed = await bench_floor(url, plans, clients)
                drop_database(server, url.rsplit("/", 1)[1])
                best[kind] = min(best.get(kind, elapsed), elapsed)
        print(f"{clients:7d} " + " ".join(
            f"{turns / best[k]:12.1f} {best['floor'] / best[k]:7.2f} "
            f"{cpu_best[k] / turns * 1e3:7.2f} {xacts[k]:10.2f} {fsyncs[k]:11.2f}"
            for k in kinds)
            + f" {turns / best['floor']:9.1f}", flush=True)


async def sqlite_phases(args: argparse.Namespace, wires: list[str]) -> None:
    """`--sqlite`: the turnlog phases (1 worker, SQLite has one writer) against fresh
    SQLite files, this checkout and the `--baseline` one interleaved."""
    from app.store.engine import migrate

    rng = np.random.default_rng(7)
    plans = [make_session(rng, args.turns, args.new_tokens) for _ in range(args.sessions)]
    turns = sum(len(p.turns) for p in plans)
    phases = [(wire, None) for wire in wires]
    if args.baseline:
        phases += [(f"{wire} base", args.baseline) for wire in wires]
    best: dict[str, tuple[float, float]] = {}
    for round_no in range(1, args.rounds + 1):
        print(f"round {round_no}/{args.rounds}", flush=True)
        for name, root in phases:
            path = Path(f"/tmp/turnlog-bench-ingest-{uuid.uuid4().hex[:6]}.db")
            url = f"sqlite+aiosqlite:///{path}"
            await migrate.upgrade_async(url)
            try:
                elapsed, cpu_s = await bench_turnlog(url, plans, args.clients, 1,
                                                     name.split()[0], args.py_spy, root)
            finally:
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{path}{suffix}").unlink(missing_ok=True)
            old = best.get(name, (elapsed, cpu_s))
            best[name] = (min(old[0], elapsed), min(old[1], cpu_s))
            print(f"  {name:12s} {elapsed:7.2f} s  {turns / elapsed:8.1f} turns/s  "
                  f"server CPU {cpu_s / turns * 1e3:.2f} ms/turn", flush=True)
    print()
    print(f"{'SQLite':12s} {'turns/s':>9s} {'server CPU ms/turn':>19s}   (best of each)")
    for name, (elapsed, cpu_s) in best.items():
        print(f"{name:12s} {turns / elapsed:9.1f} {cpu_s / turns * 1e3:19.2f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres-url", help="admin URL of a PostgreSQL server "
                        "(default: a throwaway cluster from the installed binaries)")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--workers", default="1",
                        help="turnlog server processes, a comma-separated list (e.g. 1,2)")
    parser.add_argument("--wires", default="json,msgpack,narrow",
                        help="json (base64 R3), msgpack (R3 as int32 bytes), narrow "
                             "(R3 as uint8 values: what TurnlogClient sends by default)")
    parser.add_argument("--curve-wire", default="narrow", help="the wire of --curve")
    parser.add_argument("--big-turn-mb", type=float, default=100,
                        help="peak memory on one turn of this many MB (0: skip)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="run every phase this many times, interleaved; keep each "
                             "phase's best (other load on the machine only slows a phase)")
    parser.add_argument("--py-spy", metavar="DIR",
                        help="record a py-spy profile of each turnlog phase into DIR")
    parser.add_argument("--curve", metavar="CLIENTS",
                        help="also run MessagePack turnlog (1 worker) and the floor at each of "
                             "these client counts, e.g. 1,4,16,64 (one session per client, at "
                             "least --sessions; --curve-turns turns each)")
    parser.add_argument("--curve-turns", type=int, default=4)
    parser.add_argument("--group-commit", metavar="WINDOWS_US",
                        help="run the curve's turnlog once per TURNLOG_GROUP_COMMIT_WINDOW_US "
                             "value, e.g. 0,1000 (0 = one transaction per append; default: "
                             "the server's setting)")
    parser.add_argument("--baseline", metavar="DIR", type=Path,
                        help="also run the turnlog phases (1 worker) with the checkout in DIR "
                             "(its own .venv), e.g. the code before a change: phases "
                             "'<wire> base' in the same run")
    parser.add_argument("--baseline-revision", default="0007",
                        help="the migration the --baseline checkout's schema stops at")
    parser.add_argument("--in-process", metavar="WINDOWS_US",
                        help="also append the MessagePack turns in this process through the "
                             "store's services (no HTTP), once per group commit window, "
                             "e.g. 0,1000: phases 'inproc gc<window>'")
    parser.add_argument("--fast-unsafe", action="store_true",
                        help="keep the test cluster's fsync=off (default: durable settings)")
    add_warm_wal_option(parser)
    parser.add_argument("--sqlite", action="store_true",
                        help="only the turnlog phases (and --baseline), each on a fresh SQLite "
                             "file: turns/s and server CPU per turn, no references")
    args = parser.parse_args()
    if args.py_spy:
        py_spy_exe()  # missing: say so now, before any server starts
        Path(args.py_spy).mkdir(parents=True, exist_ok=True)  # py-spy writes no folder
    worker_counts = [int(w) for w in args.workers.split(",")]
    wires = args.wires.split(",")
    if args.sqlite:
        await sqlite_phases(args, wires)
        return

    server = postgres(args.postgres_url, durable=not args.fast_unsafe)
    WAL_DSN.append(pg_dsn(server.url))
    print(f"PostgreSQL: {await show_durability(server.url)}", flush=True)
    await warm_wal_for(args, server.url)
    rng = np.random.default_rng(7)
    print(f"generating {args.sessions} sessions x {args.turns} turns ...", flush=True)
    plans = [make_session(rng, args.turns, args.new_tokens) for _ in range(args.sessions)]
    turns = sum(len(p.turns) for p in plans)
    rows = sum(t.r3_rows for p in plans for t in p.turns)
    raw_r3 = rows * LAYERS * TOPK * 4
    body_mb = sum(len(t.body) for p in plans for t in p.turns) / 1e6
    packed_mb = sum(len(t.msgpack) for p in plans for t in p.turns) / 1e6
    narrow_mb = sum(len(t.narrow) for p in plans for t in p.turns) / 1e6
    print(f"{turns} turns, {rows} R3 rows, raw int32 R3 {raw_r3 / 1e6:.1f} MB, "
          f"request bodies {body_mb:.1f} MB JSON / {packed_mb:.1f} MB MessagePack / "
          f"{narrow_mb:.1f} MB narrowed", flush=True)

    from app.store.engine import migrate

    results: dict[str, tuple[float, int]] = {}
    cpu: dict[str, float] = {}
    splits: dict[str, dict[str, float]] = {}
    phases: list[tuple[str, Any]] = []
    for workers in worker_counts:
        for wire in wires:
            phases.append((f"{wire} w{workers}", ("turnlog", wire, workers)))
    if args.baseline:
        for wire in wires:
            phases.append((f"{wire} base", ("baseline", wire, 1)))
    if args.in_process:
        phases += [(f"inproc gc{w}", ("inproc", None, int(w)))
                   for w in args.in_process.split(",")]
    phases += [("naive", ("naive", None, 0)), ("floor", ("floor", None, 0))]
    phases += [(f"http {wire}", ("http", wire, 1)) for wire in wires]
    for round_no in range(1, args.rounds + 1):
        print(f"round {round_no}/{args.rounds}", flush=True)
        for name, (kind, wire, workers) in phases:
            size = 0
            if kind == "http":
                elapsed, cpu_s = await bench_http_floor(plans, args.clients, wire)
                cpu[name] = min(cpu.get(name, cpu_s), cpu_s)
            else:
                url = create_database(server, f"bench_{kind}_{uuid.uuid4().hex[:6]}")
                if kind == "inproc":
                    await migrate.upgrade_async(url)
                    elapsed, cpu_s = await bench_in_process(url, plans, args.clients, workers)
                    cpu[name] = min(cpu.get(name, cpu_s), cpu_s)
                    tables: tuple[str, ...] = TURNLOG_TABLES
                elif kind in ("turnlog", "baseline"):
                    root = args.baseline if kind == "baseline" else None
                    # The other checkout knows only the revisions it ships.
                    await migrate.upgrade_async(url, "head" if root is None else
                                                args.baseline_revision)
                    elapsed, cpu_s = await bench_turnlog(url, plans, args.clients, workers,
                                                         wire, args.py_spy, root)
                    cpu[name] = min(cpu.get(name, cpu_s), cpu_s)
                    tables = TURNLOG_TABLES
                elif kind == "naive":
                    elapsed, tables = await bench_naive(url, plans, args.clients), ("records",)
                else:
                    elapsed, tables = await bench_floor(url, plans, args.clients), ("turns",)
                size = await stored_bytes(url, tables)
                drop_database(server, url.rsplit("/", 1)[1])
            if name not in results or elapsed < results[name][0]:
                results[name] = (elapsed, size)
                splits[name] = dict(last_split)
            print(f"  {name:12s} {elapsed:7.2f} s", flush=True)

    print()
    print(f"{'store':12s} {'turns/s':>9s} {'R3 MB/s':>9s} {'stored/raw':>11s} "
          f"{'x floor':>8s} {'x naive':>8s} {'server CPU ms/turn':>19s}")
    t_naive, t_floor = results["naive"][0], results["floor"][0]
    for name, (elapsed, size) in results.items():
        stored = f"{size / raw_r3:11.3f}" if size else f"{'-':>11s}"
        print(f"{name:12s} {turns / elapsed:9.2f} {raw_r3 / 1e6 / elapsed:9.1f} "
              f"{stored} {t_floor / elapsed:8.2f} {t_naive / elapsed:8.2f} "
              f"{(f'{cpu[name] / turns * 1e3:.2f}' if name in cpu else '-'):>19s}")
    print()
    print("the machine's CPU per turn (ms) in each phase's best round, by who spent it "
          "(server: turnlog or uvicorn; clients: this process)")
    print(f"{'phase':12s} {'busy':>7s} {'server':>7s} {'postgres':>9s} {'clients':>8s} "
          f"{'other':>7s} {'idle':>7s} {'WAL MB':>7s}")
    for name, split in splits.items():
        server_ms = cpu.get(name, 0.0) / turns * 1e3 if name in cpu else 0.0
        per = {key: value / turns * 1e3 for key, value in split.items()}
        other = per["busy"] - server_ms - per["postgres"] - per["clients"]
        print(f"{name:12s} {per['busy']:7.2f} {server_ms:7.2f} {per['postgres']:9.2f} "
              f"{per['clients']:8.2f} {other:7.2f} {per['idle']:7.2f} "
              f"{split.get('wal_bytes', 0) / turns / 1e6:7.2f}")
    print()
    for name, (elapsed, _size) in results.items():
        if name.endswith("base"):
            print(f"turnlog {name} (--baseline) / floor:  {t_floor / elapsed:.2f}   "
                  f"server CPU {cpu[name] / turns * 1e3:.2f} ms/turn")
        elif name.startswith(("msgpack", "narrow")):
            print(f"turnlog MessagePack ({name}) / floor: {t_floor / elapsed:.2f}   "
                  f"(target >= 0.5); server CPU {cpu[name] / turns * 1e3:.2f} ms/turn "
                  f"(target <= 4)")
        elif name.startswith("json"):
            print(f"turnlog JSON ({name}) / floor:        {t_floor / elapsed:.2f}   "
                  f"(target >= 0.3); server CPU {cpu[name] / turns * 1e3:.2f} ms/turn")
    for wire in wires:
        if f"http {wire}" in results:
            print(f"uvicorn receiving the {wire} bodies alone / floor: "
                  f"{t_floor / results[f'http {wire}'][0]:.2f}   (no parsing, no storing)")
    some = next(name for name in results if name[:4] in ("json", "msgp", "narr"))
    print(f"turnlog bytes stored: {results[some][1] / raw_r3:.3f} x raw int32 R3   "
          f"(target <= 0.3)")

    if args.curve:
        await clients_curve(server, rng, args, [int(c) for c in args.curve.split(",")])

    if args.big_turn_mb > 0:
        url = create_database(server, f"bench_big_{uuid.uuid4().hex[:6]}")
        await migrate.upgrade_async(url)
        print()
        for wire, size, growth in await big_turn_memory(url, args.big_turn_mb):
            print(f"one {size / 1e6:.0f} MB {wire} turn: server peak RSS growth "
                  f"{growth / 1e6:.0f} MB = {growth / size:.2f}x the body   (target <= 3x)")


if __name__ == "__main__":
    asyncio.run(main())
