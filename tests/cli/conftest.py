"""Fixtures of the command-line tests: a clean environment, a live secured server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from app.main import create_app
from app.settings import Settings, get_settings
from tests.cli.support import TOKEN
from tests.serverproc import free_port


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("TURNLOG_DATABASE_URL", "TURNLOG_API_TOKENS", "TURNLOG_TOKEN",
                 "TURNLOG_LOG_FORMAT", "TURNLOG_LOG_LEVEL", "TURNLOG_DEBUG",
                 "TURNLOG_METRIC_KEYS", "TURNLOG_PORT"):
        # set first, so the teardown also removes what a command (serve) exported
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture
def secured_server(db_url: str) -> Iterator[str]:
    import uvicorn

    app = create_app(Settings.load(database_url=db_url, migrate_on_start=False,
                              api_tokens=f"{TOKEN}:write"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                           log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(30)
