"""Fixtures for the gateway's end-to-end tests: real processes on loopback ports.

A fake SGLang (`python -m app.sim.sglang_http`) and the real `turnlog gateway`
CLI in front of it, each a subprocess started on a free port and stopped at
teardown; the store is read back through an in-process API app on the same
database. (The gateway's own tests, with their fixtures, are in tests/gateway/;
these drive whole sessions the way miles' session server would.) A missing
or broken `turnlog gateway` fails these tests (it is never a skip).
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
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.main import create_app
from app.settings import Settings
from turnlog_client import TurnlogClient

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 60.0
# The console script of the venv running the tests (`.venv/bin/turnlog`).
TURNLOG = Path(sys.executable).parent / "turnlog"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Process:
    """A server subprocess on a fixed loopback port; `ready_path` answers 200 when up."""

    argv: list[str]
    log_path: Path
    ready_path: str
    port: int
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TURNLOG_")}
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=self.log_path.parent, env=env,
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)

    async def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.base_url, timeout=2.0) as http:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise AssertionError(f"{self.argv[:4]} exited with {self.proc.returncode}:"
                                         f"\n{self.log_tail()}")
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(self.ready_path)).status_code == 200:
                        return
                await asyncio.sleep(0.05)
        raise AssertionError(f"{self.argv[:4]} not ready after {timeout}s:\n{self.log_tail()}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 60) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def fake_sglang_argv(port: int, *, num_layers: int = 2, topk: int = 2, num_experts: int = 16,
                     router_seed: int = 0, speculative: bool = True,
                     extra: list[str] | None = None) -> list[str]:
    argv = [sys.executable, "-m", "app.sim.sglang_http", "--port", str(port),
            "--num-layers", str(num_layers), "--topk", str(topk),
            "--num-experts", str(num_experts), "--router-seed", str(router_seed)]
    if speculative:
        argv.append("--speculative")
    return argv + list(extra or [])


def gateway_argv(port: int, upstream: str, database_url: str, spool_dir: Path,
                 options: list[str]) -> list[str]:
    if not TURNLOG.exists():
        pytest.fail(f"the turnlog console script is missing at {TURNLOG}", pytrace=False)
    return [str(TURNLOG), "gateway", "--upstream", upstream, "--host", "127.0.0.1",
            "--port", str(port), "--database-url", database_url,
            "--spool-dir", str(spool_dir), *options]


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list[Process]]:
    """Every process a test started; stopped at teardown (in reverse order)."""
    made: list[Process] = []
    yield made
    for proc in reversed(made):
        proc.stop()


@pytest.fixture
async def fake_sglang(processes: list[Process], tmp_path: Path
                      ) -> Callable[..., Any]:
    """`await start(**options) -> Process`: a fake SGLang, ready."""

    async def start(**options: Any) -> Process:
        port = free_port()
        proc = Process(fake_sglang_argv(port, **options),
                       tmp_path / f"sglang-{len(processes)}.log", "/health", port)
        processes.append(proc)
        proc.start()
        await proc.wait_ready()
        return proc

    return start


@pytest.fixture
async def gateway_at(processes: list[Process], tmp_path: Path) -> Callable[..., Any]:
    """`await start(database_url, upstream, *options, spool_dir=None) -> Process`:
    `turnlog gateway` in front of `upstream`, writing to `database_url`, ready."""

    async def start(database_url: str, upstream: str, *options: str,
                    spool_dir: Path | None = None) -> Process:
        port = free_port()
        spool = spool_dir or tmp_path / f"spool-{len(processes)}"
        proc = Process(gateway_argv(port, upstream, database_url, spool, list(options)),
                       tmp_path / f"gateway-{len(processes)}.log", "/turnlog/healthz", port)
        processes.append(proc)
        proc.start()
        await proc.wait_ready()
        return proc

    return start


@pytest.fixture
async def gateway(gateway_at: Callable[..., Any], db_url: str) -> Callable[..., Any]:
    """`await start(upstream, *options) -> Process`: a gateway on the test's database."""

    async def start(upstream: str, *options: str) -> Process:
        return await gateway_at(db_url, upstream, *options)

    return start


@contextlib.asynccontextmanager
async def store_at(database_url: str) -> AsyncIterator[TurnlogClient]:
    """An in-process API client on `database_url`."""
    settings = Settings.load(database_url=database_url, migrate_on_start=False, api_tokens="")
    app = create_app(settings)
    client = TurnlogClient("http://turnlog", transport=httpx.ASGITransport(app=app))
    try:
        yield client
    finally:
        await client.aclose()
        await app.state.services.db.dispose()


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[TurnlogClient]:
    """An in-process API client on the gateway's database: how the tests read what was stored."""
    async with store_at(db_url) as client:
        yield client
