"""An event's `position` follows the feed's order (PostgreSQL and Citus).

The feed pages events by (`xid`, `position`) behind the transaction-id fence
(`app/store/engine/dialect.py`): that order never skips an event, but with
positions from a sequence, taken when each row is inserted, it was not the
order of the positions themselves. A transaction that took its id first and
inserted later got a larger position than a later transaction's that
committed first, and the feed showed them falling (a helper measured ~6 %
of adjacent pairs under eight concurrent writers). A position is the event's
place in that order, so it is now made from it: the writing transaction's
id, then the event's rank within the transaction,

    position = P0 + (xid - X0) * 65536 + rank

(`P0` one past the largest position the sequence handed out before this migration, `X0` the
migration's own transaction id, below every later writer's). Positions then
increase along the feed, and within a session (its writers hold its row
lock, so a later one's transaction id is larger, or its turn fails the
count check and is written again later). They are no longer consecutive:
each transaction id is 65536 positions wide, which keeps them below 2^53
(exact as JSON numbers everywhere) for ~1.4 × 10^11 transactions. A
transaction writes at most 65536 events (turnlog's write at most a group
commit's 32); one more is an error, never a shared position.

The rank is counted in a transaction-local setting (`turnlog.events_written`,
reset at every commit or rollback, and with a savepoint rolled back together
with its rows). The default is evaluated where the row's `xid` default is:
on Citus the coordinator, whose transaction ids the fence compares
(`turnlog_append` is not a distributed function for the same reason).
Events written before keep their positions, all below `P0`; the feed's
order is unchanged. SQLite has one writer: its positions (rowids) already
are commit order.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

from collections.abc import Sequence

from alembic import op
from app.store.engine.dialect import has_citus

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RANK_WIDTH = 65536

POSITION_FN = """
CREATE OR REPLACE FUNCTION turnlog_event_position() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
  v_xid bigint := pg_current_xact_id()::text::bigint;
  v_rank bigint := coalesce(nullif(current_setting('turnlog.events_written', true), ''),
                            '0')::bigint;
BEGIN
  IF v_rank >= {width} THEN
    RAISE EXCEPTION 'a transaction writes at most {width} events';
  END IF;
  PERFORM set_config('turnlog.events_written', (v_rank + 1)::text, true);
  RETURN {p0} + (v_xid - {x0}) * {width} + v_rank;
END
$$
"""


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    # Past every position the sequence handed out (all of them came from it). Read
    # from the sequence, not max(position): on Citus a query over every shard before
    # CREATE FUNCTION (propagated to the workers) fails the transaction.
    p0 = bind.exec_driver_sql(
        "SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END "
        "FROM events_position_seq").scalar()
    x0 = bind.exec_driver_sql("SELECT pg_current_xact_id()::text::bigint").scalar()
    op.execute(POSITION_FN.format(width=RANK_WIDTH, p0=int(p0 or 1), x0=int(x0 or 0)))
    op.execute("ALTER TABLE events ALTER COLUMN position SET DEFAULT turnlog_event_position()")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    if has_citus(bind):
        # The ALTER below runs on every shard; DROP FUNCTION (propagated to the
        # workers) then needs one connection per node for the whole transaction.
        op.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
    # Back to the sequence, past every position written meanwhile.
    op.execute("SELECT setval('events_position_seq', "
               "(SELECT coalesce(max(position), 0) + 1 FROM events), false)")
    op.execute("ALTER TABLE events ALTER COLUMN position "
               "SET DEFAULT nextval('events_position_seq')")
    # On Citus the shards of `events` keep the function as their own default (Citus
    # does not propagate a sequence default to them; inserts routed from the
    # coordinator never use it): those defaults go with the function.
    op.execute("DROP FUNCTION turnlog_event_position()"
               + (" CASCADE" if has_citus(bind) else ""))
