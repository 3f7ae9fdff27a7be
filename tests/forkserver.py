"""A fork server for the tests' `python -m …` processes: the libraries imported once.

A test that runs `turnlog serve`, `turnlog gateway` or the fake SGLang as a real
process paid ~2 s of CPU per start on the development machine, most of it
importing the same third-party libraries (SQLAlchemy, numpy, pydantic, aiohttp,
uvicorn, structlog…), and the gateway's and crash tests start hundreds of them.
This module owns a helper process per test process (the "zygote") that imports
those libraries once, then forks one child per start; the child sets its working
directory, environment, argv and output exactly as `subprocess.Popen` would have
them and runs the module as `python -m` does (`runpy`), ending through the
interpreter's normal exit (non-daemon threads joined, `atexit` handlers run).
Nothing of turnlog (`app.*`) is imported before the fork: each child imports
and configures it from its own environment, as a fresh process does.

Refuses what would make a forked child differ from a fresh interpreter: a
command that is not `sys.executable -m <module>`, or an environment whose
`PYTHON*` variables (read once, when an interpreter starts) differ from the
zygote's — those are started with `subprocess.Popen` as before (`spawn`
decides). `TURNLOG_FORKSERVER=0` turns it off for a run. The test that a
process imports only what it needs (`tests/test_start_imports.py`) starts its
own interpreters.

The protocol: one JSON object a line on the zygote's stdin, one answer a line on
its stdout; the zygote reaps its children and answers for their exit status.
It exits when its stdin closes (the test process ended, however).
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]

# What every turnlog process imports at start (measured: ~1.5 s of the ~2 s of
# CPU a gateway took to its first answer). Not `app.*`, not typer's help module
# (it reads TERMINAL_WIDTH when imported).
PRELOAD = (
    "numpy", "msgspec", "sqlalchemy", "sqlalchemy.ext.asyncio", "sqlalchemy.dialects.sqlite",
    "sqlalchemy.dialects.postgresql", "aiosqlite", "asyncpg", "alembic",
    "alembic.runtime.migration", "pydantic", "pydantic_settings", "aiohttp", "uvicorn",
    "uvicorn.protocols.http.h11_impl", "structlog", "httpx", "typer", "click", "zstandard",
    "fastapi", "prometheus_client", "pybase64", "gzip", "http.client", "ctypes",
)

POLL = 0.02

# Environment variables read when an interpreter starts (PYTHON*, the locale, the
# time zone, the user site's home) or when the preloaded libraries are imported
# (their C extensions switched off, colours, prometheus' multiprocess mode, numpy's
# settings): a child whose values differ is started fresh.
READ_AT_START_PREFIXES = ("PYTHON", "LC_", "NPY_", "OPENBLAS_", "OMP_")
READ_AT_START = frozenset({
    "LANG", "LANGUAGE", "TZ", "HOME", "AIOHTTP_NO_EXTENSIONS", "YARL_NO_EXTENSIONS",
    "MULTIDICT_NO_EXTENSIONS", "PROPCACHE_NO_EXTENSIONS", "FROZENLIST_NO_EXTENSIONS",
    "NO_COLOR", "FORCE_COLOR", "TYPER_USE_RICH", "PROMETHEUS_MULTIPROC_DIR",
    "PROMETHEUS_DISABLE_CREATED_SERIES", "SQLALCHEMY_WARN_20", "DISABLE_SQLALCHEMY_CEXT_RUNTIME",
})


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # a library a later version may not need
            continue


def _run_child(request: Mapping[str, Any]) -> int:
    """In the forked child: become `python -m module args…` and run it."""
    import runpy

    # Signal dispositions are left as the zygote's, which installs no handler: they are
    # what a fresh interpreter started by the test process would have (an ignored
    # SIGINT, as in a shell's background job, stays ignored).
    # The zygote's pipes (fds 0 and 1) become /dev/null and the log, first (a failure
    # after this is a traceback in the log): `sys.stdin` and `sys.stdout` are the same
    # objects over the new files, as in a fresh process started with those (nothing
    # is buffered: one request at a time).
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    module, args = request["module"], request["args"]
    sys.argv = [module, *args]
    sys.path[0] = os.getcwd()  # as `python -m` puts its working directory first
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


def _zygote() -> None:
    """The helper's main loop (`python -m tests.forkserver`)."""
    _preload()
    requests: IO[str] = sys.stdin
    answers: IO[str] = sys.stdout
    status: dict[int, int] = {}

    def reap() -> None:
        while True:
            try:
                pid, raw = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            status[pid] = os.waitstatus_to_exitcode(raw)

    for line in requests:
        request = json.loads(line)
        reap()
        answer: dict[str, Any] = {"seq": request["seq"]}
        if request["op"] == "spawn":
            try:
                pid = os.fork()
            except OSError as exc:  # a process limit, memory: the test's error, not ours
                answer["error"] = f"fork: {exc}"
            else:
                if pid == 0:
                    # Leave the loop: the child exits the way a fresh interpreter does.
                    raise SystemExit(_run_child(request))
                status.pop(pid, None)  # a pid reused: not the exit of the one before
                answer["pid"] = pid
        else:
            answer["returncode"] = status.get(request["pid"])
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


class _Zygote:
    """The test process's side: the helper started on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # The servers' own clean environment; imported here, as serverproc imports this.
        from tests.serverproc import server_env

        self.env = server_env()
        self.seq = 0
        # Its own errors (and a child's before its log is open), for `ask`'s message.
        handle, name = tempfile.mkstemp(prefix="turnlog-forkserver-", suffix=".log")
        self.errors = Path(name)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver"], cwd=ROOT, env=self.env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=handle,
            text=True, bufsize=1)
        os.close(handle)
        atexit.register(self.close)

    def ask(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The zygote's answer to `request`. Numbered: an answer left unread by an
        earlier call (interrupted between writing and reading) is skipped, not taken
        for this one's."""
        with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.seq += 1
            try:
                self.proc.stdin.write(json.dumps({**request, "seq": self.seq}) + "\n")
                self.proc.stdin.flush()
                while line := self.proc.stdout.readline():
                    answer: dict[str, Any] = json.loads(line)
                    if answer["seq"] == self.seq:
                        return answer
            except BrokenPipeError:
                pass
        raise RuntimeError(f"the tests' fork server exited with {self.proc.wait()}: "
                           f"{self.errors.read_text(errors='replace')[-2000:]}")

    def accepts(self, env: Mapping[str, str]) -> bool:
        """A child with `env` starts as a fresh interpreter would: the variables read
        when an interpreter starts, or when the zygote imported the libraries, are
        the zygote's."""
        def read_at_start(e: Mapping[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items()
                    if k.startswith(READ_AT_START_PREFIXES) or k in READ_AT_START}
        return read_at_start(env) == read_at_start(self.env)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.errors.unlink(missing_ok=True)


_zygote_instance: _Zygote | None = None
_zygote_lock = threading.Lock()


def _the_zygote() -> _Zygote:
    global _zygote_instance
    with _zygote_lock:
        if _zygote_instance is None or _zygote_instance.proc.poll() is not None:
            _zygote_instance = _Zygote()
        return _zygote_instance


# The exit status of a child whose zygote died before reporting it.
UNKNOWN_EXIT = 255


def _start_time(pid: int) -> str | None:
    """When process `pid` started (its clock ticks since boot), None if no such
    process is running (gone, or a zombie): a pid and this name one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return None if fields[0] in ("Z", "X") else fields[19]


class ForkedProcess:
    """What the tests use of `subprocess.Popen` (`pid`, `returncode`, `poll`,
    `wait`, `send_signal`, `terminate`, `kill`) for a child of the zygote."""

    def __init__(self, zygote: _Zygote, pid: int, argv: Sequence[str]) -> None:
        self.zygote = zygote
        self.pid = pid
        self.args = list(argv)
        self.returncode: int | None = None
        self.started = _start_time(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self.zygote.ask({"op": "status",
                                                   "pid": self.pid})["returncode"]
            except RuntimeError:
                # The zygote is gone (killed from outside): its children were handed to
                # init, which reaps them. Running while the pid is still this child;
                # ended, with a status nobody can read any more, once it is not.
                if self.started is None or _start_time(self.pid) != self.started:
                    self.returncode = UNKNOWN_EXIT
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(POLL)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped child's pid may be another process's by now
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str],
          log: Path) -> ForkedProcess | subprocess.Popen[bytes]:
    """`argv` started with its output appended to `log`: forked from the zygote
    when it is `sys.executable -m module …` and `env` allows it, else a Popen."""
    forkable = (len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m"
                and os.environ.get("TURNLOG_FORKSERVER", "1") != "0")
    if forkable:
        zygote = _the_zygote()
        if zygote.accepts(env):
            # What Popen would refuse at once, refused here too (the child would only
            # exit 1 with nowhere to say why).
            if not Path(cwd).is_dir():
                raise FileNotFoundError(errno.ENOENT, "no such directory", str(cwd))
            log.open("ab").close()
            answer = zygote.ask({"op": "spawn", "module": argv[2], "args": list(argv[3:]),
                                 "cwd": str(cwd), "env": dict(env), "log": str(log)})
            if "error" in answer:
                raise OSError(f"the tests' fork server could not start {argv}: "
                              f"{answer['error']}")
            return ForkedProcess(zygote, answer["pid"], argv)
    with log.open("ab") as out:
        return subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)


if __name__ == "__main__":
    _zygote()
