"""What every way of finding PostgreSQL shares: the server handle, names, the error type."""

from __future__ import annotations

from dataclasses import dataclass

ENV_VAR = "TEST_POSTGRES_URL"
DB_SUPERUSER = "postgres"
MAINTENANCE_DB = "postgres"
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PostgresServer:
    """A reachable PostgreSQL server.

    ``url`` is a ``postgresql+asyncpg://`` admin URL pointing at the maintenance database;
    ``source`` is one of ``"env"``, ``"testcontainers"`` or ``"binaries"``.
    """

    url: str
    source: str


class Unavailable(Exception):
    """A strategy cannot provide a server (reason in the message)."""
