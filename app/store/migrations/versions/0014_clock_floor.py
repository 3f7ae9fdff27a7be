"""The store's clock knows its floor: a restore onto a server with lower transaction
ids moves it past the first id that may write an event (PostgreSQL and Citus).

Migration 0012 makes an event's position from its writer's transaction id and
refuses a writer whose id (on the store's clock) is not above `X0`, the id
0012 itself ran under: its position would fall below those already written.
After a restore onto another server, `turnlog_reclock()` raised the clock only
past the ids stamped on rows. A database restored with no row written since
0012 ran (an empty store; or the documented upgrade — back up, upgrade, move —
on a server whose ids had advanced since the last write) kept a clock below
`X0`: every write was refused, `migrate` changed nothing, and the server
answered 503 to every open and turn until the new server had used up the gap
(millions of ids on a busy shared server).

The clock now keeps `X0` as its floor (`turnlog_clock.xid_floor`, read here from
the position function 0012 wrote it into), and the reclock raises the clock
past the greater of the rows' ids and the floor. In normal operation the
floor is an id of the past, below every writer's, so nothing moves.

The reclock also runs on the first new connection after the server crashed or
started (`turnlog_reclock_after_start()`, below, on every new connection and
every migration run; `app/store/engine/dialect.py` `reclock`: a Citus
coordinator that crashes hands out again the ids of its last unflushed
commits, already stamped on durable worker rows), and it reads the rows before
the server's next id (below: 0012's order moved the clock on Citus with no
restore at all). SQLite gets the column and the table too (unused: the schema
is one; its `xid` is always 0).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

import importlib
import re
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 0012's guard, `IF v_xid <= {x0} THEN`: the floor as that migration wrote it.
FLOOR_IN_GUARD = re.compile(r"v_xid\s*<=\s*(\d+)")

# 0012's reclock (why it moves under the clock's lock: there), with the floor among the
# ids to pass, and judged in two statements, the rows' ids first. 0012 read the server's
# next id and the rows' ids in one statement, taken as one snapshot — but on Citus the
# rows are read on the workers, after the coordinator's snapshot was taken: a writer
# that took its id meanwhile and committed there looked like a row ahead of the server,
# and the clock moved in normal operation (every time, once the reclock ran on each new
# connection under concurrent writers). Read first, every row seen was stamped by a
# transaction whose id the later snapshot's xmax is past, on an offset no larger than
# today's: nothing moves unless the server's ids really are behind.
SEEN = """
  SELECT greatest((SELECT max(xid) FROM events), (SELECT max(xid) FROM sessions),
                  (SELECT max(xid) FROM consumer_acks),
                  (SELECT xid_floor FROM turnlog_clock WHERE id = 1))
    INTO v_seen;
  SELECT (SELECT xid_offset FROM turnlog_clock WHERE id = 1),
         pg_snapshot_xmax(pg_current_snapshot())::text::bigint
    INTO v_offset, v_next;"""
RECLOCK_LOCK = "29805, 0"  # (29804, hashtext(session_id)) is a session's writers' queue
RECLOCK_FN = f"""
CREATE OR REPLACE FUNCTION turnlog_reclock() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  v_offset bigint;
  v_next bigint;
  v_seen bigint;
BEGIN
  PERFORM pg_advisory_xact_lock({RECLOCK_LOCK});{SEEN}
  IF v_seen IS NULL OR v_seen < v_next + v_offset THEN
    RETURN v_offset;
  END IF;
  PERFORM set_config('lock_timeout', '30s', true);
  LOCK TABLE turnlog_clock IN ACCESS EXCLUSIVE MODE;{SEEN}
  IF v_seen >= v_next + v_offset THEN
    v_offset := v_seen - v_next + 1;
    UPDATE turnlog_clock SET xid_offset = v_offset WHERE id = 1;
  END IF;
  RETURN v_offset;
END
$$
"""


# What every new connection runs (`app/store/engine/dialect.py` `reclock`), and every
# migration run: the full reclock — which reads every shard on Citus, so it needs every
# worker up — only when the server may hand out ids already stamped on rows: after a
# crash (PostgreSQL's recovery empties the UNLOGGED `turnlog_clock_checked`, also when
# the postmaster only reinitialized after one backend died, keeping its start time), a
# restart, a restore onto another server or a failover (the start time kept in it
# differs: a replica's copy of an unlogged table is empty too). Other connections read
# that one local row. Reclocks queue on an advisory lock (0012's ran under the
# migrations' lock only): two that both read the clock and then asked for its lock
# deadlocked; the second one now finds the first one's check done.
CHECKED = """
  SELECT EXISTS (SELECT 1 FROM turnlog_clock_checked WHERE id = 1
                 AND started = pg_postmaster_start_time())"""
RECLOCK_AFTER_START_FN = f"""
CREATE OR REPLACE FUNCTION turnlog_reclock_after_start() RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  IF ({CHECKED}) THEN
    RETURN;
  END IF;
  PERFORM pg_advisory_xact_lock({RECLOCK_LOCK});
  IF ({CHECKED}) THEN
    RETURN;
  END IF;
  PERFORM turnlog_reclock();
  INSERT INTO turnlog_clock_checked (id, started) VALUES (1, pg_postmaster_start_time())
    ON CONFLICT (id) DO UPDATE SET started = EXCLUDED.started;
END
$$
"""


CHECKED_TABLE = "turnlog_clock_checked"


def checked_columns() -> list[sa.Column[object]]:
    return [sa.Column("id", sa.Integer,
                      sa.CheckConstraint("id = 1", name="ck_turnlog_clock_checked_one_row"),
                      primary_key=True, autoincrement=False),
            sa.Column("started", sa.DateTime(timezone=True), nullable=False)]


def floor_of(position_function: str) -> int:
    """`X0` from the text of 0012's `turnlog_event_position()`."""
    found = FLOOR_IN_GUARD.search(position_function)
    if found is None:
        raise RuntimeError("turnlog_event_position() does not read as migration 0012 wrote "
                           "it (no `v_xid <= X0` guard): this database's functions were "
                           "changed by hand")
    return int(found.group(1))


def upgrade() -> None:
    bind = op.get_bind()
    op.add_column("turnlog_clock", sa.Column("xid_floor", sa.BigInteger, nullable=False,
                                             server_default="0"))
    if bind.dialect.name != "postgresql":
        op.create_table(CHECKED_TABLE, *checked_columns())  # unused: the schema is one
        return
    op.execute("CREATE UNLOGGED TABLE turnlog_clock_checked (id integer PRIMARY KEY "
               "CONSTRAINT ck_turnlog_clock_checked_one_row CHECK (id = 1), "
               "started timestamptz NOT NULL)")
    definition = bind.exec_driver_sql(
        "SELECT pg_get_functiondef('turnlog_event_position()'::regprocedure)").scalar_one()
    op.execute(sa.text("UPDATE turnlog_clock SET xid_floor = :floor WHERE id = 1")
               .bindparams(floor=floor_of(definition)))
    op.execute(RECLOCK_FN)
    op.execute(RECLOCK_AFTER_START_FN)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        previous = importlib.import_module(
            "app.store.migrations.versions.0012_position_in_feed_order")
        op.execute("DROP FUNCTION turnlog_reclock_after_start()")
        op.execute(previous.RECLOCK_FN)
    op.drop_table(CHECKED_TABLE)
    op.drop_column("turnlog_clock", "xid_floor")
