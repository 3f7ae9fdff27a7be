"""Fixtures for the recording-gateway tests: real processes on loopback ports.

`fake_sglang` is `python -m app.sim.sglang_http` (the simulator's causal router
behind SGLang's routes); `gateway_process` spawns `python -m app gateway` in
front of it, restartable and SIGKILLable; `Wire` sends chat turns through the
gateway and keeps what went over the wire (the request as sent, the reply
bytes as received) for comparing with what the store holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.crash.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 60.0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNLOG_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Process:
    """A subprocess on a fixed loopback port that can be stopped, killed and restarted."""

    argv: list[str]
    log_path: Path
    ready_path: str
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.argv, "--port", str(self.port)], cwd=ROOT, env=_env(),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    async def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url, timeout=2.0) as http:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise AssertionError(f"exited with {self.proc.returncode}:\n"
                                         f"{self.log_tail()}")
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(self.ready_path)).status_code == 200:
                        return
                await asyncio.sleep(0.05)
        raise AssertionError(f"not ready after {timeout}s:\n{self.log_tail()}")

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


@pytest.fixture(scope="module")
def fake_sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """The simulator's SGLang over HTTP (2 layers, top-2 of 16 experts)."""
    log = tmp_path_factory.mktemp("sglang") / "sglang.log"
    process = Process(["-m", "app.sim.sglang_http"], log, "/health")
    process.start()
    asyncio.run(process.wait_ready())
    yield process
    process.stop()


@pytest.fixture
def gateway_process(tmp_path: Path, fake_sglang: Process) -> Iterator[Any]:
    """A factory `spawn(database_url, *flags, spool=None, upstream=None) -> Process`,
    started (not yet ready); all are stopped at teardown."""
    made: list[Process] = []

    def spawn(database_url: str, *flags: str, spool: Path | None = None,
              upstream: str | None = None) -> Process:
        spool_dir = spool or tmp_path / f"spool-{len(made)}"
        argv = ["-m", "app", "gateway", "--upstream", upstream or fake_sglang.url,
                "--database-url", database_url, "--spool-dir", str(spool_dir), *flags]
        process = Process(argv, tmp_path / f"gateway-{len(made)}.log", "/turnlog/healthz")
        made.append(process)
        process.start()
        return process

    yield spawn
    for process in made:
        process.stop()


@dataclass
class Sent:
    """One chat turn as it went over the wire."""

    session_id: str
    request: dict[str, Any]
    status: int
    reply: bytes


def chat(input_ids: list[int], **extra: Any) -> dict[str, Any]:
    """A chat request as a miles session server sends it (TITO input ids)."""
    return {"model": "default", "messages": [{"role": "user", "content": "hi"}],
            "input_ids": input_ids, "logprobs": True, "return_meta_info": True,
            "no_stop_trim": False, "max_tokens": 3, **extra}


async def send_turn(http: httpx.AsyncClient, session_id: str | None, request: dict[str, Any],
                    headers: dict[str, str] | None = None) -> Sent:
    all_headers = {"content-type": "application/json", **(headers or {})}
    if session_id is not None:
        all_headers["X-SMG-Routing-Key"] = session_id
    import json

    reply = await http.post("/v1/chat/completions", content=json.dumps(request).encode(),
                            headers=all_headers)
    return Sent(session_id or "", request, reply.status_code, reply.content)


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus text page (`name{labels}`), 0 if absent."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


async def scrape(http: httpx.AsyncClient) -> str:
    return (await http.get("/turnlog/metrics")).text


async def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
