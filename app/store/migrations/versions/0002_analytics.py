"""Analytics views (SpecInfo rates, rollout samples) and the CI metric history.

Views: `spec_turns` (one row per turn, the §3 guard applied to the four
counters), `spec_sessions` (the session carrier), `spec_rates_by_<key>` for
weight_version, model, run_id, rollout_id, hour and day (sums first, then
one float64 division per rate), and `rollout_samples` (one row per sample of
a session, with its TITO mismatch flags). Every rate is
`CAST(sum AS DOUBLE PRECISION) / CAST(sum AS DOUBLE PRECISION)` so it equals
Python's `float(a) / float(b)` bit for bit; `DOUBLE PRECISION` has REAL
affinity on SQLite. Only the commit timestamp and the JSON reads of
`rollout_samples` differ per dialect.

Tables: `metric_submissions` / `metric_points` (CI metric series per run
attempt) and `gate_baselines` (the values a run contributes per gate
coordinate, with the trust decision).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

LABELS = ("model", "run_id", "rollout_id")
GROUPS = {
    "weight_version": "weight_version",
    "model": "model",
    "run_id": "run_id",
    "rollout_id": "rollout_id",
    "hour": "record_hour",
    "day": "record_day",
}
MISMATCH_TYPES = ("special_token_count", "special_token_type", "non_assistant_text",
                  "assistant_text")

RECORDED_AT = {
    "postgresql": "to_timestamp(n.recorded_us / 1000000.0)",
    "sqlite": "strftime('%Y-%m-%dT%H:%M:%fZ', n.recorded_us / 1000000.0, 'unixepoch')",
}


def _ratio(numerator: str, denominator: str) -> str:
    return (f"CASE WHEN {denominator} = 0 THEN 0.0 ELSE "
            f"CAST({numerator} AS DOUBLE PRECISION) / CAST({denominator} AS DOUBLE PRECISION) "
            "END")


def _label_joins(alias: str) -> str:
    return "\n".join(
        f"LEFT JOIN session_labels l_{key} ON l_{key}.session_id = {alias}.session_id "
        f"AND l_{key}.key = '{key}'"
        for key in LABELS
    )


def _label_columns() -> str:
    return ", ".join(f"l_{key}.value_text AS {key}" for key in LABELS)


def _guarded(column: str, name: str) -> str:
    return f"CASE WHEN n.spec_verify > 0 THEN n.{column} ELSE 0 END AS {name}"


def spec_turns(dialect: str) -> str:
    return f"""
CREATE VIEW spec_turns AS
SELECT n.session_id, n.seq, n.position, {RECORDED_AT[dialect]} AS recorded_at,
       n.record_ts, n.record_hour, n.record_day, n.weight_version, {_label_columns()},
       CASE WHEN n.spec_verify > 0 THEN 1 ELSE 0 END AS contributes,
       {_guarded("spec_correct", "spec_num_correct_drafts")},
       {_guarded("spec_proposed", "spec_num_proposed_drafts")},
       {_guarded("spec_verify", "spec_verify_ct")},
       {_guarded("spec_completion", "completion_tokens")}
FROM nodes n
{_label_joins("n")}
"""


SPEC_SESSIONS = f"""
CREATE VIEW spec_sessions AS
SELECT s.session_id, s.version, s.status, s.spec, s.num_nodes, {_label_columns()},
       s.spec_correct AS spec_num_correct_drafts, s.spec_proposed AS spec_num_proposed_drafts,
       s.spec_verify AS spec_verify_ct, s.spec_completion AS completion_tokens,
       {_ratio("s.spec_correct", "s.spec_proposed")} AS accept_rate,
       {_ratio("s.spec_completion", "s.spec_verify")} AS accept_length
FROM sessions s
{_label_joins("s")}
"""


def spec_rates(name: str, column: str) -> str:
    return f"""
CREATE VIEW spec_rates_by_{name} AS
SELECT {column} AS key, COUNT(DISTINCT session_id) AS sessions, COUNT(*) AS turns,
       SUM(spec_num_correct_drafts) AS spec_num_correct_drafts,
       SUM(spec_num_proposed_drafts) AS spec_num_proposed_drafts,
       SUM(spec_verify_ct) AS spec_verify_ct,
       SUM(completion_tokens) AS completion_tokens,
       {_ratio("SUM(spec_num_correct_drafts)", "SUM(spec_num_proposed_drafts)")} AS accept_rate,
       {_ratio("SUM(completion_tokens)", "SUM(spec_verify_ct)")} AS accept_length
FROM spec_turns
GROUP BY {column}
"""


def _mismatch_sql(dialect: str) -> tuple[str, str, str]:
    """(sent, non-empty, has-type-{t}) expressions over `p.sample_metadata`."""
    if dialect == "postgresql":
        doc = "CAST(p.sample_metadata AS jsonb)"
        arr = f"({doc} -> 'tito_session_mismatch')"
        return (f"({arr} IS NOT NULL)",
                f"(jsonb_typeof({arr}) = 'array' AND jsonb_array_length({arr}) > 0)",
                f"EXISTS (SELECT 1 FROM jsonb_array_elements(CASE WHEN jsonb_typeof({arr}) = "
                f"'array' THEN {arr} ELSE '[]'::jsonb END) e WHERE e ->> 'type' = '{{t}}')")
    path = "'$.tito_session_mismatch'"
    return (f"(json_type(p.sample_metadata, {path}) IS NOT NULL)",
            f"(json_type(p.sample_metadata, {path}) = 'array' AND "
            f"json_array_length(p.sample_metadata, {path}) > 0)",
            f"EXISTS (SELECT 1 FROM json_each(p.sample_metadata, {path}) e "
            f"WHERE json_extract(e.value, '$.type') = '{{t}}')")


def rollout_samples(dialect: str) -> str:
    sent, nonempty, typed = _mismatch_sql(dialect)
    flags = ",\n       ".join(
        f"CASE WHEN {typed.format(t=t)} THEN 1 ELSE 0 END AS mismatch_{t}"
        for t in MISMATCH_TYPES)
    return f"""
CREATE VIEW rollout_samples AS
SELECT p.session_id, p.sample_index, p.leaf, s.version, s.status AS session_status,
       {_label_columns()}, p.status, p.response_length,
       CASE WHEN p.status = 'truncated' THEN 1 ELSE 0 END AS truncated,
       CASE WHEN {sent} THEN 1 ELSE 0 END AS tito_sent,
       CASE WHEN {nonempty} THEN 1 ELSE 0 END AS mismatch_any,
       {flags}
FROM samples p
JOIN sessions s ON s.session_id = p.session_id
{_label_joins("s")}
"""


VIEWS = ("rollout_samples", *(f"spec_rates_by_{name}" for name in GROUPS), "spec_sessions",
         "spec_turns")


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute(spec_turns(dialect))
    op.execute(SPEC_SESSIONS)
    for name, column in GROUPS.items():
        op.execute(spec_rates(name, column))
    op.execute(rollout_samples(dialect))

    op.create_table(
        "metric_submissions",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("run_key", sa.String(64), nullable=False),
        sa.Column("test_path", sa.Text, nullable=False),
        sa.Column("backend", sa.Text, nullable=False),
        sa.Column("suite", sa.Text, nullable=False),
        sa.Column("run_id", sa.String(256), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("trusted", sa.Boolean, nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("recorded_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_metric_submissions"),
        sa.UniqueConstraint("run_key", "attempt", "fingerprint",
                            name="uq_metric_submissions_run_key_attempt_fingerprint"),
    )
    op.create_table(
        "metric_points",
        sa.Column("submission_id", sa.BigInteger, nullable=False),
        sa.Column("ord", sa.Integer, nullable=False),
        sa.Column("metric", sa.String(256), nullable=False),
        sa.Column("step", sa.BigInteger, nullable=True),
        sa.Column("value", sa.Double, nullable=True),
        sa.Column("non_finite", sa.String(9), nullable=True),
        sa.PrimaryKeyConstraint("submission_id", "ord", name="pk_metric_points"),
        sa.ForeignKeyConstraint(["submission_id"], ["metric_submissions.id"],
                                name="fk_metric_points_submission_id_metric_submissions"),
    )
    op.create_table(
        "gate_baselines",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("coordinate_key", sa.String(64), nullable=False),
        sa.Column("test_path", sa.Text, nullable=False),
        sa.Column("backend", sa.Text, nullable=False),
        sa.Column("suite", sa.Text, nullable=False),
        sa.Column("metric", sa.String(256), nullable=False),
        sa.Column("steps_key", sa.Text, nullable=False),
        sa.Column("constraint_key", sa.Text, nullable=False),
        sa.Column("step", sa.BigInteger, nullable=False),
        sa.Column("run_id", sa.String(256), nullable=False),
        sa.Column("value", sa.Double, nullable=False),
        sa.Column("trusted", sa.Boolean, nullable=False),
        sa.Column("recorded_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_gate_baselines"),
        sa.UniqueConstraint("coordinate_key", "run_id",
                            name="uq_gate_baselines_coordinate_key_run_id"),
    )
    op.create_index("ix_gate_baselines_coordinate_key_recorded_us", "gate_baselines",
                    ["coordinate_key", "recorded_us"])


def downgrade() -> None:
    op.drop_index("ix_gate_baselines_coordinate_key_recorded_us", table_name="gate_baselines")
    for table in ("gate_baselines", "metric_points", "metric_submissions"):
        op.drop_table(table)
    for view in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
