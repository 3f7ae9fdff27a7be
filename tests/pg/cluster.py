"""Strategy c: a throwaway cluster from the installed binaries, in a temporary directory.

`start_cluster` is the reusable part: it runs ``initdb``, starts the server on a
free loopback port with the test defaults plus any extra ``postgresql.conf``
settings (e.g. ``{"shared_preload_libraries": "citus"}``) and returns a
`Cluster` (port, directories, admin URL) that is stopped and deleted at exit.
Clusters left behind by test processes that died without their exit hooks are
reaped on the next start.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import URL

from tests.pg.binaries import OS_USER, as_postgres_user, ensure_os_user, find_bindir, run
from tests.pg.common import DB_SUPERUSER, MAINTENANCE_DB, PostgresServer, Unavailable
from tests.serverproc import free_port as _free_port

TMP_PREFIX = "turnlog-pg-"
OWNER_FILE = "owner.pid"
PG_CTL_TIMEOUT_S = 60
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>

# A test cluster trades durability for speed; callers may override any of these.
TEST_SETTINGS: Mapping[str, str] = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
}


@dataclass
class Cluster:
    """A running throwaway cluster owned by this process."""

    bindir: Path
    base: Path
    owner_pid: int
    port: int = 0
    postmaster_pid: int | None = None

    @property
    def pg_ctl(self) -> str:
        return str(self.bindir / "pg_ctl")

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def log(self) -> Path:
        return self.base / "postgres.log"

    def url(self, database: str = MAINTENANCE_DB) -> str:
        """``postgresql+asyncpg://`` URL of ``database`` as the trusted superuser."""
        return URL.create("postgresql+asyncpg", username=DB_SUPERUSER, host="127.0.0.1",
                          port=self.port, database=database).render_as_string()

    def stop(self) -> None:
        """Stop the server and delete its directory (no-op in a forked child)."""
        if os.getpid() != self.owner_pid:  # forked child: not ours to stop
            return
        _stop_cluster(self.pg_ctl, self.base, self.postmaster_pid)


def start_cluster(
    settings: Mapping[str, str] | None = None,
    *,
    bindir: Path | None = None,
    initdb_args: Sequence[str] = (),
) -> Cluster:
    """initdb + start a cluster on a free port; `settings` are extra ``-c name=value``.

    Raises `Unavailable` (with the reason) when the binaries are missing or the
    server does not start.
    """
    bindir = bindir or find_bindir()
    initdb = str(bindir / "initdb")
    pg_ctl = str(bindir / "pg_ctl")

    if os.geteuid() == 0:
        ensure_os_user()
        as_postgres_user(["true"])  # fail early if we cannot drop privileges

    with contextlib.suppress(Exception):
        _reap_stale_clusters(pg_ctl)

    cluster = Cluster(bindir=bindir, base=_make_base_dir(), owner_pid=os.getpid())
    atexit.register(cluster.stop)

    proc = run(
        [
            initdb,
            "-D", str(cluster.data),
            "-A", "trust",
            "-U", DB_SUPERUSER,
            "--no-sync",
            "-E", "UTF8",
            "--locale=C",
            *initdb_args,
        ],
        cwd=cluster.base,
        timeout=180,
    )  # fmt: skip
    if proc.returncode != 0:
        raise Unavailable(
            f"`{initdb}` failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}".strip()
        )

    conf = {**TEST_SETTINGS, **(settings or {})}
    errors: list[str] = []
    for _attempt in range(3):  # the free port can be grabbed by someone else in between
        port = _free_port()
        options = f"-p {port} -k {shlex.quote(str(cluster.base))} " + " ".join(
            f"-c {shlex.quote(f'{name}={value}')}" for name, value in conf.items())
        start_cmd = [
            pg_ctl,
            "-D", str(cluster.data),
            "-l", str(cluster.log),  # must not inherit our pipes, or pg_ctl never "finishes"
            "-w",
            "-t", str(PG_CTL_TIMEOUT_S),
            "-o", options,
            "start",
        ]  # fmt: skip
        subreaper = _set_child_subreaper(True)
        try:
            proc = run(start_cmd, cwd=cluster.base, timeout=PG_CTL_TIMEOUT_S + 30)
        finally:
            if subreaper:
                _set_child_subreaper(False)
        if subreaper:
            cluster.postmaster_pid = _read_postmaster_pid(cluster.data)
        if proc.returncode == 0:
            cluster.port = port
            return cluster
        errors.append(
            f"`pg_ctl start` on port {port} failed (exit {proc.returncode}): "
            f"{proc.stderr.strip()}\n{_tail(cluster.log)}"
        )
        with contextlib.suppress(Exception):
            run([pg_ctl, "-D", str(cluster.data), "-m", "immediate", "stop"],
                cwd=cluster.base, timeout=60)
        if cluster.postmaster_pid is not None:
            _reap_child(cluster.postmaster_pid, timeout=5)
            cluster.postmaster_pid = None
    raise Unavailable("\n".join(errors))


def from_binaries() -> PostgresServer:
    return PostgresServer(url=start_cluster().url(), source="binaries")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _make_base_dir() -> Path:
    """Temp dir for the cluster; when root it is chowned to, and verified usable by, postgres."""
    roots: list[str] = [tempfile.gettempdir()]
    if os.geteuid() == 0:
        roots += ["/tmp", "/var/tmp", "/dev/shm"]
    last_error = "no usable temporary directory"
    for root in dict.fromkeys(roots):
        if not os.path.isdir(root):
            continue
        base = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=root))
        (base / OWNER_FILE).write_text(str(os.getpid()))
        if os.geteuid() != 0:
            return base
        shutil.chown(base, user=OS_USER, group=None)
        base.chmod(0o700)
        # Every ancestor must be traversable by postgres, e.g. not a TMPDIR under /root.
        check = subprocess.run(
            as_postgres_user(["test", "-w", str(base), "-a", "-x", str(base)]),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
            timeout=30,
        )
        if check.returncode == 0:
            return base
        last_error = f"{base} is not writable by the '{OS_USER}' OS user"
        shutil.rmtree(base, ignore_errors=True)
    raise Unavailable(last_error)


def _stop_cluster(pg_ctl: str, base: Path, postmaster_pid: int | None = None) -> None:
    data = base / "data"
    if (data / "postmaster.pid").exists():
        with contextlib.suppress(Exception):
            run([pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"], cwd=base, timeout=60)
    if postmaster_pid is not None:
        _reap_child(postmaster_pid)
    shutil.rmtree(base, ignore_errors=True)


def _set_child_subreaper(enabled: bool) -> bool:
    """Linux: adopt orphaned descendants (so the daemonised postmaster becomes our child).

    Without this the postmaster is re-parented to PID 1 once ``pg_ctl`` exits; in containers
    whose PID 1 is not a real init it then lingers as a ``<defunct>`` zombie after shutdown.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, int(enabled), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _read_postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split("\n", 1)[0].strip())
    except (OSError, ValueError):
        return None


def _reap_child(pid: int, timeout: float = 10.0) -> None:
    """Collect the exit status of ``pid`` if it is our (adopted) child; no-op otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # not our child (or already reaped)
        if done != 0 or time.monotonic() > deadline:
            return
        time.sleep(0.02)


def _reap_stale_clusters(pg_ctl: str) -> None:
    """Stop and delete clusters left behind by test processes that died without atexit."""
    roots = {tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"}
    for root in roots:
        for entry in glob.glob(os.path.join(root, TMP_PREFIX + "*")):
            base = Path(entry)
            try:
                owner = int((base / OWNER_FILE).read_text().strip())
            except (OSError, ValueError):
                continue  # being created right now, or not ours
            if owner == os.getpid() or _pid_alive(owner):
                continue
            _stop_cluster(pg_ctl, base)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
