"""Locate or start a real PostgreSQL server for the test suite.

Resolution order (first one that works wins):

a. ``TEST_POSTGRES_URL`` environment variable (``postgresql://``, ``postgres://`` or
   ``postgresql+asyncpg://``; normalised to ``postgresql+asyncpg://``).
b. testcontainers (``postgres:16``), only if a Docker engine actually answers a ping.
c. A throwaway cluster built with locally installed server binaries (``initdb``/``pg_ctl``),
   run as the ``postgres`` OS user when this process is root.
d. Otherwise a :class:`RuntimeError` explaining what to install or set. Never a silent skip.

The server is started at most once per process (``start_postgres`` caches it) and is stopped
by an ``atexit`` hook. Under pytest-xdist every worker process gets its own server.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import glob
import importlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.engine import URL, make_url

__all__ = ["PostgresServer", "create_database", "drop_database", "start_postgres"]

ENV_VAR = "TEST_POSTGRES_URL"
CONTAINER_IMAGE = "postgres:16"
OS_USER = "postgres"
DB_SUPERUSER = "postgres"
MAINTENANCE_DB = "postgres"
TMP_PREFIX = "turnlog-pg-"
OWNER_FILE = "owner.pid"
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>

CONNECT_TIMEOUT_S = 10.0
PG_CTL_TIMEOUT_S = 60

HOW_TO_FIX = (
    "install PostgreSQL server binaries (apt-get install postgresql, which provides "
    "initdb/pg_ctl under /usr/lib/postgresql/<version>/bin) "
    f"or set {ENV_VAR}=postgresql://user@host:port/db "
    "or start a Docker engine (for testcontainers)"
)

_T = TypeVar("_T")


@dataclass(frozen=True)
class PostgresServer:
    """A reachable PostgreSQL server.

    ``url`` is a ``postgresql+asyncpg://`` admin URL pointing at the maintenance database;
    ``source`` is one of ``"env"``, ``"testcontainers"`` or ``"binaries"``.
    """

    url: str
    source: str


_lock = threading.Lock()
_server: PostgresServer | None = None
_failure: RuntimeError | None = None


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------


def start_postgres() -> PostgresServer:
    """Return a running PostgreSQL server, starting one if needed (cached per process).

    Raises :class:`RuntimeError` (with installation hints) if no server can be found or
    started. A failure is cached too, so repeated calls fail fast.
    """
    global _server, _failure
    with _lock:
        if _server is not None:
            return _server
        if _failure is not None:
            raise _failure
        try:
            _server = _resolve()
        except RuntimeError as exc:
            _failure = exc
            raise
        return _server


def create_database(server: PostgresServer, name: str) -> str:
    """Create a fresh, empty database ``name`` (dropping any existing one first).

    Safe to call from synchronous code and from inside a running event loop (the work runs
    on a helper thread with its own loop). Returns the database's ``postgresql+asyncpg://``
    URL.
    """
    admin = make_url(server.url)
    ident = _quote_ident(name)

    async def work() -> None:
        conn = await _connect(admin)
        try:
            await _terminate_and_drop(conn, name, ident)
            await conn.execute(f"CREATE DATABASE {ident} TEMPLATE template0 ENCODING 'UTF8'")
        finally:
            await conn.close()

    _run_in_thread(work)
    return admin.set(database=name).render_as_string(hide_password=False)


def drop_database(server: PostgresServer, name: str) -> None:
    """Terminate all connections to ``name`` and drop it if it exists."""
    admin = make_url(server.url)
    ident = _quote_ident(name)

    async def work() -> None:
        conn = await _connect(admin)
        try:
            await _terminate_and_drop(conn, name, ident)
        finally:
            await conn.close()

    _run_in_thread(work)


# --------------------------------------------------------------------------------------
# resolution
# --------------------------------------------------------------------------------------


def _resolve() -> PostgresServer:
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw:
        # An explicit setting must work; do not fall back to something else behind the
        # user's back.
        return _from_env(raw)

    problems: list[str] = []

    docker_problem = _docker_unavailable_reason()
    if docker_problem is None:
        try:
            return _from_testcontainers()
        except Exception as exc:  # any failure: try the next strategy
            problems.append(f"testcontainers: {type(exc).__name__}: {exc}")
    else:
        problems.append(f"testcontainers: {docker_problem}")

    try:
        return _from_binaries()
    except _Unavailable as exc:
        problems.append(f"local binaries: {exc}")

    details = "\n".join(f"  - {p}" for p in problems)
    raise RuntimeError(
        f"No PostgreSQL available for the test suite. To fix: {HOW_TO_FIX}.\nTried:\n{details}"
    )


class _Unavailable(Exception):
    """A strategy cannot provide a server (reason in the message)."""


# ---- a. environment ----------------------------------------------------------------------


def _normalise_url(raw: str) -> URL:
    try:
        url = make_url(raw)
    except Exception as exc:  # sqlalchemy raises ArgumentError/ValueError
        raise RuntimeError(f"{ENV_VAR}={raw!r} is not a valid database URL: {exc}") from exc
    if url.get_backend_name() not in ("postgresql", "postgres"):
        raise RuntimeError(
            f"{ENV_VAR} must be a postgresql://, postgres:// or postgresql+asyncpg:// URL, "
            f"got driver {url.drivername!r}"
        )
    url = url.set(drivername="postgresql+asyncpg")
    if not url.database:
        url = url.set(database=MAINTENANCE_DB)
    return url


def _from_env(raw: str) -> PostgresServer:
    url = _normalise_url(raw)

    async def probe() -> None:
        conn = await _connect(url)
        await conn.close()

    try:
        _run_in_thread(probe)
    except Exception as exc:  # report any connection failure clearly
        shown = url.render_as_string(hide_password=True)
        raise RuntimeError(
            f"{ENV_VAR} is set but PostgreSQL at {shown} is not reachable: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return PostgresServer(url=url.render_as_string(hide_password=False), source="env")


# ---- b. testcontainers ---------------------------------------------------------------------


def _docker_unavailable_reason() -> str | None:
    """``None`` if a Docker engine answers a ping, else a short reason."""
    try:
        docker: Any = importlib.import_module("docker")
    except ImportError:
        return "python package 'docker' is not installed"
    try:
        client = docker.from_env(timeout=3)
    except Exception as exc:
        return f"no Docker engine ({type(exc).__name__})"
    try:
        client.ping()
    except Exception as exc:
        return f"no Docker engine answering ({type(exc).__name__})"
    finally:
        with contextlib.suppress(Exception):
            client.close()
    return None


def _postgres_container_class() -> Any:
    for module_name in ("testcontainers.community.postgres", "testcontainers.postgres"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cls = getattr(module, "PostgresContainer", None)
        if cls is not None:
            return cls
    raise _Unavailable("testcontainers with the postgres module is not installed")


def _from_testcontainers() -> PostgresServer:
    cls = _postgres_container_class()
    container: Any = cls(CONTAINER_IMAGE)
    container.start()
    atexit.register(_stop_container, container, os.getpid())
    url = URL.create(
        "postgresql+asyncpg",
        username=str(container.username),
        password=str(container.password),
        host=str(container.get_container_host_ip()),
        port=int(container.get_exposed_port(5432)),
        # POSTGRES_USER is a superuser in the official image, so the maintenance DB works.
        database=MAINTENANCE_DB,
    )
    return PostgresServer(url=url.render_as_string(hide_password=False), source="testcontainers")


def _stop_container(container: Any, owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # forked child: not ours to stop
        return
    with contextlib.suppress(Exception):
        container.stop()


# ---- c. local binaries ---------------------------------------------------------------------


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path))


def _find_bindir() -> Path:
    """Directory holding both ``initdb`` and ``pg_ctl``."""
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
    raise _Unavailable(
        "initdb/pg_ctl not found on PATH, via `pg_config --bindir`, "
        "or under /usr/lib/postgresql/*/bin"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ensure_os_user() -> None:
    """Make sure the ``postgres`` OS user exists (only called when running as root)."""
    import pwd

    try:
        pwd.getpwnam(OS_USER)
        return
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        raise _Unavailable(
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
        raise _Unavailable(
            f"running as root and could not create the '{OS_USER}' OS user with useradd: "
            f"{proc.stderr.strip() or proc.returncode}"
        )


def _as_postgres_user(cmd: Sequence[str]) -> list[str]:
    """Wrap ``cmd`` so it runs as the ``postgres`` OS user when we are root."""
    if os.geteuid() != 0:
        return list(cmd)
    runuser = shutil.which("runuser")
    if runuser:
        return [runuser, "-u", OS_USER, "--", *cmd]
    su = shutil.which("su")
    if su:
        return [su, OS_USER, "-s", "/bin/sh", "-c", shlex.join(cmd)]
    raise _Unavailable(
        "running as root but neither `runuser` nor `su` is available to drop privileges "
        f"to the '{OS_USER}' user (initdb/pg_ctl refuse to run as root)"
    )


def _child_env() -> dict[str, str]:
    # Stray PG* variables (PGDATA, PGPORT, PGHOST, ...) must not steer initdb/pg_ctl.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    env["LANG"] = "C"
    return env


def _run(cmd: Sequence[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _as_postgres_user(cmd),
        cwd=cwd,
        env=_child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


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
            _as_postgres_user(["test", "-w", str(base), "-a", "-x", str(base)]),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
            timeout=30,
        )
        if check.returncode == 0:
            return base
        last_error = f"{base} is not writable by the '{OS_USER}' OS user"
        shutil.rmtree(base, ignore_errors=True)
    raise _Unavailable(last_error)


def _stop_cluster(pg_ctl: str, base: Path, postmaster_pid: int | None = None) -> None:
    data = base / "data"
    if (data / "postmaster.pid").exists():
        with contextlib.suppress(Exception):
            _run([pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"], cwd=base, timeout=60)
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


@dataclass
class _Cluster:
    pg_ctl: str
    base: Path
    owner_pid: int
    postmaster_pid: int | None = None

    def cleanup(self) -> None:
        if os.getpid() != self.owner_pid:  # forked child: not ours to stop
            return
        _stop_cluster(self.pg_ctl, self.base, self.postmaster_pid)


def _from_binaries() -> PostgresServer:
    bindir = _find_bindir()
    initdb = str(bindir / "initdb")
    pg_ctl = str(bindir / "pg_ctl")

    if os.geteuid() == 0:
        _ensure_os_user()
        _as_postgres_user(["true"])  # fail early if we cannot drop privileges

    with contextlib.suppress(Exception):
        _reap_stale_clusters(pg_ctl)

    base = _make_base_dir()
    cluster = _Cluster(pg_ctl=pg_ctl, base=base, owner_pid=os.getpid())
    atexit.register(cluster.cleanup)
    data = base / "data"
    log = base / "postgres.log"

    proc = _run(
        [
            initdb,
            "-D", str(data),
            "-A", "trust",
            "-U", DB_SUPERUSER,
            "--no-sync",
            "-E", "UTF8",
            "--locale=C",
        ],
        cwd=base,
        timeout=180,
    )  # fmt: skip
    if proc.returncode != 0:
        raise _Unavailable(
            f"`{initdb}` failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}".strip()
        )

    errors: list[str] = []
    for _attempt in range(3):  # the free port can be grabbed by someone else in between
        port = _free_port()
        options = (
            f"-p {port} -k {shlex.quote(str(base))} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            "-c max_connections=200"
        )
        start_cmd = [
            pg_ctl,
            "-D", str(data),
            "-l", str(log),  # must not inherit our pipes, or pg_ctl never "finishes"
            "-w",
            "-t", str(PG_CTL_TIMEOUT_S),
            "-o", options,
            "start",
        ]  # fmt: skip
        subreaper = _set_child_subreaper(True)
        try:
            proc = _run(start_cmd, cwd=base, timeout=PG_CTL_TIMEOUT_S + 30)
        finally:
            if subreaper:
                _set_child_subreaper(False)
        if subreaper:
            cluster.postmaster_pid = _read_postmaster_pid(data)
        if proc.returncode == 0:
            url = URL.create(
                "postgresql+asyncpg",
                username=DB_SUPERUSER,
                host="127.0.0.1",
                port=port,
                database=MAINTENANCE_DB,
            )
            return PostgresServer(url=url.render_as_string(hide_password=False), source="binaries")
        errors.append(
            f"`pg_ctl start` on port {port} failed (exit {proc.returncode}): "
            f"{proc.stderr.strip()}\n{_tail(log)}"
        )
        with contextlib.suppress(Exception):
            _run([pg_ctl, "-D", str(data), "-m", "immediate", "stop"], cwd=base, timeout=60)
        if cluster.postmaster_pid is not None:
            _reap_child(cluster.postmaster_pid, timeout=5)
            cluster.postmaster_pid = None
    raise _Unavailable("\n".join(errors))


# --------------------------------------------------------------------------------------
# asyncpg helpers
# --------------------------------------------------------------------------------------


def _quote_ident(name: str) -> str:
    if not name or "\x00" in name:
        raise ValueError(f"invalid database name: {name!r}")
    return '"' + name.replace('"', '""') + '"'


async def _connect(url: URL) -> Any:
    import asyncpg

    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    return await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT_S)


async def _terminate_and_drop(conn: Any, name: str, ident: str) -> None:
    for attempt in range(5):
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {ident}")
            return
        except Exception as exc:
            # ObjectInUseError: a client reconnected between terminate and drop; retry.
            if type(exc).__name__ != "ObjectInUseError" or attempt == 4:
                raise
            await asyncio.sleep(0.1 * (attempt + 1))


def _run_in_thread(fn: Callable[[], Awaitable[_T]]) -> _T:
    """Run ``fn()`` to completion on a fresh event loop in a helper thread."""
    result: list[_T] = []
    error: list[BaseException] = []

    async def main() -> _T:
        return await fn()

    def target() -> None:
        try:
            result.append(asyncio.run(main()))
        except BaseException as exc:  # re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="pgserver-admin", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


# --------------------------------------------------------------------------------------
# a cluster of one's own, to stop and start (fault tests)
# --------------------------------------------------------------------------------------


@dataclass
class StoppableCluster:
    """A private PostgreSQL cluster from the local binaries that a test may stop
    (`pg_ctl stop -m immediate`, i.e. a crash) and start again on the same port."""

    pg_ctl: str
    base: Path
    port: int
    url: str
    postmaster_pid: int | None = None

    @property
    def data(self) -> Path:
        return self.base / "data"

    def _options(self) -> str:
        return (f"-p {self.port} -k {shlex.quote(str(self.base))} "
                "-c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100")

    def start(self) -> None:
        subreaper = _set_child_subreaper(True)
        try:
            proc = _run([self.pg_ctl, "-D", str(self.data), "-l", str(self.base / "pg.log"),
                         "-w", "-t", str(PG_CTL_TIMEOUT_S), "-o", self._options(), "start"],
                        cwd=self.base, timeout=PG_CTL_TIMEOUT_S + 30)
        finally:
            if subreaper:
                _set_child_subreaper(False)
        if subreaper:
            self.postmaster_pid = _read_postmaster_pid(self.data)
        if proc.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {proc.stderr}\n{_tail(self.base / 'pg.log')}")

    def stop(self, mode: str = "immediate") -> None:
        _run([self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop"], cwd=self.base,
             timeout=60)
        if self.postmaster_pid is not None:
            _reap_child(self.postmaster_pid)
            self.postmaster_pid = None

    def remove(self) -> None:
        _stop_cluster(self.pg_ctl, self.base, self.postmaster_pid)
        self.postmaster_pid = None


def stoppable_cluster() -> StoppableCluster:
    """Init and start a private cluster (raises RuntimeError without local binaries)."""
    try:
        bindir = _find_bindir()
        if os.geteuid() == 0:
            _ensure_os_user()
        base = _make_base_dir()
    except _Unavailable as exc:
        raise RuntimeError(f"no PostgreSQL binaries for a private cluster: {exc}") from exc
    proc = _run([str(bindir / "initdb"), "-D", str(base / "data"), "-A", "trust",
                 "-U", DB_SUPERUSER, "--no-sync", "-E", "UTF8", "--locale=C"],
                cwd=base, timeout=180)
    if proc.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(f"initdb failed: {proc.stderr}")
    port = _free_port()
    url = URL.create("postgresql+asyncpg", username=DB_SUPERUSER, host="127.0.0.1",
                     port=port, database=MAINTENANCE_DB).render_as_string(hide_password=False)
    cluster = StoppableCluster(str(bindir / "pg_ctl"), base, port, url)
    atexit.register(cluster.remove)
    cluster.start()
    return cluster
