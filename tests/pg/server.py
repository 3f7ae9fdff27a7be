"""Which PostgreSQL the test suite uses: the first strategy that works, once per process.

a. ``TEST_POSTGRES_URL`` (``tests/pg/env.py``): an explicit setting must work.
b. testcontainers (``tests/pg/containers.py``), only if a Docker engine answers.
c. A throwaway cluster from the installed binaries (``tests/pg/cluster.py``).
d. Otherwise a `RuntimeError` saying what to install or set. Never a silent skip.
"""

from __future__ import annotations

import os
import threading

from tests.pg.cluster import from_binaries
from tests.pg.common import ENV_VAR, PostgresServer, Unavailable
from tests.pg.containers import docker_unavailable_reason, from_testcontainers
from tests.pg.env import from_env

HOW_TO_FIX = (
    "install PostgreSQL server binaries (apt-get install postgresql, which provides "
    "initdb/pg_ctl under /usr/lib/postgresql/<version>/bin) "
    f"or set {ENV_VAR}=postgresql://user@host:port/db "
    "or start a Docker engine (for testcontainers)"
)

_lock = threading.Lock()
_server: PostgresServer | None = None
_failure: RuntimeError | None = None


def start_postgres() -> PostgresServer:
    """Return a running PostgreSQL server, starting one if needed (cached per process).

    Raises `RuntimeError` (with installation hints) if no server can be found or
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


def _resolve() -> PostgresServer:
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw:
        # An explicit setting must work; do not fall back to something else behind the
        # user's back.
        return from_env(raw)

    problems: list[str] = []

    docker_problem = docker_unavailable_reason()
    if docker_problem is None:
        try:
            return from_testcontainers()
        except Exception as exc:  # any failure: try the next strategy
            problems.append(f"testcontainers: {type(exc).__name__}: {exc}")
    else:
        problems.append(f"testcontainers: {docker_problem}")

    try:
        return from_binaries()
    except Unavailable as exc:
        problems.append(f"local binaries: {exc}")

    details = "\n".join(f"  - {p}" for p in problems)
    raise RuntimeError(
        f"No PostgreSQL available for the test suite. To fix: {HOW_TO_FIX}.\nTried:\n{details}"
    )
