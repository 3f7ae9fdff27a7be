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
import sqlite3
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serverproc import ServerProcess, free_port, server_env

ROOT = Path(__file__).resolve().parents[2]


def python_server(argv: list[str], log_path: Path, ready_path: str,
                  env: dict[str, str] | None = None) -> ServerProcess:
    """`python argv --port P` on a free loopback port P, run from the checkout (`env`:
    settings of its own, e.g. `TURNLOG_API_TOKENS`)."""
    port = free_port()
    return ServerProcess([sys.executable, *argv, "--port", str(port)], log_path, port=port,
                         ready_path=ready_path, cwd=ROOT, env=server_env(env))


@pytest.fixture(scope="session")
def fake_sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The simulator's SGLang over HTTP (2 layers, top-2 of 16 experts), one for the run:
    its replies depend on the request only, and no test stops it."""
    log = tmp_path_factory.mktemp("sglang") / "sglang.log"
    with python_server(["-m", "app.sim.sglang_http"], log, "/health") as process:
        process.wait_ready_sync()
        yield process


@pytest.fixture
def gateway_process(tmp_path: Path, fake_sglang: ServerProcess) -> Iterator[Any]:
    """A factory `spawn(database_url, *flags, spool=None, upstream=None, env=None) ->
    ServerProcess`, started (not yet ready); all are stopped at teardown."""
    made: list[ServerProcess] = []

    def spawn(database_url: str, *flags: str, spool: Path | None = None,
              upstream: str | None = None, env: dict[str, str] | None = None,
              ) -> ServerProcess:
        spool_dir = spool or tmp_path / f"spool-{len(made)}"
        argv = ["-m", "app", "gateway", "--upstream", upstream or fake_sglang.url,
                "--database-url", database_url, "--spool-dir", str(spool_dir), *flags]
        process = python_server(argv, tmp_path / f"gateway-{len(made)}.log", "/turnlog/healthz",
                                env)
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


async def drained(http: httpx.AsyncClient) -> bool:
    """The gateway's spool holds nothing: no turn, no close or reward spooled behind them."""
    return metric(await scrape(http), "turnlog_gateway_spooled_writes") == 0


@contextlib.contextmanager
def sqlite_lock(path: Path) -> Any:
    """Another process's write lock on the file: every write waits, then times out."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("BEGIN EXCLUSIVE")
    try:
        yield conn
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        conn.close()
