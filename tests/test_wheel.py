"""The wheel a user installs with pip migrates and serves without a source checkout.

Builds the wheel from a copy of the project, and the client's wheel
(`turnlog-client`, a dependency of the server) from a copy of ./client
(offline: no build isolation, the test extra brings setuptools and wheel),
installs both with `--no-deps` into a fresh venv whose other dependencies
resolve from this venv's site-packages (a `.pth` line; both packages must
come from the wheels), then runs the installed
`turnlog` script from an empty working directory: `migrate` on a fresh SQLite
file, `serve` on a free port, and `/readyz` must answer 200 at schema head.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serverproc import ServerProcess, any_answer, turnlog_serve

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 60.0
pytestmark = pytest.mark.wheel


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def clean_env() -> dict[str, str]:
    """No TURNLOG_* setting of the developer's, and no path back into the checkout."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("TURNLOG_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}


IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


def build_wheel(src: Path, dist: Path) -> None:
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-cache-dir", "--wheel-dir", str(dist), str(src)], cwd=src, env=clean_env())


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The client distribution's wheel, built from a copy of ./client."""
    src = tmp_path_factory.mktemp("client-src") / "client"
    shutil.copytree(ROOT / "client", src, ignore=IGNORED)
    dist = tmp_path_factory.mktemp("client-dist")
    build_wheel(src, dist)
    (built,) = dist.glob("turnlog_client-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A copy of what the wheel is built from, so the build leaves nothing in the checkout.
    src = tmp_path_factory.mktemp("src")
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "app", src / "app", ignore=IGNORED)
    dist = tmp_path_factory.mktemp("dist")
    build_wheel(src, dist)
    (built,) = dist.glob("turnlog-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, client_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(home)], cwd=home)
    python = home / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", str(wheel), str(client_wheel)], cwd=home, env=clean_env())
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(run([str(python), "-c", purelib], cwd=home).stdout.strip())
    # Dependencies from this venv; a plain path line, so this venv's editable-install
    # hooks (.pth files there) are not run and `app` and `turnlog_client` can only
    # come from the wheels.
    (site / "zz_outer_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return home


def test_the_wheel_ships_the_migrations(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    versions = sorted(n for n in names if n.startswith("app/store/migrations/versions/")
                      and n.endswith(".py"))
    shipped = sorted((ROOT / "app/store/migrations/versions").glob("*.py"))
    assert [Path(n).name for n in versions] == [p.name for p in shipped]
    assert "app/store/migrations/env.py" in names
    assert "app/store/migrations/script.py.mako" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "alembic/"))]


@pytest.mark.parametrize("package", ["app", "turnlog_client"])
def test_packages_are_imported_from_the_wheels_not_the_checkout(
        venv: Path, tmp_path: Path, package: str) -> None:
    where = f"import {package}; print({package}.__file__)"
    found = run([str(venv / "bin" / "python"), "-c", where],
                cwd=tmp_path, env=clean_env()).stdout.strip()
    assert Path(found).is_relative_to(venv), found


def test_the_client_wheel_ships_only_the_client(client_wheel: Path) -> None:
    names = zipfile.ZipFile(client_wheel).namelist()
    assert "turnlog_client/miles.py" in names and "turnlog_client/py.typed" in names
    assert all(n.startswith(("turnlog_client/", "turnlog_client-")) for n in names), names


@pytest.fixture
def served(venv: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    turnlog = str(venv / "bin" / "turnlog")
    migrated = run([turnlog, "migrate", "--database-url", url], cwd=tmp_path, env=clean_env())
    assert "current: 0" in migrated.stdout and "(head: " in migrated.stdout, migrated.stdout
    with turnlog_serve(url, tmp_path / "serve.log", env=clean_env(), command=[turnlog],
                       ready_path="/readyz") as server:
        yield server


def test_the_installed_wheel_migrates_and_serves_ready(served: ServerProcess) -> None:
    # The first answer, whatever it is: /readyz must say 200 as soon as it answers.
    reply = served.wait_ready_sync(accept=any_answer)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["status"] == "ready" and body["database"] == "sqlite"
    assert body["schema"] is not None
