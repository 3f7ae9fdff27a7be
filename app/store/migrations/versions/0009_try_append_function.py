"""Group commit: `turnlog_try_append(...)`, the one-round-trip append that never raises.

Group commit (`app/store/append/group.py`) runs the fast-path calls of
several sessions in one transaction on one connection. One failing call
would abort that transaction and, with it, every other member of the group;
so the group calls this wrapper instead of `turnlog_append` (migration 0008):
the same arguments, the same answer, but any error raised by the call is
caught in its own subtransaction (a PL/pgSQL `EXCEPTION` block), which rolls
back what that one call wrote and answers NULL — the same "write nothing,
take the general path" answer as a stale turn count. `OTHERS` does not catch
`query_canceled` (a statement timeout or a cancel): that one still aborts
the whole group, whose callers then get the error.

The single append keeps calling `turnlog_append` directly: it pays no
subtransaction. PostgreSQL only (not used on Citus, where group commit is
off, nor on SQLite).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The argument types of `turnlog_append`, as migration 0008 declares them.
SIGNATURE = (
    "text, integer, "                                                  # session, expected nodes
    "integer, text, text, integer, bytea, bigint, "                    # event
    "integer, integer, integer, integer, text, bytea, "                # R3 patch
    "integer, integer, integer, integer, integer, integer, integer, integer, text, text, "
    "bigint, bigint, bigint, bigint, bigint, double precision, text, text, "  # node
    "integer, integer, bigint, bigint, bigint, bigint"                 # head
)
ARGUMENTS = 38

PG_TRY_APPEND_FN = f"""
CREATE OR REPLACE FUNCTION turnlog_try_append({SIGNATURE})
RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN
  RETURN turnlog_append({", ".join(f"${i}" for i in range(1, ARGUMENTS + 1))});
EXCEPTION WHEN OTHERS THEN
  RETURN NULL;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_TRY_APPEND_FN)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS turnlog_try_append({SIGNATURE})")
