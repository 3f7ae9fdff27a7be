"""Plumbing shared by the benchmarks: a PostgreSQL server and a `turnlog serve` process."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.pg import PostgresServer, start_postgres  # noqa: E402
from tests.serverproc import free_port  # noqa: E402, F401 (the benches import it from here)

# Production durability for a benchmark's own cluster. Given on the cluster's command
# line: `ALTER SYSTEM` cannot override the test clusters' `-c fsync=off` (command-line
# options rank above postgresql.auto.conf), so a cluster started for the tests stays
# fsync off whatever is set afterwards.
DURABLE = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}


def postgres(url: str | None, durable: bool = False) -> PostgresServer:
    """The server at `url`, else a throwaway cluster from the installed binaries
    (`durable`: started with fsync, synchronous commit and full-page writes on)."""
    if url:
        return PostgresServer(url=str(make_url(url).set(drivername="postgresql+asyncpg")),
                              source="env")
    if durable:
        from tests.pg.cluster import start_cluster

        return PostgresServer(url=start_cluster(DURABLE).url(), source="binaries")
    return start_postgres()


async def show_durability(url: str) -> str:
    """`fsync=on, synchronous_commit=on, ...` as the server reports them (printed by
    every benchmark, so a figure says what it was measured with)."""
    import asyncpg

    conn = await asyncpg.connect(pg_dsn(url))
    try:
        return ", ".join([f"{name}={await conn.fetchval(f'SHOW {name}')}" for name in DURABLE])
    finally:
        await conn.close()


# A fresh cluster differs from a server in service in two ways that cost a recorded
# turn here. Its WAL has only the segments initdb made: each further 16 MB segment is
# created and zero-filled (and fsynced) by the backend that first needs it, a 30-50 ms
# stall every ~18 recorded 2k-token turns; a server in service renames the segments a
# checkpoint retired instead. And its shared buffers were never touched: each first
# use of one of their pages is a page fault (~0.7-0.9 ms of a backend's CPU per 0.8 MB
# R3 patch here, measured). So a benchmark that starts its own cluster first writes
# this much WAL, reads it through the shared buffers (`pg_prewarm`) and checkpoints it
# away: the figures are a running server's, not a just-initialized one's.
WARM_WAL_MB = 384


async def warm_wal(url: str, megabytes: int = WARM_WAL_MB) -> str:
    """Write ~`megabytes` of WAL in a scratch table, read the table through the shared
    buffers, and checkpoint twice, so PostgreSQL keeps that many recycled segments
    ready and no buffer is touched for the first time later; returns a line saying
    what was done."""
    import time

    import asyncpg

    if megabytes <= 0:
        return ("WAL not warmed (--warm-wal-mb 0): a fresh cluster creates each segment "
                "and touches each shared buffer for the first time while measured")
    conn = await asyncpg.connect(pg_dsn(url))
    started = time.perf_counter()
    try:
        # ~330 bytes of WAL per row (tuple, header, the page's share).
        rows = megabytes * 1024 * 1024 // 330
        await conn.execute("DROP TABLE IF EXISTS bench_warm_wal")
        await conn.execute("CREATE TABLE bench_warm_wal AS SELECT g, repeat(md5(g::text), 8) "
                           f"AS s FROM generate_series(1, {rows}) g")
        try:
            # Larger than the default shared_buffers: every buffer is used once.
            await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
            blocks = await conn.fetchval("SELECT pg_prewarm('bench_warm_wal')")
            buffers = f"{blocks} blocks read through the shared buffers"
        except asyncpg.PostgresError as exc:  # no contrib modules: say so, go on
            buffers = f"shared buffers not prewarmed ({type(exc).__name__})"
        await conn.execute("CHECKPOINT")
        await conn.execute("DROP TABLE bench_warm_wal")
        await conn.execute("CHECKPOINT")
        segments = await conn.fetchval("SELECT count(*) FROM pg_ls_waldir()")
    finally:
        await conn.close()
    return (f"warmed: {megabytes} MB of WAL written and checkpointed, {buffers}, in "
            f"{time.perf_counter() - started:.1f} s; {segments} WAL segments ready to "
            "recycle")


def add_warm_wal_option(parser: argparse.ArgumentParser) -> None:
    """`--warm-wal-mb`, read by `warm_wal_for`."""
    parser.add_argument("--warm-wal-mb", type=int, default=None, metavar="MB",
                        help="before measuring, write MB of WAL, read it through the "
                             "shared buffers and checkpoint it, so new WAL segments are "
                             "recycled ones and every buffer was used, as on a server in "
                             "service "
                             f"(default {WARM_WAL_MB} on the cluster the bench starts, 0 on "
                             "--postgres-url's; 0: measure a fresh cluster)")


async def warm_wal_for(args: argparse.Namespace, url: str) -> None:
    """`warm_wal` as `--warm-wal-mb` asks (a server of the caller's is left alone unless
    asked), printing what was done."""
    megabytes = args.warm_wal_mb if args.warm_wal_mb is not None else \
        (0 if args.postgres_url else WARM_WAL_MB)
    print(await warm_wal(url, megabytes), flush=True)


def pg_dsn(url: str) -> str:
    """An asyncpg DSN (no SQLAlchemy driver suffix) for a `postgresql+asyncpg://` URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def py_spy_exe() -> str:
    """py-spy next to this Python (the `bench` extra installs it there) or on PATH; a
    clear exit before anything is started when it is neither."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.exists():
        return str(beside)
    found = shutil.which("py-spy")
    if found is None:
        raise SystemExit("--py-spy needs py-spy: `.venv/bin/pip install -e '.[bench]'` "
                         "(or `pip install py-spy`)")
    return found


def start_py_spy(out: str, pid: int, *extra: str) -> subprocess.Popen[bytes]:
    """py-spy recording process `pid` into `out` (raw format, 200 samples/s, or
    `$PY_SPY_RATE`: a short phase needs more for a profile worth reading) until it
    gets SIGINT. `--gil` among `extra`: only the thread holding the GIL is sampled,
    i.e. where the Python CPU goes (worker threads waiting for work are left out)."""
    rate = os.environ.get("PY_SPY_RATE", "200")
    # `$PY_SPY_FLAGS` replaces the caller's flags, e.g. `--subprocesses --native` for
    # C frames in every thread (where CPU goes with the GIL released).
    extra = tuple(os.environ["PY_SPY_FLAGS"].split()) if os.environ.get("PY_SPY_FLAGS") \
        else extra
    return subprocess.Popen([py_spy_exe(), "record", "--format", "raw", "--rate", rate,
                             *extra, "-p", str(pid), "-o", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def start_server(url: str, workers: int = 1, root: Path | None = None,
                       settings: dict[str, str] | None = None,
                       ) -> tuple[subprocess.Popen[bytes], str]:
    """`turnlog serve` on a free loopback port; returns once `/readyz` answers 200.

    `root`: another checkout of turnlog (with its own `.venv`) to run instead of
    this one, e.g. the code before a change, for a comparison within one run.
    `settings`: `TURNLOG_*` variables for this server only.
    """
    port = free_port()
    python, env = sys.executable, dict(os.environ, TURNLOG_DATABASE_URL=url)
    env.update(settings or {})
    if root is not None:
        python = str(root / ".venv" / "bin" / "python")
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # leave the other checkout as it is
    proc = subprocess.Popen(
        [python, "-m", "app", "serve", "--port", str(port), "--workers", str(workers)],
        cwd=root or ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        for _ in range(600):
            try:
                if (await http.get("/readyz")).status_code == 200:
                    return proc, base
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    proc.terminate()
    raise RuntimeError("turnlog did not become ready within 60 s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(10)


class RawHttp:
    """A minimal keep-alive HTTP/1.1 client for load generation (like wrk).

    The benchmarks measure the server, so the load generator must cost almost
    nothing: requests are pre-encoded bytes written straight to the socket and
    replies are read by Content-Length. Not a general client.
    """

    def __init__(self, base: str) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> RawHttp:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port,
                                                                 limit=1 << 20)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self.writer is not None
        self.writer.close()

    async def post_json(self, path: str, body: bytes,
                        content_type: str = "application/json") -> tuple[int, bytes]:
        assert self.reader is not None and self.writer is not None
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n")
        self.writer.write(head.encode("ascii"))
        self.writer.write(body)
        await self.writer.drain()
        status_line = await self.reader.readuntil(b"\r\n")
        status = int(status_line.split()[1])
        length = 0
        while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process `pid` so far (all its threads, not its
    children), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    hz = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / hz, int(fields[12]) / hz
