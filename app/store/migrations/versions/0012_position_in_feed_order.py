"""An event's `position` follows the feed's order; the store's own transaction clock
(PostgreSQL and Citus).

The feed pages events by (`xid`, `position`) behind the transaction-id fence
(`app/store/engine/dialect.py`): that order never skips an event, but with
positions from a sequence, taken when each row is inserted, it was not the
order of the positions themselves. A transaction that took its id first and
inserted later got a larger position than a later transaction's that
committed first, and the feed showed them falling (a helper measured ~6 %
of adjacent pairs under eight concurrent writers). A position is the event's
place in that order, so it is now made from it: the writing transaction's
id, then the event's rank within the transaction,

    position = P0 + (xid - X0) * 1024 + rank

(`P0` one past the largest position the sequence handed out before this
migration, `X0` the migration's own transaction id, below every later
writer's). Positions then increase along the feed, and within a session (its
writers hold its row lock, so a later one's transaction id is larger, or its
turn fails the count check and is written again later). They are no longer
consecutive: each transaction id is 1024 positions wide, which keeps them
below 2^53 (exact as JSON numbers everywhere) for ~8.8 × 10^12 transactions.
A transaction writes at most 1024 events (turnlog's write at most a group
commit's 32); one more is an error, never a shared position. The rank is
counted in a transaction-local setting (`turnlog.events_written`, reset at
every commit or rollback, and with a savepoint rolled back together with its
rows).

**Writers queue for a session before its row lock.** PostgreSQL gives a
transaction its id once it is woken from a row lock; under READ COMMITTED it
may then find the updated row locked by a newcomer and wait again, holding an
id older than the newcomer's, whose turn commits first. Ordered by id, the
session's turns would fall out of seq order (two writers on one session did
it about once in 30 runs of 20 turns). So every writer of a session first
takes a transaction-level advisory lock on it (`pg_advisory_xact_lock(29804,
hashtext(session_id))`: in `turnlog_append`, re-created here, and before the
general path's row lock), which takes no transaction id: writers reach the
row lock one at a time, and a writer's id follows the session's commit order.

**The store's transaction clock.** PostgreSQL's transaction ids belong to the
server, not to the data: a database restored from `pg_dump` onto another
server (or moved by logical replication) keeps rows stamped with the old
server's ids while the new one counts from its own, possibly far lower. The
feed fence then hid every restored row, new rows sorted before them, and
positions made from the new ids would fall below the old ones. So every
`xid` (events, sessions, consumer acks) and the fence's horizon are now the
server's id plus an offset kept in the database (`turnlog_clock`), and
`turnlog_reclock()` raises the offset past every stamped row whenever the
server's ids are behind them (judged in one statement, so that normal
operation never moves it; a move waits for every writer in flight, each of
which holds the clock's table from its first stamp to its end). The reclock
runs with every migration run (`turnlog migrate`, and `serve` / `gateway` at
start): after a restore, migrate before serving. A transaction whose id is
behind this migration's cannot write an event: its position would fall below
those written, so it fails (retried like any failed write). Downgrading past
this revision is refused once the clock was moved. (A group commit's members
after its first already hold the group's id when they queue: their order is
kept, as before, by the turn-count and status checks under the row lock.)

The defaults are evaluated where the row's `xid` default always was: on Citus
the coordinator, which holds `turnlog_clock` (a plain table of its own) and
whose transaction ids the fence compares (`turnlog_append` is not a
distributed function for the same reason). Events written before keep their
positions, all below `P0`; the feed's order is unchanged. SQLite has one
writer: its positions (rowids) already are commit order, and `xid` is 0 (the
clock's table is created there too, unused, so the schema is one).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

import importlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from app.store.engine.dialect import has_citus

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RANK_WIDTH = 1024
XID_TABLES = ("events", "sessions", "consumer_acks")

XID_FN = """
CREATE OR REPLACE FUNCTION turnlog_xid() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  RETURN pg_current_xact_id()::text::bigint
         + (SELECT xid_offset FROM turnlog_clock WHERE id = 1);
END
$$
"""

# Raises the offset past every stamped row when the server's ids are behind them
# (a restore onto another server); returns the offset. Detected in one statement, one
# snapshot: every row it sees was stamped by a transaction whose server id is below
# the snapshot's xmax, with an offset no larger than today's — so in normal operation
# nothing moves (an id read before the rows' max, in another statement, could be
# passed by a writer committing between the two, and moved the clock for nothing).
# A move takes the clock's table exclusively first: every writer holds it (read by
# `turnlog_xid()`) from its first stamp to its end, so none is in flight with the old
# offset while readers' horizons take the new one (the feed would skip its rows).
# Two reclocks never run at once: they run under the migrations' own lock.
RECLOCK_FN = """
CREATE OR REPLACE FUNCTION turnlog_reclock() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  v_offset bigint;
  v_next bigint;
  v_seen bigint;
BEGIN
  SELECT (SELECT xid_offset FROM turnlog_clock WHERE id = 1),
         pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
         greatest((SELECT max(xid) FROM events), (SELECT max(xid) FROM sessions),
                  (SELECT max(xid) FROM consumer_acks))
    INTO v_offset, v_next, v_seen;
  IF v_seen IS NULL OR v_seen < v_next + v_offset THEN
    RETURN v_offset;
  END IF;
  PERFORM set_config('lock_timeout', '30s', true);
  LOCK TABLE turnlog_clock IN ACCESS EXCLUSIVE MODE;
  SELECT (SELECT xid_offset FROM turnlog_clock WHERE id = 1),
         pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
         greatest((SELECT max(xid) FROM events), (SELECT max(xid) FROM sessions),
                  (SELECT max(xid) FROM consumer_acks))
    INTO v_offset, v_next, v_seen;
  IF v_seen >= v_next + v_offset THEN
    v_offset := v_seen - v_next + 1;
    UPDATE turnlog_clock SET xid_offset = v_offset WHERE id = 1;
  END IF;
  RETURN v_offset;
END
$$
"""

POSITION_FN = """
CREATE OR REPLACE FUNCTION turnlog_event_position() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  v_xid bigint := turnlog_xid();
  v_rank bigint := coalesce(nullif(current_setting('turnlog.events_written', true), ''),
                            '0')::bigint;
BEGIN
  IF v_xid <= {x0} THEN
    RAISE EXCEPTION 'transaction id % is behind the store''s clock: retry the write', v_xid
      USING ERRCODE = 'serialization_failure';
  END IF;
  IF v_rank >= {width} THEN
    RAISE EXCEPTION 'a transaction writes at most {width} events';
  END IF;
  PERFORM set_config('turnlog.events_written', (v_rank + 1)::text, true);
  RETURN {p0} + (v_xid - {x0}) * {width} + v_rank;
END
$$
"""


# The append function (0008) queues for the session before it locks its row, as the
# general path does (`app/store/engine/dialect.py` SESSION_WRITERS: why).
_APPEND = importlib.import_module("app.store.migrations.versions.0008_append_function")
LOCK_ROW = "  SELECT num_nodes, status INTO v_num_nodes, v_status FROM sessions"
QUEUED_APPEND_FN = _APPEND.PG_APPEND_FN.replace(
    LOCK_ROW, "  PERFORM pg_advisory_xact_lock(29804, hashtext(p_session_id));\n" + LOCK_ROW, 1)
assert QUEUED_APPEND_FN != _APPEND.PG_APPEND_FN


def upgrade() -> None:
    bind = op.get_bind()
    op.create_table(
        "turnlog_clock",
        sa.Column("id", sa.Integer, sa.CheckConstraint("id = 1", name="ck_turnlog_clock_one_row"),
                  primary_key=True, autoincrement=False),
        sa.Column("xid_offset", sa.BigInteger, nullable=False))
    op.execute("INSERT INTO turnlog_clock (id, xid_offset) VALUES (1, 0)")
    # The reclock reads max(xid) of the acks at every migration run.
    op.create_index("ix_consumer_acks_xid", "consumer_acks", ["xid"])
    if bind.dialect.name != "postgresql":
        return
    # Past every position the sequence handed out (all of them came from it). Read
    # from the sequence, not max(position): on Citus a query over every shard before
    # CREATE FUNCTION (propagated to the workers) fails the transaction.
    p0 = bind.exec_driver_sql(
        "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END "
        "FROM events_position_seq").scalar()
    x0 = bind.exec_driver_sql("SELECT pg_current_xact_id()::text::bigint").scalar()
    op.execute(XID_FN)
    op.execute(RECLOCK_FN)
    op.execute(POSITION_FN.format(width=RANK_WIDTH, p0=int(p0 or 1), x0=int(x0 or 0)))
    op.execute(QUEUED_APPEND_FN)
    for table in XID_TABLES:
        op.execute(f"ALTER TABLE {table} ALTER COLUMN xid SET DEFAULT turnlog_xid()")
    op.execute("ALTER TABLE events ALTER COLUMN position SET DEFAULT turnlog_event_position()")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        op.drop_index("ix_consumer_acks_xid", "consumer_acks")
        op.drop_table("turnlog_clock")
        return
    offset = bind.exec_driver_sql("SELECT xid_offset FROM turnlog_clock WHERE id = 1").scalar()
    if offset:
        # Rows stamped on the moved clock would sort after (and hide behind the fence
        # from) every row the server's own ids stamp from now on.
        raise RuntimeError(
            f"the store's transaction clock was moved ({offset}: a restore onto another "
            "server): its rows are stamped ahead of this server's ids, which revisions "
            "before 0012 use as they are; downgrading would hide them from the feed")
    if has_citus(bind):
        # The ALTERs below run on every shard; DROP FUNCTION (propagated to the
        # workers) then needs one connection per node for the whole transaction.
        op.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
    op.execute(_APPEND.PG_APPEND_FN)
    # Back to the sequence, past every position written meanwhile, and to the
    # server's own transaction ids.
    op.execute("SELECT setval('events_position_seq', "
               "(SELECT coalesce(max(position), 0) + 1 FROM events), false)")
    op.execute("ALTER TABLE events ALTER COLUMN position "
               "SET DEFAULT nextval('events_position_seq')")
    for table in XID_TABLES:
        op.execute(f"ALTER TABLE {table} ALTER COLUMN xid "
                   "SET DEFAULT (pg_current_xact_id()::text::bigint)")
    # On Citus the shards of `events` and `sessions` keep the functions as their own
    # defaults (Citus does not propagate these defaults to them; inserts routed from
    # the coordinator never use them): those defaults go with the functions.
    cascade = " CASCADE" if has_citus(bind) else ""
    for function in ("turnlog_event_position", "turnlog_reclock", "turnlog_xid"):
        op.execute(f"DROP FUNCTION {function}(){cascade}")
    op.execute("DROP TABLE turnlog_clock")
    op.drop_index("ix_consumer_acks_xid", "consumer_acks")
