"""Citus: distribute the session tables by session_id, reference the shared ones.

Only on a database with the Citus extension (`CREATE EXTENSION citus` before
migrating, on a coordinator with its workers registered); everywhere else
this revision does nothing. See `app/store/engine/citus.py` for what changes and
why (primary keys of `sessions` and `events` gain `session_id`; the
immutability triggers land on every shard). A migration added after this
one that creates a session table on Citus calls `citus.distribute` with it.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from collections.abc import Sequence

from alembic import op
from app.store.engine import citus
from app.store.engine.dialect import has_citus

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    if has_citus(bind):
        citus.distribute(op.execute, bind)


def downgrade() -> None:
    bind = op.get_bind()
    if has_citus(bind):
        citus.undistribute(op.execute, bind)
