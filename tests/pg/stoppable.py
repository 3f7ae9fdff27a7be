"""A private cluster that a fault test may crash (`pg_ctl stop -m immediate`) and start again.

Built on `start_cluster`; restarting reuses the same port and settings, so a
client's URL stays valid across the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from tests.pg.binaries import run
from tests.pg.cluster import (
    PG_CTL_TIMEOUT_S,
    TEST_SETTINGS,
    Cluster,
    _read_postmaster_pid,
    _reap_child,
    _set_child_subreaper,
    _tail,
    start_cluster,
)
from tests.pg.common import Unavailable

# An immediate stop is a crash: what was acknowledged must be in the WAL on disk.
SETTINGS = {**TEST_SETTINGS, "synchronous_commit": "on"}


@dataclass
class StoppableCluster:
    cluster: Cluster

    @property
    def port(self) -> int:
        return self.cluster.port

    @property
    def url(self) -> str:
        return self.cluster.url()

    def start(self) -> None:
        c = self.cluster
        options = f"-p {c.port} -k {shlex.quote(str(c.base))} " + " ".join(
            f"-c {shlex.quote(f'{name}={value}')}" for name, value in SETTINGS.items())
        subreaper = _set_child_subreaper(True)
        try:
            proc = run([c.pg_ctl, "-D", str(c.data), "-l", str(c.log), "-w",
                        "-t", str(PG_CTL_TIMEOUT_S), "-o", options, "start"],
                       cwd=c.base, timeout=PG_CTL_TIMEOUT_S + 30)
        finally:
            if subreaper:
                _set_child_subreaper(False)
        if subreaper:
            c.postmaster_pid = _read_postmaster_pid(c.data)
        if proc.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {proc.stderr}\n{_tail(c.log)}")

    def stop(self, mode: str = "immediate") -> None:
        c = self.cluster
        run([c.pg_ctl, "-D", str(c.data), "-m", mode, "-w", "stop"], cwd=c.base, timeout=60)
        if c.postmaster_pid is not None:
            _reap_child(c.postmaster_pid)
            c.postmaster_pid = None

    def freeze(self, frozen: bool = True) -> None:
        """SIGSTOP (or SIGCONT) the postmaster and every backend: a database that stops
        answering without closing its connections (a frozen host, a partition)."""
        postmaster = _read_postmaster_pid(self.cluster.data)
        assert postmaster is not None, "the cluster is not running"
        pids = [postmaster]
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[1]) == postmaster:
                pids.append(int(stat.parent.name))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def remove(self) -> None:
        self.cluster.stop()


def stoppable_cluster() -> StoppableCluster:
    """Init and start a private cluster (RuntimeError without local binaries)."""
    try:
        return StoppableCluster(start_cluster(SETTINGS))
    except Unavailable as exc:
        raise RuntimeError(f"no PostgreSQL binaries for a private cluster: {exc}") from exc


@contextlib.asynccontextmanager
async def migrated_stoppable_cluster() -> AsyncIterator[StoppableCluster]:
    """A private cluster migrated to head, removed afterwards. Without PostgreSQL
    binaries the test fails (naming them), never skips."""
    import pytest

    from app.store.engine import migrate

    try:
        cluster = await asyncio.to_thread(stoppable_cluster)
    except RuntimeError as exc:
        pytest.fail(f"PostgreSQL binaries are required for this fault test: {exc}")
    try:
        await migrate.upgrade_async(cluster.url)
        yield cluster
    finally:
        await asyncio.to_thread(cluster.remove)
