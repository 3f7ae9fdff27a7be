"""Citus: every shared table a reference table, as migration 0006 meant.

`metric_points` references `metric_submissions` by a foreign key, so when 0006
made `metric_submissions` a reference table Citus turned `metric_points` into
a Citus *local* table (held by the coordinator alone), and 0006, finding it
already in Citus's metadata, left it so. `app/store/engine/citus.py` now tells
the two apart; this revision makes such a table a reference table on
databases migrated before. Elsewhere (SQLite, PostgreSQL without Citus, a
Citus database migrated since) it does nothing.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

from collections.abc import Sequence

from alembic import op
from app.store.engine import citus
from app.store.engine.dialect import has_citus

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    if has_citus(bind):
        citus.distribute(op.execute, bind, tables=())


def downgrade() -> None:
    """Nothing to undo: a reference table serves every query a local one did."""
