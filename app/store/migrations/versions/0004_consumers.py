"""Consumer groups: exactly-once hand-off of closed sessions to trainers.

Tables `consumer_groups` (definition and claim epoch counter),
`consumer_claims` (each claim's original reply, for idempotent repeats and
ack checks), `consumer_sessions` (per session and group: holder claim, lease,
acknowledgement; keyed by `session_id` first) and `consumer_acks` (ack order,
fenced by the writing transaction id on PostgreSQL like the feed).

Revision ID: 0004
Revises: 0002
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "consumer_groups",
        sa.Column("group_name", sa.String(64), nullable=False),
        sa.Column("labels", sa.Text, nullable=False),
        sa.Column("start", sa.String(16), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("created_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("group_name", name="pk_consumer_groups"),
    )
    op.create_table(
        "consumer_claims",
        sa.Column("group_name", sa.String(64), nullable=False),
        sa.Column("claim_id", sa.String(128), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("expires_us", sa.BigInteger, nullable=False),
        sa.Column("sessions", sa.Text, nullable=False),
        sa.Column("created_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("group_name", "claim_id", name="pk_consumer_claims"),
    )
    op.create_table(
        "consumer_sessions",
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("group_name", sa.String(64), nullable=False),
        sa.Column("closed_us", sa.BigInteger, nullable=False),
        sa.Column("claim_id", sa.String(128), nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=True),
        sa.Column("expires_us", sa.BigInteger, nullable=True),
        sa.Column("acked_us", sa.BigInteger, nullable=True),
        sa.Column("step", sa.BigInteger, nullable=True),
        sa.PrimaryKeyConstraint("session_id", "group_name", name="pk_consumer_sessions"),
    )
    op.create_index("ix_consumer_sessions_group_name_acked_us_closed_us", "consumer_sessions",
                    ["group_name", "acked_us", "closed_us", "session_id"])
    op.create_table(
        "consumer_acks",
        sa.Column("position", BigId, nullable=False, autoincrement=True),
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("group_name", sa.String(64), nullable=False),
        sa.Column("claim_id", sa.String(128), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=True),
        sa.Column("acked_us", sa.BigInteger, nullable=False),
        sa.Column("xid", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.PrimaryKeyConstraint("position", name="pk_consumer_acks"),
    )
    op.create_index("ix_consumer_acks_group_name_xid_position", "consumer_acks",
                    ["group_name", "xid", "position"])
    if op.get_bind().dialect.name == "postgresql":
        # The ack list pages behind the same visibility fence as the feed.
        op.execute("ALTER TABLE consumer_acks ALTER COLUMN xid "
                   "SET DEFAULT (pg_current_xact_id()::text::bigint)")


def downgrade() -> None:
    for table in ("consumer_acks", "consumer_sessions", "consumer_claims", "consumer_groups"):
        op.drop_table(table)
