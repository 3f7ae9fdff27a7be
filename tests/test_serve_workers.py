"""`turnlog serve --workers 2`: every worker serves the command line's database, which
reaches the workers in uvicorn's configuration: no TURNLOG_DATABASE_URL anywhere."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from app.store.engine import migrate
from tests.factory import open_body
from tests.serverproc import ServerProcess, free_port, server_env


def test_two_workers_serve_the_database_of_the_command_line(tmp_path: Path) -> None:
    db = tmp_path / "workers.db"
    migrate.upgrade(f"sqlite:///{db}")
    # Run elsewhere: a worker falling back to the default URL would use ./turnlog.db here.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    port = free_port()
    server = ServerProcess(
        [sys.executable, "-m", "app", "--log-format", "console", "serve", "--port", str(port),
         "--database-url", f"sqlite:///{db}", "--workers", "2", "--no-migrate"],
        tmp_path / "serve.log", port=port, ready_path="/healthz", env=server_env(), cwd=cwd)
    server.start()
    try:
        server.wait_ready_sync()
        sids = [f"workers-{uuid.uuid4().hex[:12]}" for _ in range(12)]
        # A new connection per request: the kernel hands them to either worker.
        for sid in sids:
            with httpx.Client(base_url=server.base_url) as http:
                r = http.post("/v1/sessions", json=open_body(sid))
                assert r.status_code == 201, r.text
        for _ in range(3):
            for sid in sids:
                with httpx.Client(base_url=server.base_url) as http:
                    r = http.get(f"/v1/sessions/{sid}")
                    assert r.status_code == 200, r.text
                    assert r.json()["session_id"] == sid
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text(errors="replace")
    # At least two worker processes started (one restarted by uvicorn adds a third); each
    # logs as the command line said (console, where the default off a terminal is JSON
    # lines): the option reached them too.
    started = [line for line in log.splitlines() if "Started server process" in line]
    assert len({re.search(r"\[(\d+)\]", line)[1] for line in started}) >= 2, log  # type: ignore[index]
    assert not any(line.lstrip().startswith("{") for line in started), log
    assert not (cwd / "turnlog.db").exists()
    with sqlite3.connect(db) as con:
        stored = {row[0] for row in con.execute("SELECT session_id FROM sessions")}
    assert set(sids) <= stored


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                # The fields after the command's closing parenthesis: state, ppid, ...
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet, re-parented to a PID 1 that does not reap,
    counts as gone)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] \
            != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the death signal is Linux's")
def test_workers_end_with_a_killed_supervisor_and_the_port_is_free_again(tmp_path: Path) -> None:
    """A tester's finding: SIGKILL of `serve --workers 2` left both workers serving,
    unsupervised, and a restarted server could not bind the port."""
    db = tmp_path / "workers.db"
    migrate.upgrade(f"sqlite:///{db}")
    port = free_port()
    argv = [sys.executable, "-m", "app", "serve", "--port", str(port),
            "--database-url", f"sqlite:///{db}", "--workers", "2", "--no-migrate"]
    server = ServerProcess(argv, tmp_path / "serve.log", port=port, ready_path="/healthz",
                           env=server_env())
    server.start()
    workers: list[int] = []
    try:
        server.wait_ready_sync()
        assert server.proc is not None
        deadline = time.monotonic() + 30
        while len(workers) < 2 and time.monotonic() < deadline:  # the two and a tracker
            workers = [pid for pid in _children(server.proc.pid)
                       if "multiprocessing" in Path(f"/proc/{pid}/cmdline").read_text()]
            time.sleep(0.1)
        assert len(workers) >= 2, (workers, server.log_tail())
        server.kill()
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers), server.log_tail()
        again = ServerProcess(argv, tmp_path / "again.log", port=port, ready_path="/healthz",
                              env=server_env())
        with again:
            again.wait_ready_sync()
    finally:
        server.stop()
        for pid in workers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
