"""A real `turnlog serve` (uvicorn) on a free loopback port, for browser tests and scripts."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class UiServer:
    """`python -m app serve` against `database_url`; `env` adds `TURNLOG_*` settings,
    `args` more `serve` options, `global_args` options of `turnlog` itself."""

    def __init__(self, database_url: str, log_path: Path,
                 env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                 global_args: tuple[str, ...] = (), cwd: Path = ROOT) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        clean = {k: v for k, v in os.environ.items() if not k.startswith("TURNLOG_")}
        clean.update(env or {})
        clean["PYTHONUNBUFFERED"] = "1"
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "app", *global_args, "serve", "--port", str(self.port),
                 "--database-url", database_url, *args],
                cwd=cwd, env=clean, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"turnlog serve exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.base_url + "/healthz", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"turnlog serve not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""
