"""Table definitions (SQLAlchemy Core) shared by queries and migration checks.

The schema is created only by alembic (`app/store/migrations/versions/`); these objects
describe it for query building and for the drift check in the migration
tests. Every table is keyed by `session_id` first so that it can be
distributed by session. Event and patch rows are immutable (database
triggers); the other tables are projections, recomputable from events.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import sqlalchemy as sa

from app.domain.body.specinfo import SPEC_INFO_COLUMNS
from app.domain.ci.metric_history import RunCoordinate
from app.domain.wire.r3 import Patch

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def run_coordinate_columns() -> list[sa.Column[str]]:
    """The fields of a `RunCoordinate`: runs share baselines only if all are equal."""
    return [sa.Column(f.name, sa.Text, nullable=False) for f in dataclasses.fields(RunCoordinate)]


def spec_info_columns() -> list[sa.Column[int]]:
    """The four SpecInfo counters (`SPEC_INFO_COLUMNS`) of a node, sample or carrier."""
    return [sa.Column(column, sa.BigInteger, nullable=False)
            for column in SPEC_INFO_COLUMNS.values()]


sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("session_id", sa.String(128), nullable=False, unique=True),
    sa.Column("version", sa.String(2), nullable=False),
    sa.Column("pause_generation_mode", sa.String(16), nullable=False),
    sa.Column("num_layers", sa.Integer, nullable=True),
    sa.Column("spec", sa.Boolean, nullable=False),
    sa.Column("max_trim_tokens", sa.Integer, nullable=False),
    sa.Column("labels", sa.Text, nullable=False),
    sa.Column("open_fingerprint", sa.String(64), nullable=False),
    sa.Column("created_us", sa.BigInteger, nullable=False),
    # the opening transaction's id: the session list pages behind the same fence as the feed
    sa.Column("xid", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    # session head projection
    sa.Column("status", sa.String(8), nullable=False),
    sa.Column("num_nodes", sa.Integer, nullable=False),
    sa.Column("active_leaf", sa.Integer, nullable=True),
    sa.Column("topk", sa.Integer, nullable=True),
    sa.Column("closed_us", sa.BigInteger, nullable=True),
    sa.Column("close_fingerprint", sa.String(64), nullable=True),
    # session metrics carrier: SpecInfo over every node (guarded sums)
    *spec_info_columns(),
    # samples projection, session level
    sa.Column("empty_reason", sa.String(32), nullable=True),
    sa.Column("sample_errors", sa.Text, nullable=True),
    # rewards recorded after the close: their count (a cached fold is checked against
    # it) and whether every sample has a non-null reward (NULL while open)
    sa.Column("num_rewards", sa.Integer, nullable=False, server_default=sa.text("0")),
    sa.Column("rewarded", sa.Boolean, nullable=True),
    # R3 retention: bytes freed (NULL while the session's R3 is stored). Written with
    # the `r3_pruned` event; like `id` and `xid` it is not rewritten by rebuild.
    sa.Column("r3_pruned_bytes", sa.BigInteger, nullable=True),
    sa.Index("ix_sessions_xid_id", "xid", "id"),
)

session_labels = sa.Table(
    "session_labels",
    metadata,
    sa.Column("session_id", sa.String(128), sa.ForeignKey("sessions.session_id"),
              primary_key=True),
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value_text", sa.Text, nullable=False),
    sa.Index("ix_session_labels_key_value", "key", "value_text"),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("position", BigId, primary_key=True, autoincrement=True),
    sa.Column("session_id", sa.String(128), sa.ForeignKey("sessions.session_id"),
              nullable=False),
    sa.Column("seq", sa.Integer, nullable=True),
    sa.Column("type", sa.String(32), nullable=False),
    sa.Column("event_id", sa.String(128), nullable=True),
    sa.Column("payload", sa.Text, nullable=False),
    sa.Column("prompt_lcp", sa.Integer, nullable=True),
    sa.Column("prompt_delta", sa.LargeBinary, nullable=True),
    sa.Column("xid", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    sa.Column("recorded_us", sa.BigInteger, nullable=False),
    sa.UniqueConstraint("session_id", "seq"),
    sa.UniqueConstraint("session_id", "event_id"),
    sa.Index("ix_events_xid_position", "xid", "position"),
    sa.Index("ix_events_session_id_position", "session_id", "position"),
)

r3_patches = sa.Table(
    "r3_patches",
    metadata,
    sa.Column("session_id", sa.String(128), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("start_row", sa.Integer, nullable=False),
    sa.Column("end_row", sa.Integer, nullable=False),
    sa.Column("num_layers", sa.Integer, nullable=False),
    sa.Column("topk", sa.Integer, nullable=False),
    sa.Column("dtype", sa.String(2), nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.ForeignKeyConstraint(["session_id", "seq"], ["events.session_id", "events.seq"]),
)


def patch_row(session_id: str, seq: int, patch: Patch) -> dict[str, Any]:
    """The `r3_patches` row of one turn's patch."""
    return {"session_id": session_id, "seq": seq, "start_row": patch.start,
            "end_row": patch.end, "num_layers": patch.num_layers, "topk": patch.topk,
            "dtype": patch.dtype, "data": patch.data}


def patch_from_row(row: Any) -> Patch:
    """Inverse of `patch_row`."""
    return Patch(start=row.start_row, end=row.end_row, num_layers=row.num_layers,
                 topk=row.topk, dtype=row.dtype, data=row.data)


nodes = sa.Table(
    "nodes",
    metadata,
    sa.Column("session_id", sa.String(128), sa.ForeignKey("sessions.session_id"),
              primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
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
    *spec_info_columns(),
    sa.Column("cached_tokens", sa.BigInteger, nullable=True),
    sa.Column("record_ts", sa.Float, nullable=True),
    sa.Column("record_hour", sa.String(20), nullable=True),
    sa.Column("record_day", sa.String(10), nullable=True),
    sa.Column("position", sa.BigInteger, nullable=False),
    sa.Column("recorded_us", sa.BigInteger, nullable=False),
)

samples = sa.Table(
    "samples",
    metadata,
    sa.Column("session_id", sa.String(128), sa.ForeignKey("sessions.session_id"),
              primary_key=True),
    sa.Column("sample_index", sa.Integer, primary_key=True),
    sa.Column("leaf", sa.Integer, nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("num_tokens", sa.Integer, nullable=False),
    sa.Column("response_length", sa.Integer, nullable=False),
    sa.Column("weight_versions", sa.Text, nullable=False),
    *spec_info_columns(),
    sa.Column("reward", sa.Text, nullable=True),
    sa.Column("reward_source", sa.Text, nullable=True),
    sa.Column("sample_metadata", sa.Text, nullable=False),
    sa.Column("r3", sa.Text, nullable=True),
)

PROJECTIONS = ("sessions", "nodes", "samples")

# Consumer groups (not projections: acknowledgements are facts of their own,
# never recomputed from events). `consumer_groups` is small (a reference table
# when distributed); `consumer_sessions` is keyed by `session_id` first and
# holds one row per (session, group) once a group consumes the session: its
# holder claim and lease, and whether it was acknowledged; `consumer_acks`
# is insert-only, in ack order, fenced like the feed by the writer's xid.
consumer_groups = sa.Table(
    "consumer_groups",
    metadata,
    sa.Column("group_name", sa.String(64), primary_key=True),
    sa.Column("labels", sa.Text, nullable=False),
    sa.Column("start", sa.String(16), nullable=False),
    # offer a session only once every one of its samples has a reward
    sa.Column("require_reward", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("created_us", sa.BigInteger, nullable=False),
)

consumer_claims = sa.Table(
    "consumer_claims",
    metadata,
    sa.Column("group_name", sa.String(64), primary_key=True),
    sa.Column("claim_id", sa.String(128), primary_key=True),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("expires_us", sa.BigInteger, nullable=False),
    sa.Column("sessions", sa.Text, nullable=False),
    sa.Column("created_us", sa.BigInteger, nullable=False),
)

consumer_sessions = sa.Table(
    "consumer_sessions",
    metadata,
    sa.Column("session_id", sa.String(128), primary_key=True),
    sa.Column("group_name", sa.String(64), primary_key=True),
    sa.Column("closed_us", sa.BigInteger, nullable=False),
    sa.Column("claim_id", sa.String(128), nullable=True),
    sa.Column("epoch", sa.BigInteger, nullable=True),
    sa.Column("expires_us", sa.BigInteger, nullable=True),
    sa.Column("acked_us", sa.BigInteger, nullable=True),
    sa.Column("step", sa.BigInteger, nullable=True),
    sa.Index("ix_consumer_sessions_group_name_acked_us_closed_us",
             "group_name", "acked_us", "closed_us", "session_id"),
)

consumer_acks = sa.Table(
    "consumer_acks",
    metadata,
    sa.Column("position", BigId, primary_key=True, autoincrement=True),
    sa.Column("session_id", sa.String(128), nullable=False),
    sa.Column("group_name", sa.String(64), nullable=False),
    sa.Column("claim_id", sa.String(128), nullable=False),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("step", sa.BigInteger, nullable=True),
    sa.Column("acked_us", sa.BigInteger, nullable=False),
    sa.Column("xid", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    sa.Index("ix_consumer_acks_group_name_xid_position", "group_name", "xid", "position"),
    sa.Index("ix_consumer_acks_xid", "xid"),  # the store's clock (migration 0012)
)

# CI metric history: one row per submission (idempotent on its fingerprint
# within a run attempt) and its whitelisted points in submission order. A
# non-finite value keeps `value` NULL and its marker in `non_finite` (SQLite
# cannot store NaN). `run_key` hashes (coordinate, run_id) for a short index.
metric_submissions = sa.Table(
    "metric_submissions",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("run_key", sa.String(64), nullable=False),
    *run_coordinate_columns(),
    sa.Column("run_id", sa.String(256), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("trusted", sa.Boolean, nullable=False),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("recorded_us", sa.BigInteger, nullable=False),
    sa.UniqueConstraint("run_key", "attempt", "fingerprint"),
)

metric_points = sa.Table(
    "metric_points",
    metadata,
    sa.Column("submission_id", sa.BigInteger, sa.ForeignKey("metric_submissions.id"),
              primary_key=True),
    sa.Column("ord", sa.Integer, primary_key=True),
    sa.Column("metric", sa.String(256), nullable=False),
    sa.Column("step", sa.BigInteger, nullable=True),
    sa.Column("value", sa.Double, nullable=True),
    sa.Column("non_finite", sa.String(9), nullable=True),
)

# Gate baselines: the value a run contributed at one gate coordinate
# (`coordinate_key` hashes the whole coordinate), trusted only if the run was
# submitted trusted and passed its gates; "most recent" is `recorded_us`.
gate_baselines = sa.Table(
    "gate_baselines",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("coordinate_key", sa.String(64), nullable=False),
    *run_coordinate_columns(),
    sa.Column("metric", sa.String(256), nullable=False),
    sa.Column("steps_key", sa.Text, nullable=False),
    sa.Column("constraint_key", sa.Text, nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("run_id", sa.String(256), nullable=False),
    sa.Column("value", sa.Double, nullable=False),
    sa.Column("trusted", sa.Boolean, nullable=False),
    sa.Column("recorded_us", sa.BigInteger, nullable=False),
    sa.UniqueConstraint("coordinate_key", "run_id"),
    sa.Index("ix_gate_baselines_coordinate_key_recorded_us", "coordinate_key", "recorded_us"),
)

# The store's transaction clock (migration 0012): the offset added to PostgreSQL's
# transaction ids in every `xid` column and the feed fence, raised past the rows a
# database restored onto another server carries (`turnlog_reclock()`), and past its
# floor (migration 0014: the id migration 0012 ran under, which every writer's must
# pass). One row; unused on SQLite, whose `xid` is 0.
turnlog_clock = sa.Table(
    "turnlog_clock",
    metadata,
    sa.Column("id", sa.Integer, sa.CheckConstraint("id = 1", name="ck_turnlog_clock_one_row"),
              primary_key=True, autoincrement=False),
    sa.Column("xid_offset", sa.BigInteger, nullable=False),
    sa.Column("xid_floor", sa.BigInteger, nullable=False, server_default="0"),
)

# The server start (PostgreSQL's postmaster start time) the clock was last checked under
# (migration 0014): UNLOGGED on PostgreSQL, so crash recovery empties it. A new
# connection runs the full reclock when it is empty or names another start.
turnlog_clock_checked = sa.Table(
    "turnlog_clock_checked",
    metadata,
    sa.Column("id", sa.Integer,
              sa.CheckConstraint("id = 1", name="ck_turnlog_clock_checked_one_row"),
              primary_key=True, autoincrement=False),
    sa.Column("started", sa.DateTime(timezone=True), nullable=False),
)
