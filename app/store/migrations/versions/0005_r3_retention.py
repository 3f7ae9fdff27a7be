"""R3 retention: a session's stored R3 can be freed, and nothing else can change.

`sessions.r3_pruned_bytes` records the bytes freed (NULL while stored). The
immutability trigger of `r3_patches` is replaced by one that still refuses
every DELETE and every UPDATE except exactly retention's: `data` set to
empty bytes with every other column unchanged, and only when allowed —
on PostgreSQL by the transaction-local setting `turnlog.r3_prune = 'on'`
(which the retention transaction sets, and Citus propagates to the worker),
on SQLite by the session's row already carrying `r3_pruned_bytes`. The
freed tuples' TOAST chunks are then dead, and VACUUM (autovacuum) makes their
space reusable by new patches.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PG_GUARD_FN = """
CREATE OR REPLACE FUNCTION turnlog_r3_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'UPDATE'
     AND coalesce(current_setting('turnlog.r3_prune', true), '') = 'on'
     AND octet_length(NEW.data) = 0
     AND (NEW.session_id, NEW.seq, NEW.start_row, NEW.end_row, NEW.num_layers, NEW.topk,
          NEW.dtype)
         IS NOT DISTINCT FROM
         (OLD.session_id, OLD.seq, OLD.start_row, OLD.end_row, OLD.num_layers, OLD.topk,
          OLD.dtype)
  THEN
    RETURN NEW;
  END IF;
  RAISE EXCEPTION 'turnlog: r3_patches rows are immutable'
    USING ERRCODE = 'restrict_violation';
END
$$
"""

SQLITE_PRUNE_ONLY = """
CREATE TRIGGER r3_patches_immutable_update BEFORE UPDATE ON r3_patches
WHEN NOT (
  length(NEW.data) = 0
  AND NEW.session_id IS OLD.session_id AND NEW.seq IS OLD.seq
  AND NEW.start_row IS OLD.start_row AND NEW.end_row IS OLD.end_row
  AND NEW.num_layers IS OLD.num_layers AND NEW.topk IS OLD.topk AND NEW.dtype IS OLD.dtype
  AND EXISTS (SELECT 1 FROM sessions s WHERE s.session_id = OLD.session_id
              AND s.r3_pruned_bytes IS NOT NULL))
BEGIN SELECT RAISE(ABORT, 'turnlog: r3_patches rows are immutable'); END
"""

SQLITE_ALWAYS = """
CREATE TRIGGER r3_patches_immutable_update BEFORE UPDATE ON r3_patches
BEGIN SELECT RAISE(ABORT, 'turnlog: r3_patches rows are immutable'); END
"""


def _pg_trigger(function: str) -> None:
    op.execute("DROP TRIGGER r3_patches_immutable ON r3_patches")
    op.execute("CREATE TRIGGER r3_patches_immutable BEFORE UPDATE OR DELETE ON r3_patches "
               f"FOR EACH ROW EXECUTE FUNCTION {function}()")


def upgrade() -> None:
    op.add_column("sessions", sa.Column("r3_pruned_bytes", sa.BigInteger, nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_GUARD_FN)
        _pg_trigger("turnlog_r3_guard")
    else:
        op.execute("DROP TRIGGER r3_patches_immutable_update")
        op.execute(SQLITE_PRUNE_ONLY)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _pg_trigger("turnlog_immutable")
        op.execute("DROP FUNCTION IF EXISTS turnlog_r3_guard()")
    else:
        op.execute("DROP TRIGGER r3_patches_immutable_update")
        op.execute(SQLITE_ALWAYS)
    # A plain DROP COLUMN (SQLite >= 3.35): batch mode would copy `sessions`, which the
    # analytics views name.
    op.execute("ALTER TABLE sessions DROP COLUMN r3_pruned_bytes")
