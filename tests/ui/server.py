"""A real `turnlog serve` (uvicorn) on a free loopback port, for browser tests and scripts."""

from __future__ import annotations

from pathlib import Path

from tests.serverproc import ServerProcess, server_env, turnlog_serve

ROOT = Path(__file__).resolve().parents[2]

UiServer = ServerProcess


def serve_ui(database_url: str, log_path: Path, env: dict[str, str] | None = None) -> UiServer:
    """`python -m app serve` against `database_url`, not started (`with serve_ui(...)
    as server:` starts and stops it); `env` adds `TURNLOG_*` settings."""
    return turnlog_serve(database_url, log_path, env=server_env(env), cwd=ROOT)
