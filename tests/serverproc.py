"""A server subprocess for tests: start it, wait until it answers, stop or kill it.

Owns the one way the tests run a server (`turnlog serve`, `turnlog gateway`,
the fake SGLang, an installed wheel's console script) as a real process on a
loopback port (a `python -m …` one forked from `tests/forkserver.py`'s helper,
which has the libraries imported): a clean environment (no `TURNLOG_*` setting of the developer's),
its stdout and stderr appended to one log file, a readiness poll with a
deadline that fails with the log's tail (and stops early when the process
exits), SIGTERM with a bounded wait then SIGKILL, and restarts on the same port.
`turnlog_serve` builds the `serve` command line the tests share. Refuses
everything else: what another server is started with (argv, the port flag,
settings) is the caller's; PostgreSQL and Citus clusters have their own
helpers (tests/pg/, tests/citusserver.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from tests.forkserver import ForkedProcess, spawn

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
POLL_INTERVAL = 0.05

Accept = Callable[[httpx.Response], bool]


def _port_block() -> range:
    """This test process's own ports: below the kernel's ephemeral range (where a
    port the kernel hands out could meanwhile become some outgoing connection's
    local port, as seen in CI: "port … is already in use"), one block per xdist
    worker so two workers never pick the same one."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    size = 1000
    start = max(1024, low - size * (index % 8 + 1))
    return range(start, start + size)


_next_port = 0


def free_port() -> int:
    """A loopback TCP port nothing listens on right now, from this process's block
    (`_port_block`), each handed out once in turn."""
    global _next_port
    block = _port_block()
    for _ in range(len(block)):
        port = block[_next_port % len(block)]
        _next_port += 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {block.start}-{block.stop - 1}")


def server_env(extra: Mapping[str, str] | None = None, *,
               drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment without `TURNLOG_*` (nor the names in `drop`),
    unbuffered output, then `extra` (the server's own settings)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TURNLOG_") and k not in drop}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def is_ok(reply: httpx.Response) -> bool:
    return reply.status_code == 200


def any_answer(reply: httpx.Response) -> bool:
    return True


class ServerProcess:
    """`argv` listening on 127.0.0.1:`port`; `ready_path` answers 200 once it is up.

    `start()` may be called again after `stop()` or `kill()`: the same port,
    the same log (each start is marked in it). As a context manager it is
    started on entry and stopped on exit.
    """

    def __init__(self, argv: Sequence[str], log_path: Path, *, port: int,
                 ready_path: str = "/healthz", env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.port = port
        self.ready_path = ready_path
        self.env = dict(env) if env is not None else server_env()
        self.cwd = cwd or log_path.parent
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.starts = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    url = base_url

    @property
    def name(self) -> str:
        return " ".join(Path(a).name if n == 0 else a for n, a in enumerate(self.argv[:4]))

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        assert not self.running(), f"{self.name}: already running"
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts} ---\n".encode())
        self.proc = spawn(self.argv, cwd=self.cwd, env=self.env, log=self.log_path)
        self.starts += 1

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    # -- waiting -----------------------------------------------------------------

    def _check_alive(self) -> None:
        assert self.proc is not None, f"{self.name}: never started"
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n"
                                 f"{self.log_tail()}")

    def _timed_out(self, path: str, timeout: float) -> AssertionError:
        return AssertionError(f"{self.name}: no answer from {path} after {timeout}s:\n"
                              f"{self.log_tail()}")

    def wait_ready_sync(self, path: str | None = None, *, accept: Accept = is_ok,
                        headers: Mapping[str, str] | None = None,
                        timeout: float = READY_TIMEOUT) -> httpx.Response:
        """Blocks until `path` (default `ready_path`) answers as `accept` wants
        and returns that answer; fails if the process exits or the deadline passes."""
        path = path or self.ready_path
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.base_url, timeout=2.0) as http:
            while time.monotonic() < deadline:
                self._check_alive()
                with contextlib.suppress(httpx.TransportError):
                    reply = http.get(path, headers=dict(headers or {}))
                    if accept(reply):
                        return reply
                time.sleep(POLL_INTERVAL)
        raise self._timed_out(path, timeout)

    async def wait_ready(self, path: str | None = None, *, accept: Accept = is_ok,
                         headers: Mapping[str, str] | None = None,
                         timeout: float = READY_TIMEOUT) -> httpx.Response:
        """`wait_ready_sync` in a worker thread: the event loop (an in-process
        proxy or server of the same test) keeps running meanwhile."""
        return await asyncio.to_thread(self.wait_ready_sync, path, accept=accept,
                                       headers=headers, timeout=timeout)

    # -- stopping ----------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL: no shutdown hook, no flush, no goodbye to the database."""
        assert self.proc is not None, f"{self.name}: never started"
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
        if not self.running():
            return
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def turnlog_serve(database_url: str | None, log_path: Path, *,
                  env: Mapping[str, str] | None = None, cwd: Path | None = None,
                  command: Sequence[str | Path] = (sys.executable, "-m", "app"),
                  ready_path: str = "/healthz") -> ServerProcess:
    """`turnlog serve` on a free loopback port (not started): `command` is how
    `turnlog` is run (this interpreter's `app` by default, or an installed console
    script); without `database_url` the server uses its default or `env`'s."""
    port = free_port()
    argv = [*map(str, command), "serve", "--port", str(port)]
    if database_url is not None:
        argv += ["--database-url", database_url]
    return ServerProcess(argv, log_path, port=port, ready_path=ready_path,
                         env=server_env() if env is None else env, cwd=cwd)
