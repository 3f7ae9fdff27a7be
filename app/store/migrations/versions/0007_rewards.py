"""Rewards recorded after the close: the columns their projections and consumers need.

The `reward_recorded` events live in the existing `events` log (immutable,
keyed by session like every event); what changes is derived from them:
- `samples.reward_source`: the source of the reward a sample shows
  (`samples.reward` already holds the reward itself);
- `sessions.num_rewards`: how many rewards the session has (a cached fold is
  checked against it), and `sessions.rewarded`: whether every sample has a
  non-null reward (NULL while open), which `require_reward` groups wait for;
- `consumer_groups.require_reward` (default false).
No new table, so nothing to distribute on Citus: adding a column to a
distributed table reaches every shard. Closed sessions are marked `rewarded`
from their samples as they stand (the close's rewards).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MARK_REWARDED = """
UPDATE sessions SET rewarded = NOT EXISTS (
  SELECT 1 FROM samples
  WHERE samples.session_id = sessions.session_id AND samples.reward IS NULL)
WHERE status = 'closed'
"""


def upgrade() -> None:
    op.add_column("sessions", sa.Column("num_rewards", sa.Integer, nullable=False,
                                        server_default=sa.text("0")))
    op.add_column("sessions", sa.Column("rewarded", sa.Boolean, nullable=True))
    op.add_column("samples", sa.Column("reward_source", sa.Text, nullable=True))
    op.add_column("consumer_groups", sa.Column("require_reward", sa.Boolean, nullable=False,
                                               server_default=sa.false()))
    op.execute(MARK_REWARDED)


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite >= 3.35): batch mode would copy `sessions` and
    # `samples`, which the analytics views name.
    op.execute("ALTER TABLE consumer_groups DROP COLUMN require_reward")
    op.execute("ALTER TABLE samples DROP COLUMN reward_source")
    op.execute("ALTER TABLE sessions DROP COLUMN rewarded")
    op.execute("ALTER TABLE sessions DROP COLUMN num_rewards")
