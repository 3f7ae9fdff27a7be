"""The client installed alone: `turnlog-client` in a fresh venv, its tests against a
real server.

Builds the client's wheel from a copy of ./client (offline: no build isolation),
installs it with `--no-deps` into a fresh venv whose only other packages are
the client's declared dependency closure (`turnlog-client[test,safetensors]`,
resolved from the package metadata of this venv and linked one distribution
at a time — so neither the server nor any of its dependencies can be
imported there), starts `turnlog serve` on a free loopback port over a SQLite
test database, and runs client/tests —
the client's calls and the miles hooks — in that venv against it. A client module
that imports something it does not declare, or the server, fails here.

One backend is enough: what this proves (the client alone, from its wheel,
works) does not depend on the server's database, and the client's calls are
run on SQLite, PostgreSQL and Citus by tests/test_client.py and
tests/test_client_consumers.py (in-process, the same API).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import Distribution, distribution
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from app.store.engine import migrate
from tests.serverproc import turnlog_serve
from tests.test_wheel import IGNORED, build_wheel, clean_env, run

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.wheel


def closure(name: str, extras: set[str]) -> list[Distribution]:
    """The installed distributions `name[extras]` needs, transitively (not itself)."""
    wanted: dict[str, set[str]] = {}
    found: dict[str, Distribution] = {}
    todo = [(name, extras)]
    while todo:
        current, current_extras = todo.pop()
        key = canonicalize_name(current)
        if key in wanted and current_extras <= wanted[key]:
            continue
        wanted.setdefault(key, set()).update(current_extras)
        dist = found.setdefault(key, distribution(current))
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": extra})
                                         for extra in (wanted[key] or {""})):
                todo.append((req.name, set(req.extras)))
    found.pop(canonicalize_name(name))
    return list(found.values())


def link_distributions(dists: list[Distribution], into: Path) -> None:
    """Each distribution's top-level files and folders (its packages, modules,
    shared libraries and .dist-info) linked into `into`."""
    into.mkdir()
    for dist in dists:
        for file in dist.files or []:
            top = file.parts[0]
            if top == ".." or (into / top).exists() or top == "__pycache__":
                continue
            source = Path(str(dist.locate_file(top)))
            if source.exists():
                (into / top).symlink_to(source)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("client-src") / "client"
    shutil.copytree(ROOT / "client", src, ignore=IGNORED)
    dist = tmp_path_factory.mktemp("client-dist")
    build_wheel(src, dist)
    (wheel,) = dist.glob("turnlog_client-*.whl")
    home = tmp_path_factory.mktemp("client-venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(home)], cwd=home)
    python = home / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", str(wheel)], cwd=home, env=clean_env())
    deps = home / "deps"
    link_distributions(closure("turnlog-client", {"test", "safetensors"}), deps)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(run([str(python), "-c", purelib], cwd=home).stdout.strip())
    (site / "zz_client_deps.pth").write_text(f"{deps}\n")
    return home


@pytest.fixture(scope="module")
def server(fresh_database: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`turnlog serve` on a free loopback port over a migrated SQLite test database."""
    url = fresh_database("sqlite")
    migrate.upgrade(url)
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with turnlog_serve(url, log, env=clean_env(), ready_path="/readyz") as server:
        server.wait_ready_sync()
        yield server.base_url


def test_the_client_venv_holds_only_the_client_and_its_dependencies(client_venv: Path,
                                                                   tmp_path: Path) -> None:
    python = str(client_venv / "bin" / "python")
    where = run([python, "-c", "import turnlog_client; print(turnlog_client.__file__)"],
                cwd=tmp_path, env=clean_env()).stdout.strip()
    assert Path(where).is_relative_to(client_venv), where
    for server_only in ("app", "fastapi", "sqlalchemy", "pyarrow", "uvicorn", "typer"):
        probe = subprocess.run([python, "-c", f"import {server_only}"], cwd=tmp_path,
                               env=clean_env(), capture_output=True, text=True, check=False)
        assert probe.returncode != 0, f"{server_only} is importable beside the client"
    # The hooks import with the client's dependencies only.
    run([python, "-c", "from turnlog_client.miles import agent, rm"], cwd=tmp_path,
        env=clean_env())


def test_the_client_tests_pass_in_the_client_venv(client_venv: Path, server: str,
                                                  tmp_path: Path) -> None:
    # A copy, so the run writes nothing into the checkout.
    tests = tmp_path / "client"
    shutil.copytree(ROOT / "client" / "tests", tests / "tests", ignore=IGNORED)
    shutil.copy(ROOT / "client" / "pyproject.toml", tests)
    env = {**clean_env(), "TURNLOG_TEST_URL": server, "TURNLOG_CLIENT_ALONE": "1"}
    proc = subprocess.run(
        [str(client_venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(tests / "tests")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        stdin=subprocess.DEVNULL, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, proc.stdout[-3000:]
