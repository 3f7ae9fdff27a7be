"""Fixtures for the gateway's end-to-end tests: real processes on loopback ports.

A fake SGLang (`python -m app.sim.sglang_http`, one per configuration, shared
by every test: its replies depend on the request only) and the real `turnlog
gateway` CLI in front of it (one per test), each a subprocess on a free port,
stopped at teardown; the store is read back through an in-process API app on the same
database. (The gateway's own tests, with their fixtures, are in tests/gateway/;
these drive whole sessions the way miles' session server would.) A missing
or broken `turnlog gateway` fails these tests (it is never a skip).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.main import create_app
from app.settings import Settings
from tests.serverproc import ServerProcess, free_port
from turnlog_client import TurnlogClient

# The console script of the venv running the tests (`.venv/bin/turnlog`).
TURNLOG = Path(sys.executable).parent / "turnlog"


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
def processes(tmp_path: Path) -> Iterator[list[ServerProcess]]:
    """Every process a test started; stopped at teardown (in reverse order)."""
    made: list[ServerProcess] = []
    yield made
    for proc in reversed(made):
        proc.stop()


@pytest.fixture(scope="session")
def sglang_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """The fake SGLangs started so far, one per set of options, shared by every test.

    A fake SGLang's reply is a pure function of the request (no session, no
    cache; only its request counter moves, and no test here reads it), so one
    process per configuration serves every test; none of them stops it.
    """
    pool: dict[str, ServerProcess] = {}
    yield pool
    for proc in pool.values():
        proc.stop()


@pytest.fixture
async def fake_sglang(sglang_pool: dict[str, ServerProcess],
                      tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """`await start(**options) -> ServerProcess`: a fake SGLang, ready (shared: see
    `sglang_pool`)."""

    async def start(**options: Any) -> ServerProcess:
        key = repr(sorted(options.items()))
        proc = sglang_pool.get(key)
        if proc is None or not proc.running():
            port = free_port()
            proc = ServerProcess(fake_sglang_argv(port, **options),
                                 tmp_path_factory.mktemp("sglang") / "sglang.log", port=port,
                                 ready_path="/health")
            proc.start()
            sglang_pool[key] = proc
        await proc.wait_ready()
        return proc

    return start


@pytest.fixture
async def gateway_at(processes: list[ServerProcess], tmp_path: Path) -> Callable[..., Any]:
    """`await start(database_url, upstream, *options, spool_dir=None) -> ServerProcess`:
    `turnlog gateway` in front of `upstream`, writing to `database_url`, ready."""

    async def start(database_url: str, upstream: str, *options: str,
                    spool_dir: Path | None = None) -> ServerProcess:
        port = free_port()
        spool = spool_dir or tmp_path / f"spool-{len(processes)}"
        proc = ServerProcess(gateway_argv(port, upstream, database_url, spool, list(options)),
                             tmp_path / f"gateway-{len(processes)}.log", port=port,
                             ready_path="/turnlog/healthz")
        processes.append(proc)
        proc.start()
        await proc.wait_ready()
        return proc

    return start


@pytest.fixture
async def gateway(gateway_at: Callable[..., Any], db_url: str) -> Callable[..., Any]:
    """`await start(upstream, *options) -> ServerProcess`: a gateway on the test's database."""

    async def start(upstream: str, *options: str) -> ServerProcess:
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
