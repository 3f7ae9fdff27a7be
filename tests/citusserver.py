"""A throwaway Citus cluster for the test suite: one coordinator and two workers on loopback.

Built like the throwaway PostgreSQL of `tests/pgserver.py` (whose helpers it imports):
three clusters from the PostgreSQL 15 server binaries, `initdb` and `pg_ctl` run as the
`postgres` OS user when this process is root, each node with
`shared_preload_libraries = 'citus'`. Every database handed out gets `CREATE EXTENSION
citus` on all three nodes and is then registered on the coordinator
(`citus_set_coordinator_host`, `citus_add_node` per worker) — Citus metadata is per
database.

When Citus is not installed, `tests/citus/install.sh` (a copy of the Citus 13.2.2
extension for Debian 12's PostgreSQL 15, AGPL-3.0, see `tests/citus/LICENSE.citus`) is
run; it needs root. Its exit code 3 means "not applicable on this machine" (no
PostgreSQL 15, not x86_64): then :class:`CitusUnavailable` is raised and the Citus tier
skips with that reason. Any other failure raises :class:`RuntimeError`: the tier fails.

The cluster uses 4 shards per distributed table (production default: 32) so that a
fresh test database migrates in seconds; the routing, colocation and fencing are the same.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL, make_url

from tests.pg.admin import _terminate_and_drop
from tests.pg.admin import connect as _connect
from tests.pg.admin import quote_ident as _quote_ident
from tests.pg.admin import run_in_thread as _run_in_thread
from tests.pg.binaries import as_postgres_user as _as_postgres_user
from tests.pg.binaries import ensure_os_user as _ensure_os_user
from tests.pg.binaries import run as _run
from tests.pg.cluster import (
    PG_CTL_TIMEOUT_S,
    _free_port,
    _make_base_dir,
    _read_postmaster_pid,
    _set_child_subreaper,
    _stop_cluster,
    _tail,
)
from tests.pg.common import DB_SUPERUSER, MAINTENANCE_DB


@dataclass
class _Cluster:
    """One node's data directory and postmaster, stopped by its owner process only."""

    pg_ctl: str
    base: Path
    owner_pid: int
    postmaster_pid: int | None = None

    def cleanup(self) -> None:
        if os.getpid() != self.owner_pid:  # forked child: not ours to stop
            return
        _stop_cluster(self.pg_ctl, self.base, self.postmaster_pid)


__all__ = ["CitusCluster", "CitusUnavailable", "create_citus_database",
           "start_citus"]

BINDIR = Path("/usr/lib/postgresql/15/bin")
INSTALLER = Path(__file__).resolve().parent / "citus" / "install.sh"
NOT_APPLICABLE = 3
WORKERS = 2
SHARD_COUNT = 4


class CitusUnavailable(Exception):
    """Citus cannot run on this machine at all (the installer said so): skip the tier."""


@dataclass(frozen=True)
class CitusCluster:
    """Admin URLs (maintenance database) of the coordinator and the workers."""

    coordinator: str
    workers: tuple[str, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.coordinator, *self.workers)


_lock = threading.Lock()
_cluster: CitusCluster | None = None
_failure: Exception | None = None


def start_citus() -> CitusCluster:
    """The process's Citus cluster, started on first use (a failure is cached too)."""
    global _cluster, _failure
    with _lock:
        if _cluster is not None:
            return _cluster
        if _failure is not None:
            raise _failure
        try:
            ensure_installed()
            _cluster = _start()
        except (CitusUnavailable, RuntimeError) as exc:
            _failure = exc
            raise
        return _cluster


def ensure_installed() -> None:
    """Install the bundled extension unless PostgreSQL 15 already has it."""
    pg_config = BINDIR / "pg_config"
    if pg_config.exists():
        libdir = subprocess.run([str(pg_config), "--pkglibdir"], capture_output=True,
                                text=True, check=False, stdin=subprocess.DEVNULL).stdout.strip()
        if libdir and (Path(libdir) / "citus.so").exists():
            return
    proc = subprocess.run(["bash", str(INSTALLER)], capture_output=True, text=True,
                          check=False, stdin=subprocess.DEVNULL, timeout=300)
    reason = (proc.stderr or proc.stdout).strip()
    if proc.returncode == NOT_APPLICABLE:
        raise CitusUnavailable(f"Citus does not apply on this machine: {reason}")
    if proc.returncode != 0:
        hint = "" if os.geteuid() == 0 else " (it must run as root)"
        raise RuntimeError(f"{INSTALLER} failed with exit {proc.returncode}{hint}: {reason}")


def start_durable_citus() -> CitusCluster:
    """A Citus cluster of its own with production durability (fsync, synchronous
    commit and full-page writes on), for benchmarks: the test cluster's `-c fsync=off`
    on the command line outranks any `ALTER SYSTEM`. Not cached; stopped at exit."""
    ensure_installed()
    return _start(durable=True)


def _start(durable: bool = False) -> CitusCluster:
    initdb, pg_ctl = str(BINDIR / "initdb"), str(BINDIR / "pg_ctl")
    if os.geteuid() == 0:
        _ensure_os_user()
        _as_postgres_user(["true"])
    clusters: list[tuple[str, _Cluster]] = []
    template: Path | None = None
    # Every data directory is made before any node starts: a copy of a running
    # cluster's directory would carry its postmaster.pid.
    for role in ("coordinator", *(f"worker{i}" for i in range(1, WORKERS + 1))):
        base = _make_base_dir()
        cluster = _Cluster(pg_ctl=pg_ctl, base=base, owner_pid=os.getpid())
        atexit.register(cluster.cleanup)
        data = base / "data"
        if template is None:
            proc = _run([initdb, "-D", str(data), "-A", "trust", "-U", DB_SUPERUSER,
                         "--no-sync", "-E", "UTF8", "--locale=C"], cwd=base, timeout=180)
            if proc.returncode != 0:
                raise RuntimeError(f"initdb for the Citus {role} failed: {proc.stderr}")
            template = data
        else:
            # A copy of a fresh, stopped data directory is a valid new cluster.
            proc = _run(["cp", "-a", str(template), str(data)], cwd=base, timeout=180)
            if proc.returncode != 0:
                raise RuntimeError(f"copying the Citus {role}'s data failed: {proc.stderr}")
        clusters.append((role, cluster))
    urls = [_pg_start(pg_ctl, cluster, role, durable) for role, cluster in clusters]
    return CitusCluster(coordinator=urls[0], workers=tuple(urls[1:]))


def _pg_start(pg_ctl: str, cluster: _Cluster, role: str, durable: bool = False) -> str:
    data, log = cluster.base / "data", cluster.base / "postgres.log"
    durability = "on" if durable else "off"
    errors: list[str] = []
    for _attempt in range(3):  # a free port can be taken by someone else in between
        port = _free_port()
        options = (
            f"-p {port} -k {shlex.quote(str(cluster.base))} -c listen_addresses=127.0.0.1 "
            f"-c shared_preload_libraries=citus -c fsync={durability} "
            f"-c synchronous_commit={durability} -c full_page_writes={durability} "
            "-c max_connections=300 -c max_prepared_transactions=300 "
            f"-c citus.shard_count={SHARD_COUNT} -c citus.log_distributed_deadlock_detection=off "
            # Two-phase commit records stay in pg_dist_transaction (recovery would clean
            # them up every minute): tests count them to prove an append needs none.
            "-c citus.recover_2pc_interval=-1 "
            # No TLS on loopback: `CREATE EXTENSION citus` turns SSL on with a self-signed
            # certificate unless `ssl_ciphers` is 'none', and then every connection (the
            # tests' and the coordinator's to its workers) pays a handshake and
            # encryption: ~4 % of a test process's CPU in a profile of the suite.
            "-c ssl_ciphers=none -c citus.node_conninfo=sslmode=disable"
        )
        subreaper = _set_child_subreaper(True)
        try:
            proc = _run([pg_ctl, "-D", str(data), "-l", str(log), "-w", "-t",
                         str(PG_CTL_TIMEOUT_S), "-o", options, "start"],
                        cwd=cluster.base, timeout=PG_CTL_TIMEOUT_S + 30)
        finally:
            if subreaper:
                _set_child_subreaper(False)
        if subreaper:
            cluster.postmaster_pid = _read_postmaster_pid(data)
        if proc.returncode == 0:
            return URL.create("postgresql+asyncpg", username=DB_SUPERUSER, host="127.0.0.1",
                              port=port, database=MAINTENANCE_DB
                              ).render_as_string(hide_password=False)
        errors.append(f"{role} on port {port}: {proc.stderr.strip()}\n{_tail(log)}")
        with contextlib.suppress(Exception):
            _run([pg_ctl, "-D", str(data), "-m", "immediate", "stop"], cwd=cluster.base,
                 timeout=60)
    raise RuntimeError("could not start the Citus " + role + ":\n" + "\n".join(errors))


def create_citus_database(cluster: CitusCluster, name: str) -> str:
    """A fresh database with Citus on every node, workers registered; its coordinator URL."""
    ident = _quote_ident(name)

    async def work() -> None:
        for node in cluster.nodes:
            conn: Any = await _connect(make_url(node))
            try:
                await _terminate_and_drop(conn, name, ident)
                await conn.execute(f"CREATE DATABASE {ident} TEMPLATE template0 ENCODING 'UTF8'")
            finally:
                await conn.close()
            conn = await _connect(make_url(node).set(database=name))
            try:
                await conn.execute("CREATE EXTENSION citus")
            finally:
                await conn.close()
        coordinator = make_url(cluster.coordinator)
        conn = await _connect(coordinator.set(database=name))
        try:
            await conn.execute("SELECT citus_set_coordinator_host('127.0.0.1', $1)",
                               coordinator.port)
            for worker in cluster.workers:
                await conn.execute("SELECT citus_add_node('127.0.0.1', $1)",
                                   make_url(worker).port)
        finally:
            await conn.close()

    _run_in_thread(work)
    return make_url(cluster.coordinator).set(database=name).render_as_string(
        hide_password=False)
