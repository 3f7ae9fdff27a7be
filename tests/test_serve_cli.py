"""`turnlog serve`: no non-loopback bind without API tokens unless `--insecure`; bad token
settings stop it at startup; JSON logging is configured and uvicorn told to keep it; the
workers get the command's settings in uvicorn's configuration, never via os.environ."""

import os
import sys
from typing import Any

import pytest
from typer.testing import CliRunner

import app.logs
from app.cli import cli
from app.served import guarded_protocol
from app.settings import Settings, get_settings
from tests.serverproc import free_port

TOKEN = "w-0123456789abcdef"
runner = CliRunner()


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> list[dict[str, Any]]:
    """Runs `serve` up to uvicorn: the configuration uvicorn would have run is recorded."""
    import uvicorn

    calls: list[uvicorn.Config] = []
    # `app.cli.main` the module (the package exports a `main` function of that name).
    monkeypatch.setattr(sys.modules["app.cli.main"], "run_server", calls.append)
    monkeypatch.setattr(app.logs, "configure_logging", lambda *a, **kw: None)
    from app.store.engine import migrate

    migrate.upgrade(f"sqlite:///{tmp_path}/serve.db")  # serve --no-migrate needs a schema
    monkeypatch.setenv("TURNLOG_DATABASE_URL", f"sqlite:///{tmp_path}/serve.db")
    monkeypatch.delenv("TURNLOG_API_TOKENS", raising=False)
    monkeypatch.delenv("TURNLOG_HOST", raising=False)
    # serve checks the port is free before it starts: not 8000, which may be taken here.
    monkeypatch.setenv("TURNLOG_PORT", str(free_port()))
    get_settings.cache_clear()
    yield calls
    get_settings.cache_clear()


def serve(*args: str) -> Any:
    return runner.invoke(cli, ["serve", "--no-migrate", *args])


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "db.example"])
def test_non_loopback_without_tokens_is_refused(served, host):
    result = serve("--host", host)
    assert result.exit_code == 2
    assert "refusing to serve" in result.output
    assert served == []


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_loopback_serves_without_tokens(served, host):
    assert serve("--host", host).exit_code == 0
    assert served[0].host == host


def test_default_bind_is_loopback(served):
    assert serve().exit_code == 0
    assert served[0].host == "127.0.0.1"


def test_insecure_allows_non_loopback_with_a_warning(served):
    result = serve("--host", "0.0.0.0", "--insecure")
    assert result.exit_code == 0, result.output
    assert "without API tokens" in result.output
    assert served[0].host == "0.0.0.0"


def test_tokens_allow_non_loopback(served, monkeypatch):
    monkeypatch.setenv("TURNLOG_API_TOKENS", f"{TOKEN}:write")
    result = serve("--host", "0.0.0.0")
    assert result.exit_code == 0, result.output
    assert served[0].host == "0.0.0.0"


def test_an_empty_token_list_is_no_tokens(served, monkeypatch):
    monkeypatch.setenv("TURNLOG_API_TOKENS", " , ")
    assert serve("--host", "0.0.0.0").exit_code == 2


def test_bad_token_setting_stops_startup_without_echoing_it(served, monkeypatch):
    monkeypatch.setenv("TURNLOG_API_TOKENS", f"{TOKEN}:admin")
    result = serve()
    assert result.exit_code == 2
    assert "TURNLOG_API_TOKENS entry 1" in result.output
    assert TOKEN not in result.output
    assert served == []


def test_uvicorn_keeps_our_logging(served):
    assert serve().exit_code == 0
    from app.served import served_app

    assert served[0].log_config is None
    assert served[0].factory is True
    # every worker process configures JSON logging itself, in the factory
    assert served[0].app.func is served_app


def test_the_served_factory_configures_logging(monkeypatch):
    import app.main

    calls = []
    monkeypatch.setattr(app.logs, "configure_logging", lambda *a: calls.append(a))
    monkeypatch.setattr(app.main, "create_app", lambda settings: "the app")
    assert app.main.create_served_app(Settings.load()) == "the app"
    assert calls == [("info", "auto")]


def test_serve_bounds_connections_from_the_settings(served, monkeypatch):
    monkeypatch.setenv("TURNLOG_KEEP_ALIVE_TIMEOUT_S", "3")
    monkeypatch.setenv("TURNLOG_LIMIT_CONCURRENCY", "0")
    monkeypatch.setenv("TURNLOG_MAX_HEADER_BYTES", "32768")
    get_settings.cache_clear()
    assert serve("--host", "127.0.0.2").exit_code == 0
    call = served[0]
    assert call.http.func is guarded_protocol
    assert call.http.keywords["bounds"].max_header_bytes == 32768
    assert call.timeout_keep_alive == 3
    assert call.limit_concurrency is None
    assert call.h11_max_incomplete_event_size == 32768
    # The workers see the bound address as an allowed Host name.
    assert call.app.args[0].server.host == "127.0.0.2"


def test_serve_hands_its_options_to_the_workers_not_to_the_environment(served, monkeypatch):
    import pickle

    url = os.environ["TURNLOG_DATABASE_URL"]
    monkeypatch.delenv("TURNLOG_DATABASE_URL")
    before = dict(os.environ)
    result = runner.invoke(cli, ["--log-format", "console", "--log-level", "DEBUG", "serve",
                                 "--no-migrate", "--database-url", url, "--host", "127.0.0.3"])
    assert result.exit_code == 0, result.output
    assert dict(os.environ) == before
    # What every spawned worker unpickles: the command line's settings, whole.
    config = pickle.loads(pickle.dumps(served[0]))
    settings = config.app.args[0]
    assert settings.store.database_url == url.replace("sqlite://", "sqlite+aiosqlite://")
    assert (settings.server.host, settings.log.log_format, settings.log.log_level) == (
        "127.0.0.3", "console", "debug")
    assert settings.server.port == served[0].port == int(os.environ["TURNLOG_PORT"])
    assert config.log_level == served[0].log_level
