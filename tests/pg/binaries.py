"""Finding the installed PostgreSQL server binaries and running them as the right user.

initdb and pg_ctl refuse to run as root, so when the tests run as root (CI)
every command is wrapped to run as the ``postgres`` OS user, created if needed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tests.pg.common import Unavailable

OS_USER = "postgres"


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path))


def find_bindir() -> Path:
    """Directory holding ``initdb``, ``pg_ctl`` and ``postgres`` (newest version first)."""
    candidates: list[Path] = []

    initdb = shutil.which("initdb")
    pg_ctl = shutil.which("pg_ctl")
    if initdb and pg_ctl:
        # Prefer the real directory (e.g. /usr/local/bin/initdb -> /usr/lib/postgresql/15/bin).
        candidates.append(Path(os.path.realpath(initdb)).parent)
        candidates.append(Path(initdb).parent)

    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"],
                capture_output=True,
                text=True,
                timeout=10,
                stdin=subprocess.DEVNULL,
                check=True,
            ).stdout.strip()
            if out:
                candidates.append(Path(out))

    for pattern in ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin", "/usr/local/pgsql/bin"):
        for found in sorted(glob.glob(pattern), key=_version_key, reverse=True):
            candidates.append(Path(found))

    for cand in candidates:
        if all(os.access(cand / exe, os.X_OK) for exe in ("initdb", "pg_ctl", "postgres")):
            return cand
    raise Unavailable(
        "initdb/pg_ctl not found on PATH, via `pg_config --bindir`, "
        "or under /usr/lib/postgresql/*/bin"
    )


def ensure_os_user() -> None:
    """Make sure the ``postgres`` OS user exists (only called when running as root)."""
    import pwd

    try:
        pwd.getpwnam(OS_USER)
        return
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        raise Unavailable(
            f"running as root, the '{OS_USER}' OS user does not exist and `useradd` is "
            f"missing; create it (useradd --system {OS_USER}) or run the tests as non-root"
        )
    proc = subprocess.run(
        [useradd, "--system", "--user-group", "--no-create-home", "--shell", "/bin/sh", OS_USER],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if proc.returncode != 0:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(OS_USER)  # created concurrently (e.g. another xdist worker)
            return
        raise Unavailable(
            f"running as root and could not create the '{OS_USER}' OS user with useradd: "
            f"{proc.stderr.strip() or proc.returncode}"
        )


def as_postgres_user(cmd: Sequence[str]) -> list[str]:
    """Wrap ``cmd`` so it runs as the ``postgres`` OS user when we are root."""
    if os.geteuid() != 0:
        return list(cmd)
    runuser = shutil.which("runuser")
    if runuser:
        return [runuser, "-u", OS_USER, "--", *cmd]
    su = shutil.which("su")
    if su:
        return [su, OS_USER, "-s", "/bin/sh", "-c", shlex.join(cmd)]
    raise Unavailable(
        "running as root but neither `runuser` nor `su` is available to drop privileges "
        f"to the '{OS_USER}' user (initdb/pg_ctl refuse to run as root)"
    )


def _child_env() -> dict[str, str]:
    # Stray PG* variables (PGDATA, PGPORT, PGHOST, ...) must not steer initdb/pg_ctl.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    env["LANG"] = "C"
    return env


def run(cmd: Sequence[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a server binary (as ``postgres`` when root), never inheriting PG* variables."""
    return subprocess.run(
        as_postgres_user(cmd),
        cwd=cwd,
        env=_child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
