"""Strategy a: the server named by ``TEST_POSTGRES_URL`` (it must answer; no fallback)."""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url

from tests.pg.admin import connect, run_in_thread
from tests.pg.common import ENV_VAR, MAINTENANCE_DB, PostgresServer


def normalise_url(raw: str) -> URL:
    """``postgresql://``, ``postgres://`` or ``postgresql+asyncpg://`` → asyncpg, with a db."""
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


def from_env(raw: str) -> PostgresServer:
    url = normalise_url(raw)

    async def probe() -> None:
        conn = await connect(url)
        await conn.close()

    try:
        run_in_thread(probe)
    except Exception as exc:  # report any connection failure clearly
        shown = url.render_as_string(hide_password=True)
        raise RuntimeError(
            f"{ENV_VAR} is set but PostgreSQL at {shown} is not reachable: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return PostgresServer(url=url.render_as_string(hide_password=False), source="env")
