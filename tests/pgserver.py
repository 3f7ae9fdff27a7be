"""Kept for `from tests.pgserver import …`: the code lives in the `tests.pg` package."""

from tests.pg import (
    Cluster,
    PostgresServer,
    Unavailable,
    create_database,
    drop_database,
    start_cluster,
    start_postgres,
)

__all__ = ["Cluster", "PostgresServer", "Unavailable", "create_database", "drop_database",
           "start_cluster", "start_postgres"]
