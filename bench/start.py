"""What a `turnlog` process costs before it does anything: CPU and wall time from
its start to its first answer.

Run by hand (not in CI):

    .venv/bin/python -m bench.start [--runs 6] [--baseline DIR]

Three kinds of start, each `--runs` times on a fresh SQLite file:
- `turnlog gateway` (an upstream that is never called) until `/turnlog/healthz`
  answers;
- `turnlog serve` until `/healthz` answers;
- `turnlog --version` to its exit.
A process's CPU is user + system from `/proc/<pid>/stat` at its first answer
(its own threads; not its children). Most of it is importing: a command starts
in a fresh interpreter, so every test that starts a gateway or a server pays
it, and so does a user at every command.

`--baseline DIR`: the same starts from another checkout (e.g. the code before a
change), alternating run by run with this one. Its `app` is put first on
`PYTHONPATH`: this venv's editable install would otherwise import this
checkout's whatever the working directory.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import cpu_split, free_port
from tests.serverproc import server_env

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 120.0


def env_for(root: Path) -> dict[str, str]:
    """The servers' clean environment; another checkout's `app` first on the path."""
    if root == ROOT:
        return server_env()
    return server_env({"PYTHONPATH": os.pathsep.join([str(root), str(root / "client")])})




def until_ready(argv: list[str], root: Path, port: int, path: str) -> tuple[float, float]:
    """Start `argv`, poll `path` until it answers; (wall s, the process's CPU s)."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=root, env=env_for(root), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(timeout=1.0) as http:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"{' '.join(argv)} exited with {proc.returncode} "
                                     "before answering")
                if time.perf_counter() - started > READY_TIMEOUT_S:
                    raise SystemExit(f"{' '.join(argv)} did not answer {path} in "
                                     f"{READY_TIMEOUT_S:g} s")
                try:
                    if http.get(f"http://127.0.0.1:{port}{path}").status_code < 500:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.01)
        return time.perf_counter() - started, sum(cpu_split(proc.pid))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def gateway(root: Path, scratch: Path) -> tuple[float, float]:
    port = free_port()
    return until_ready(
        [sys.executable, "-m", "app", "gateway", "--upstream", "http://127.0.0.1:9",
         "--database-url", f"sqlite:///{scratch / 'gateway.db'}",
         "--spool-dir", str(scratch / "spool"), "--port", str(port)],
        root, port, "/turnlog/healthz")


def serve(root: Path, scratch: Path) -> tuple[float, float]:
    port = free_port()
    return until_ready(
        [sys.executable, "-m", "app", "serve", "--database-url",
         f"sqlite:///{scratch / 'serve.db'}", "--port", str(port)],
        root, port, "/healthz")


def version(root: Path, scratch: Path) -> tuple[float, float]:  # noqa: ARG001
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "app", "--version"], cwd=root, env=env_for(root),
                   stdout=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.perf_counter() - started,
            after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)


STARTS = {"turnlog gateway": gateway, "turnlog serve": serve, "turnlog --version": version}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6, help="starts of each kind (default 6)")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also start the checkout in DIR, alternating with this one")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    roots = {"this": ROOT}
    if args.baseline is not None:
        if not (args.baseline / "app" / "__main__.py").is_file():
            parser.error(f"--baseline {args.baseline}: not a turnlog checkout (no app/)")
        roots["base"] = args.baseline.resolve()
    load = os.getloadavg()[0]
    print(f"load average before: {load:.1f} on {os.cpu_count()} cores "
          "(the figures are only comparable on a quiet machine)")
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for run in range(args.runs):
        for kind, start in STARTS.items():
            for name, root in roots.items():
                with tempfile.TemporaryDirectory(prefix="turnlog-start-") as scratch:
                    results.setdefault((kind, name), []).append(start(root, Path(scratch)))
        print(f"  run {run + 1}/{args.runs}", file=sys.stderr, flush=True)
    print(f"{'start':20s} {'checkout':8s} {'CPU min':>8s} {'CPU median':>11s} "
          f"{'wall median':>12s}")
    for (kind, name), got in results.items():
        cpus, walls = [c for _, c in got], [w for w, _ in got]
        print(f"{kind:20s} {name:8s} {min(cpus):7.2f}s {statistics.median(cpus):10.2f}s "
              f"{statistics.median(walls):11.2f}s")


if __name__ == "__main__":
    main()
