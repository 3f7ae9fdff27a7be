"""The append in one round trip: `turnlog_append(...)`, a server-side function (PostgreSQL).

One call takes the session's row lock, checks that the session is still what
the caller folded (open, `num_nodes` turns: the caller's cached state is the
truth), and inserts the event, the R3 patch, the node and the new session
head; it returns the event's position, or NULL without writing anything when
the check fails (the caller then takes the general path, which reads the
session under the lock). Called outside an explicit transaction, the call is
its own transaction: lock, writes and durable commit cost one round trip.

On Citus the function is deliberately *not* distributed (no
`create_distributed_function`): it runs on the coordinator, whose statements
are each routed to the one worker holding the session's colocated shards, so
the call is still a single-worker transaction (one-phase commit) and the
`xid` and `position` defaults are the coordinator's, as the feed fence needs
(`app/store/engine/dialect.py`). A function delegated to the worker would stamp the
worker's transaction ids.

The argument order is the one `app/store/append/fastpath.py` binds. SQLite has no
functions; its append stays a `BEGIN IMMEDIATE` transaction.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SIGNATURE = (
    "text, integer, "                                                  # session, expected nodes
    "integer, text, text, integer, bytea, bigint, "                    # event
    "integer, integer, integer, integer, text, bytea, "                # R3 patch
    "integer, integer, integer, integer, integer, integer, integer, integer, text, text, "
    "bigint, bigint, bigint, bigint, bigint, double precision, text, text, "  # node
    "integer, integer, bigint, bigint, bigint, bigint"                 # head
)

PG_APPEND_FN = """
CREATE OR REPLACE FUNCTION turnlog_append(
  p_session_id text, p_num_nodes integer,
  p_seq integer, p_event_id text, p_payload text, p_event_lcp integer, p_prompt_delta bytea,
  p_recorded_us bigint,
  p_start_row integer, p_end_row integer, p_num_layers integer, p_topk integer, p_dtype text,
  p_data bytea,
  p_parent integer, p_depth integer, p_num_tokens integer, p_prompt_len integer,
  p_prompt_lcp integer, p_output_len integer, p_r3_start integer, p_r3_end integer,
  p_finish_reason text, p_weight_version text, p_spec_correct bigint, p_spec_proposed bigint,
  p_spec_verify bigint, p_spec_completion bigint, p_cached_tokens bigint,
  p_record_ts double precision, p_record_hour text, p_record_day text,
  p_active_leaf integer, p_head_topk integer, p_sum_correct bigint, p_sum_proposed bigint,
  p_sum_verify bigint, p_sum_completion bigint
) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
  v_num_nodes integer;
  v_status text;
  v_position bigint;
BEGIN
  SELECT num_nodes, status INTO v_num_nodes, v_status FROM sessions
    WHERE session_id = p_session_id FOR NO KEY UPDATE;
  IF NOT FOUND OR v_num_nodes <> p_num_nodes OR v_status <> 'open' THEN
    RETURN NULL;
  END IF;
  INSERT INTO events (session_id, seq, type, event_id, payload, prompt_lcp, prompt_delta,
                      recorded_us)
    VALUES (p_session_id, p_seq, 'turn_recorded', p_event_id, p_payload, p_event_lcp,
            p_prompt_delta, p_recorded_us)
    RETURNING position INTO v_position;
  IF p_data IS NOT NULL THEN
    INSERT INTO r3_patches (session_id, seq, start_row, end_row, num_layers, topk, dtype, data)
      VALUES (p_session_id, p_seq, p_start_row, p_end_row, p_num_layers, p_topk, p_dtype,
              p_data);
  END IF;
  INSERT INTO nodes (session_id, seq, parent, depth, num_tokens, prompt_len, prompt_lcp,
                     output_len, r3_start, r3_end, finish_reason, weight_version,
                     spec_correct, spec_proposed, spec_verify, spec_completion,
                     cached_tokens, record_ts, record_hour, record_day, position, recorded_us)
    VALUES (p_session_id, p_seq, p_parent, p_depth, p_num_tokens, p_prompt_len, p_prompt_lcp,
            p_output_len, p_r3_start, p_r3_end, p_finish_reason, p_weight_version,
            p_spec_correct, p_spec_proposed, p_spec_verify, p_spec_completion,
            p_cached_tokens, p_record_ts, p_record_hour, p_record_day, v_position,
            p_recorded_us);
  UPDATE sessions SET num_nodes = p_num_nodes + 1, active_leaf = p_active_leaf,
                      topk = p_head_topk, spec_correct = p_sum_correct,
                      spec_proposed = p_sum_proposed, spec_verify = p_sum_verify,
                      spec_completion = p_sum_completion
    WHERE session_id = p_session_id;
  RETURN v_position;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_APPEND_FN)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS turnlog_append({SIGNATURE})")
