"""A real turnlog server for the client's tests.

The server is `TURNLOG_TEST_URL` when set (the main suite's
tests/test_client_alone.py starts one and runs these tests in a venv holding
only the client), else a `turnlog serve` subprocess on a free loopback port
over a throwaway SQLite file, started here when the server is installed
beside the client; without either the server tests are skipped with that
reason. Nothing here imports the server: these tests see turnlog only
through HTTP, as a trainer or a miles rollout does.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import free_port

READY_TIMEOUT = 60.0


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"turnlog at {url} never became ready")


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    given = os.environ.get("TURNLOG_TEST_URL")
    if given:
        wait_ready(given)
        yield given.rstrip("/")
        return
    if importlib.util.find_spec("app") is None:
        pytest.skip("no turnlog server: set TURNLOG_TEST_URL or install the server beside "
                    "the client")
    home = tmp_path_factory.mktemp("server")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNLOG_")}
    log_path = home / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--database-url", f"sqlite:///{home / 'turnlog.db'}"],
            cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, proc)
        except RuntimeError:
            raise RuntimeError(Path(log_path).read_text(errors="replace")) from None
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def has_rewards(server_url: str) -> bool:
    """Whether the server has `POST /v1/sessions/{sid}/rewards` (a newer route)."""
    paths = httpx.get(f"{server_url}/openapi.json", timeout=10).json().get("paths", {})
    return any(p.endswith("/rewards") for p in paths)


@pytest.fixture
def rewards(has_rewards: bool) -> None:
    if not has_rewards:
        pytest.skip("this turnlog server has no rewards route (POST /v1/sessions/{sid}/rewards)")
