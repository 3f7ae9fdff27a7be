"""Event log, R3 patches and the session/node/sample projections.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
IMMUTABLE = ("events", "r3_patches")

PG_IMMUTABLE_FN = """
CREATE OR REPLACE FUNCTION turnlog_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'turnlog: % rows are immutable', TG_TABLE_NAME
    USING ERRCODE = 'restrict_violation';
END
$$
"""


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("version", sa.String(2), nullable=False),
        sa.Column("pause_generation_mode", sa.String(16), nullable=False),
        sa.Column("num_layers", sa.Integer, nullable=True),
        sa.Column("spec", sa.Boolean, nullable=False),
        sa.Column("max_trim_tokens", sa.Integer, nullable=False),
        sa.Column("labels", sa.Text, nullable=False),
        sa.Column("open_fingerprint", sa.String(64), nullable=False),
        sa.Column("created_us", sa.BigInteger, nullable=False),
        sa.Column("xid", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("status", sa.String(8), nullable=False),
        sa.Column("num_nodes", sa.Integer, nullable=False),
        sa.Column("active_leaf", sa.Integer, nullable=True),
        sa.Column("topk", sa.Integer, nullable=True),
        sa.Column("closed_us", sa.BigInteger, nullable=True),
        sa.Column("close_fingerprint", sa.String(64), nullable=True),
        sa.Column("spec_correct", sa.BigInteger, nullable=False),
        sa.Column("spec_proposed", sa.BigInteger, nullable=False),
        sa.Column("spec_verify", sa.BigInteger, nullable=False),
        sa.Column("spec_completion", sa.BigInteger, nullable=False),
        sa.Column("empty_reason", sa.String(32), nullable=True),
        sa.Column("sample_errors", sa.Text, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
        sa.UniqueConstraint("session_id", name="uq_sessions_session_id"),
    )
    op.create_index("ix_sessions_xid_id", "sessions", ["xid", "id"])
    op.create_table(
        "session_labels",
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("value_text", sa.Text, nullable=False),
        sa.PrimaryKeyConstraint("session_id", "key", name="pk_session_labels"),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.session_id"],
                                name="fk_session_labels_session_id_sessions"),
    )
    op.create_index("ix_session_labels_key_value", "session_labels", ["key", "value_text"])
    op.create_table(
        "events",
        sa.Column("position", BigId, primary_key=True, autoincrement=True),
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.Integer, nullable=True),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("event_id", sa.String(128), nullable=True),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("prompt_lcp", sa.Integer, nullable=True),
        sa.Column("prompt_delta", sa.LargeBinary, nullable=True),
        sa.Column("xid", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.Column("recorded_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("position", name="pk_events"),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.session_id"],
                                name="fk_events_session_id_sessions"),
        sa.UniqueConstraint("session_id", "seq", name="uq_events_session_id_seq"),
        sa.UniqueConstraint("session_id", "event_id", name="uq_events_session_id_event_id"),
    )
    op.create_index("ix_events_xid_position", "events", ["xid", "position"])
    op.create_index("ix_events_session_id_position", "events", ["session_id", "position"])
    op.create_table(
        "r3_patches",
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("start_row", sa.Integer, nullable=False),
        sa.Column("end_row", sa.Integer, nullable=False),
        sa.Column("num_layers", sa.Integer, nullable=False),
        sa.Column("topk", sa.Integer, nullable=False),
        sa.Column("dtype", sa.String(2), nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.PrimaryKeyConstraint("session_id", "seq", name="pk_r3_patches"),
        sa.ForeignKeyConstraint(["session_id", "seq"], ["events.session_id", "events.seq"],
                                name="fk_r3_patches_session_id_seq_events"),
    )
    op.create_table(
        "nodes",
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("parent", sa.Integer, nullable=True),
        sa.Column("depth", sa.Integer, nullable=False),
        sa.Column("num_tokens", sa.Integer, nullable=False),
        sa.Column("prompt_len", sa.Integer, nullable=False),
        sa.Column("prompt_lcp", sa.Integer, nullable=False),
        sa.Column("output_len", sa.Integer, nullable=False),
        sa.Column("r3_start", sa.Integer, nullable=True),
        sa.Column("r3_end", sa.Integer, nullable=True),
        sa.Column("finish_reason", sa.Text, nullable=True),
        sa.Column("weight_version", sa.Text, nullable=True),
        sa.Column("spec_correct", sa.BigInteger, nullable=False),
        sa.Column("spec_proposed", sa.BigInteger, nullable=False),
        sa.Column("spec_verify", sa.BigInteger, nullable=False),
        sa.Column("spec_completion", sa.BigInteger, nullable=False),
        sa.Column("cached_tokens", sa.BigInteger, nullable=True),
        sa.Column("record_ts", sa.Float, nullable=True),
        sa.Column("record_hour", sa.String(20), nullable=True),
        sa.Column("record_day", sa.String(10), nullable=True),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("recorded_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("session_id", "seq", name="pk_nodes"),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.session_id"],
                                name="fk_nodes_session_id_sessions"),
    )
    op.create_table(
        "samples",
        sa.Column("session_id", sa.String(128), nullable=False),
        sa.Column("sample_index", sa.Integer, nullable=False),
        sa.Column("leaf", sa.Integer, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("num_tokens", sa.Integer, nullable=False),
        sa.Column("response_length", sa.Integer, nullable=False),
        sa.Column("weight_versions", sa.Text, nullable=False),
        sa.Column("spec_correct", sa.BigInteger, nullable=False),
        sa.Column("spec_proposed", sa.BigInteger, nullable=False),
        sa.Column("spec_verify", sa.BigInteger, nullable=False),
        sa.Column("spec_completion", sa.BigInteger, nullable=False),
        sa.Column("reward", sa.Text, nullable=True),
        sa.Column("sample_metadata", sa.Text, nullable=False),
        sa.Column("r3", sa.Text, nullable=True),
        sa.PrimaryKeyConstraint("session_id", "sample_index", name="pk_samples"),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.session_id"],
                                name="fk_samples_session_id_sessions"),
    )

    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        # Feed fence: every event row carries its writing transaction id.
        for table in ("events", "sessions"):
            op.execute(f"ALTER TABLE {table} ALTER COLUMN xid "
                       "SET DEFAULT (pg_current_xact_id()::text::bigint)")
        # R3 bytes do not compress; skip pglz's attempt on every insert.
        op.execute("ALTER TABLE r3_patches ALTER COLUMN data SET STORAGE EXTERNAL")
        op.execute(PG_IMMUTABLE_FN)
        for table in IMMUTABLE:
            op.execute(f"CREATE TRIGGER {table}_immutable BEFORE UPDATE OR DELETE ON {table} "
                       "FOR EACH ROW EXECUTE FUNCTION turnlog_immutable()")
            op.execute(f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
                       "FOR EACH STATEMENT EXECUTE FUNCTION turnlog_immutable()")
    else:
        for table in IMMUTABLE:
            for action in ("UPDATE", "DELETE"):
                op.execute(
                    f"CREATE TRIGGER {table}_immutable_{action.lower()} BEFORE {action} "
                    f"ON {table} BEGIN SELECT RAISE(ABORT, 'turnlog: {table} rows are "
                    "immutable'); END"
                )


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    for table in ("samples", "nodes", "r3_patches", "events", "session_labels", "sessions"):
        op.drop_table(table)
    if dialect == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS turnlog_immutable()")
