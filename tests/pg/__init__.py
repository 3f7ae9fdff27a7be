"""A real PostgreSQL server for the test suite and the benchmarks.

`start_postgres` finds or starts one (``server.py``: TEST_POSTGRES_URL,
testcontainers, or a throwaway cluster from the installed binaries);
`create_database` / `drop_database` manage scratch databases on it
(``admin.py``); `start_cluster` starts an extra throwaway cluster with its own
``postgresql.conf`` settings (``cluster.py``), for suites that need a
differently configured server.
"""

from tests.pg.admin import create_database, drop_database
from tests.pg.cluster import Cluster, start_cluster
from tests.pg.common import PostgresServer, Unavailable
from tests.pg.server import start_postgres

__all__ = ["Cluster", "PostgresServer", "Unavailable", "create_database", "drop_database",
           "start_cluster", "start_postgres"]
