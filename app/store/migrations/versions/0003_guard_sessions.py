"""Sessions cannot be deleted: the log's anchor rows are as permanent as the log.

On SQLite foreign keys are enforced per connection (`PRAGMA foreign_keys`),
so another program's connection could `DELETE FROM sessions` and orphan the
events. A trigger refuses it on both dialects (and TRUNCATE on PostgreSQL);
updates stay allowed (the projection columns are rebuilt in place).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # turnlog_immutable() comes from 0001: it raises "turnlog: <table> rows are immutable".
        op.execute("CREATE TRIGGER sessions_no_delete BEFORE DELETE ON sessions "
                   "FOR EACH ROW EXECUTE FUNCTION turnlog_immutable()")
        op.execute("CREATE TRIGGER sessions_no_truncate BEFORE TRUNCATE ON sessions "
                   "FOR EACH STATEMENT EXECUTE FUNCTION turnlog_immutable()")
    else:
        op.execute("CREATE TRIGGER sessions_no_delete BEFORE DELETE ON sessions "
                   "BEGIN SELECT RAISE(ABORT, 'turnlog: sessions rows are immutable "
                   "(deletes refused)'); END")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS sessions_no_truncate ON sessions")
        op.execute("DROP TRIGGER IF EXISTS sessions_no_delete ON sessions")
    else:
        op.execute("DROP TRIGGER IF EXISTS sessions_no_delete")
