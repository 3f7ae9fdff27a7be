"""Shared fixtures: every store and API test runs on SQLite, a real PostgreSQL and Citus.

`db_url` is parametrized over the three backends; the PostgreSQL server comes from
`tests/pg/` (TEST_POSTGRES_URL, testcontainers, or a throwaway cluster
from the installed binaries) and its absence fails the run, never skips it.
The Citus cluster (one coordinator, two workers) comes from `tests/citusserver.py`;
it is skipped only where the bundled installer says Citus does not apply to
the machine (exit 3), any other failure fails. Tests marked `not_citus` (the
slow property and fuzz suites) run on SQLite and PostgreSQL only.
Each backend gets one fresh database per test process, built by the real
migrations; tests isolate themselves with unique session ids.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from app.main import create_app
from app.settings import Settings
from app.store.engine import migrate
from tests.citusserver import (
    CitusCluster,
    CitusUnavailable,
    create_citus_database,
    start_citus,
)
from tests.pg import PostgresServer, create_database, drop_database, start_postgres

BACKENDS = ("sqlite", "postgres", "citus")
# The in-process clients talk to "http://turnlog": without tokens the app answers only
# loopback host names and TURNLOG_ALLOWED_HOSTS (tests/fuzz/test_hardening.py checks that).
os.environ.setdefault("TURNLOG_ALLOWED_HOSTS", "turnlog")


def _one_default_tls_context() -> None:
    """Every `httpx.Client()` / `AsyncClient()` built with the default `verify` shares
    one TLS context in the test processes.

    httpx builds a context per client, loading the whole CA bundle (~40 ms of CPU here),
    even for a plain-http URL or an in-process ASGI app; the tests build thousands of
    clients (each `wait_ready`, each `client` fixture), and a profile of a suite worker
    showed 8-14 % of its CPU there. A context is only read once built, so one serves
    every client. Anything but the defaults goes to httpx unchanged."""
    from httpx._transports import default

    build = default.create_ssl_context
    shared: list[object] = []

    def create_ssl_context(verify: object = True, cert: object = None,
                           trust_env: bool = True) -> object:
        if verify is not True or cert is not None or not trust_env:
            return build(verify=verify, cert=cert, trust_env=trust_env)  # type: ignore[arg-type]
        if not shared:
            shared.append(build())
        return shared[0]

    default.create_ssl_context = create_ssl_context  # type: ignore[assignment]


_one_default_tls_context()


def _one_click_command_per_app() -> None:
    """`CliRunner.invoke(app, …)` builds the click command of a typer app once per app
    in the test processes, not once per call.

    Typer rebuilds the whole command tree from the functions' signatures on every
    `invoke` (~50 ms of CPU for `turnlog`'s), and the command-line tests invoke it
    hundreds of times; a click command holds no state between invocations (each gets a
    new context), as `turnlog`'s own `main` reuses one for its single call."""
    import weakref

    import typer.testing

    build = typer.testing._get_command
    built: weakref.WeakKeyDictionary[typer.Typer, object] = weakref.WeakKeyDictionary()

    def get_command(app: typer.Typer) -> object:
        if app not in built:
            built[app] = build(app)
        return built[app]

    typer.testing._get_command = get_command  # type: ignore[assignment]


_one_click_command_per_app()

# Database URLs handed out on the Citus cluster (they look like any PostgreSQL URL).
CITUS_URLS: set[str] = set()


def pytest_configure(config: pytest.Config) -> None:
    """Byte-compile turnlog's own modules once, in the controlling process.

    The tests start hundreds of `turnlog` processes (servers, gateways, commands,
    forked from `tests/forkserver.py` before anything of turnlog is imported), and
    each imports `app` afresh. Where `PYTHONDONTWRITEBYTECODE` is set (these
    machines set it), no interpreter writes a `.pyc`, so every one of them compiled
    the same ~165 sources again (~0.25 s of CPU a process; ~16 % of the gateway
    fault and crash tests' CPU). `compileall` writes them regardless; an
    interpreter still checks each against its source's time and size, so a stale
    one is never used."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller did it
        return
    import compileall

    root = Path(__file__).resolve().parents[1]
    for package in (root / "app", root / "client" / "turnlog_client"):
        compileall.compile_dir(package, quiet=1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `not_citus` keep their SQLite and PostgreSQL runs only."""
    skip = pytest.mark.skip(reason="not run on Citus: slow property/fuzz suite (CI time)")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (callspec is not None and callspec.params.get("db_url") == "citus"
                and item.get_closest_marker("not_citus")):
            item.add_marker(skip)


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


@pytest.fixture(scope="session")
def postgres_server() -> PostgresServer:
    try:
        return start_postgres()
    except RuntimeError as exc:
        pytest.fail(f"PostgreSQL is required for the store tests: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def citus_cluster() -> CitusCluster:
    try:
        return start_citus()
    except CitusUnavailable as exc:
        pytest.skip(str(exc))
    except RuntimeError as exc:
        pytest.fail(f"the Citus test cluster did not start: {exc}", pytrace=False)


def sqlite_url(directory: Path, name: str) -> str:
    return f"sqlite+aiosqlite:///{directory / name}.db"


# Where `start_postgres` found a server nobody else uses, gone when the run ends; the
# Citus cluster is always one (`start_citus` starts it for this process).
THROWAWAY_SOURCES = frozenset({"binaries", "testcontainers"})


@pytest.fixture(scope="session")
def fresh_database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[object]:
    """A factory `fresh(backend) -> url` of empty databases (not migrated)."""
    created: list[str] = []
    server: list[PostgresServer] = []

    def fresh(backend: str) -> str:
        name = f"turnlog_{_worker()}_{uuid.uuid4().hex[:8]}"
        if backend == "sqlite":
            return sqlite_url(tmp_path_factory.mktemp("db"), name)
        if backend == "citus":
            cluster = request.getfixturevalue("citus_cluster")
            url = create_citus_database(cluster, name)
            CITUS_URLS.add(url)
            return url
        if not server:
            server.append(request.getfixturevalue("postgres_server"))
        created.append(name)
        return create_database(server[0], name)

    yield fresh
    # A server this run started (a cluster of the installed binaries, a container) goes
    # with its databases when the run ends; dropping them one by one first cost each
    # test process seconds (a Citus database on three nodes, its maintenance daemon
    # terminated first). A server the developer named keeps nothing of the run.
    if server and server[0].source not in THROWAWAY_SOURCES:
        for name in created:
            drop_database(server[0], name)


@pytest.fixture(scope="session", params=BACKENDS)
def db_url(request: pytest.FixtureRequest, fresh_database: object) -> str:
    """A migrated database per backend, shared by the tests of this process."""
    url: str = fresh_database(request.param)  # type: ignore[operator]
    migrate.upgrade(url)
    return url


def backend_of(url: str) -> str:
    if url.startswith("sqlite"):
        return "sqlite"
    return "citus" if url in CITUS_URLS else "postgres"


@pytest.fixture
def backend(db_url: str) -> str:
    return backend_of(db_url)


POSTGRES_ONLY = "PostgreSQL only"


@pytest.fixture(autouse=True)
def _postgres_only(request: pytest.FixtureRequest) -> None:
    """`@pytest.mark.postgres_only`: on SQLite the test is reported "skipped: PostgreSQL
    only" (counted as such), never a pass that checked nothing. Citus is PostgreSQL.

    Decided from the test's `db_url` parameter before any database is touched.
    """
    marker = request.node.get_closest_marker("postgres_only")
    if marker is None:
        return
    callspec = getattr(request.node, "callspec", None)
    param = None if callspec is None else callspec.params.get("db_url")
    if param is None:
        raise pytest.UsageError(f"{request.node.nodeid}: postgres_only needs the db_url fixture")
    if param == "sqlite":
        pytest.skip(marker.kwargs.get("reason", POSTGRES_ONLY))


@pytest.fixture
def settings(db_url: str) -> Settings:
    # Tokens from the developer's environment would turn every API test into a 401.
    return Settings.load(database_url=db_url, migrate_on_start=False, api_tokens="")


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://turnlog") as http:
        yield http
    await app.state.services.db.dispose()


@pytest.fixture
def sid() -> str:
    return f"s-{uuid.uuid4().hex}"
