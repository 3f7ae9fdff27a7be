"""The Citus-specific bits of the store: the distribution of the schema.

turnlog on Citus (distributed PostgreSQL) shards every session table by
`session_id`, colocated with `sessions`, so that everything one append
touches sits on one worker and the append stays a single-worker transaction
(router-executed, committed with one-phase commit). Small tables not keyed
by session (CI metric history, gate baselines) become reference tables
(a copy on every node).

Citus requires every primary key and unique constraint of a distributed
table to contain the distribution column: `sessions` and `events` are keyed
by a row id / position alone elsewhere, so on Citus their primary keys
become `(session_id, id)` and `(session_id, position)` — ids still come from
one sequence on the coordinator, positions from the coordinator's transaction
ids (migration 0012), so both stay unique.

The immutability triggers of the log tables are created on every shard
(`citus.enable_unsafe_triggers`: Citus cannot prove a trigger only touches
its own shard; ours touches nothing, it only refuses).

Refuses: detecting Citus (`app/store/engine/dialect.py` `has_citus`, like every
backend branch), anything about the feed's order (see `app/store/engine/dialect.py`), and
multi-session writes (none exist: an event is always inserted by a
transaction that touches one session, which is what keeps the feed fence
valid on Citus).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

# Tables distributed by session_id, in an order where a referenced table comes first.
DISTRIBUTED: tuple[str, ...] = ("sessions", "session_labels", "events", "r3_patches", "nodes",
                                "samples")
# Small shared tables: one full copy per node.
REFERENCE: tuple[str, ...] = ("metric_submissions", "metric_points", "gate_baselines")
# Consumer-group tables stay plain tables on the coordinator: a claim takes any
# sessions of a group with `FOR UPDATE SKIP LOCKED`, which Citus cannot run over
# shards, and an ack touches many sessions at once, which on shards would be a
# two-phase commit — whose worker commits follow the coordinator's, breaking
# the ack list's transaction-id fence. On the coordinator both are one node's.
# A close still enqueues its session in the same transaction: the close's
# worker commits first (one-phase), then the coordinator's own rows.
COORDINATOR_LOCAL: tuple[str, ...] = ("consumer_groups", "consumer_claims",
                                      "consumer_sessions", "consumer_acks")
# Primary keys without the distribution column: (table, constraint, columns elsewhere).
WIDENED_KEYS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("sessions", "pk_sessions", ("id",)),
    ("events", "pk_events", ("position",)),
)
DISTRIBUTION_COLUMN = "session_id"


def _exists(connection: Connection, table: str) -> bool:
    return connection.execute(sa.text("SELECT to_regclass(:t) IS NOT NULL"),
                              {"t": table}).scalar_one()


def _is_reference(connection: Connection, table: str) -> bool:
    return connection.execute(sa.text(
        "SELECT 1 FROM pg_dist_partition WHERE logicalrelid = to_regclass(:t) "
        "AND partmethod = 'n' AND repmodel = 't'"), {"t": table}).first() is not None


def _is_distributed(connection: Connection, table: str) -> bool:
    return connection.execute(sa.text(
        "SELECT 1 FROM pg_dist_partition WHERE logicalrelid = to_regclass(:t)"),
        {"t": table}).first() is not None


def distribute(execute: Callable[[str], object], connection: Connection,
               tables: Sequence[str] = DISTRIBUTED,
               reference: Sequence[str] = REFERENCE) -> None:
    """Distribute `tables` by session_id (colocated with `sessions`), make `reference`
    reference tables; tables that do not exist or are already done are left alone.

    `execute` runs one SQL statement (alembic's `op.execute` in a migration), so
    later migrations that add a session table call this with just that table.
    """
    execute("SET LOCAL citus.enable_unsafe_triggers = on")
    # DDL over several shards of tables that reference each other must run on one
    # connection per worker.
    execute("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
    for table, constraint, columns in WIDENED_KEYS:
        if table in tables and _exists(connection, table) and not _is_distributed(
                connection, table):
            execute(f"ALTER TABLE {table} DROP CONSTRAINT {constraint}")
            execute(f"ALTER TABLE {table} ADD CONSTRAINT {constraint} PRIMARY KEY "
                    f"({DISTRIBUTION_COLUMN}, {', '.join(columns)})")
    for table in tables:
        if not _exists(connection, table) or _is_distributed(connection, table):
            continue
        colocate = "" if table == "sessions" else ", colocate_with => 'sessions'"
        execute(f"SELECT create_distributed_table('{table}', '{DISTRIBUTION_COLUMN}'"
                f"{colocate})")
    for table in reference:
        # A table referencing a reference table by a foreign key is made a Citus
        # *local* table (the coordinator's alone) when that one becomes a reference:
        # `metric_points` did. create_reference_table turns it into a reference too.
        if _exists(connection, table) and not _is_reference(connection, table):
            execute(f"SELECT create_reference_table('{table}')")


def undistribute(execute: Callable[[str], object], connection: Connection,
                 tables: Sequence[str] = DISTRIBUTED,
                 reference: Sequence[str] = REFERENCE) -> None:
    """The inverse of `distribute`: plain local tables with their original keys."""
    execute("SET LOCAL citus.enable_unsafe_triggers = on")
    execute("SET LOCAL citus.multi_shard_modify_mode = 'sequential'")
    for table in (*reversed(reference), *reversed(tables)):
        if _exists(connection, table) and _is_distributed(connection, table):
            execute(f"SELECT undistribute_table('{table}', cascade_via_foreign_keys => true)")
    for table, constraint, columns in WIDENED_KEYS:
        if table in tables and _exists(connection, table):
            execute(f"ALTER TABLE {table} DROP CONSTRAINT {constraint}")
            execute(f"ALTER TABLE {table} ADD CONSTRAINT {constraint} PRIMARY KEY "
                    f"({', '.join(columns)})")
