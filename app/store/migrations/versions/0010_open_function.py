"""A session opened in one round trip: `turnlog_open(...)`, a server-side function
(PostgreSQL).

Opening a session wrote its `sessions` row, its labels and its
`session_opened` event in one transaction of five statements (a look for the
id first, then three inserts and the commit), and the open route read the
row back for its reply: nine round trips through SQLAlchemy, ~1.9 ms of the
server's CPU, more than a small turn's whole append. Every session opened by
the recording gateway pays it on its first turn.

One call now inserts the row (`ON CONFLICT (session_id) DO NOTHING`), the
labels and the event, and answers NULL — opened by this call — or the
`open_fingerprint` of the session that already had the id (an idempotent
repeat when it equals the caller's, else 409; the caller compares). It reads
first: a repeat (the recording gateway tries an open for every session whose
state its cache does not hold) then writes nothing and takes no transaction
id, so its commit flushes no WAL. A concurrent open of the same id waits on the unique index for the other
transaction and then sees its row: in PL/pgSQL each statement takes a new
snapshot, so the `SELECT` after a conflict reads the committed row.

Like `turnlog_append` (migration 0008) the function is not distributed on
Citus: it runs on the coordinator, whose statements are each routed to the
one worker holding the session's colocated shards (`sessions`,
`session_labels` and `events` are distributed by `session_id`), so the call
is one single-worker transaction and the `xid`, `id` and `position`
defaults are the coordinator's. The labels go in one `INSERT … VALUES` per
label (a router statement on Citus) rather than an `INSERT … SELECT` from
the arrays, which Citus would plan through the coordinator.

The argument order is the one `app/store/append/fastpath.py` binds
(`SESSION_COLUMNS`). SQLite has no functions; its open stays one
`BEGIN IMMEDIATE` transaction.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SIGNATURE = (
    "text, text, text, integer, boolean, integer, text, text, bigint, "  # as opened
    "text, integer, integer, integer, bigint, bigint, bigint, bigint, "  # head
    "text[], text[], text"                                               # labels, event
)

PG_OPEN_FN = """
CREATE OR REPLACE FUNCTION turnlog_open(
  p_session_id text, p_version text, p_pause_generation_mode text, p_num_layers integer,
  p_spec boolean, p_max_trim_tokens integer, p_labels text, p_open_fingerprint text,
  p_created_us bigint,
  p_status text, p_num_nodes integer, p_active_leaf integer, p_topk integer,
  p_spec_correct bigint, p_spec_proposed bigint, p_spec_verify bigint,
  p_spec_completion bigint,
  p_label_keys text[], p_label_values text[], p_payload text
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
  v_id bigint;
  v_fingerprint text;
BEGIN
  -- A session that exists is answered from a read: no transaction id, no WAL, no
  -- durable commit (the insert's column defaults would take them before its conflict).
  SELECT open_fingerprint INTO v_fingerprint FROM sessions WHERE session_id = p_session_id;
  IF FOUND THEN
    RETURN v_fingerprint;
  END IF;
  INSERT INTO sessions (session_id, version, pause_generation_mode, num_layers, spec,
                        max_trim_tokens, labels, open_fingerprint, created_us, status,
                        num_nodes, active_leaf, topk, spec_correct, spec_proposed,
                        spec_verify, spec_completion)
    VALUES (p_session_id, p_version, p_pause_generation_mode, p_num_layers, p_spec,
            p_max_trim_tokens, p_labels, p_open_fingerprint, p_created_us, p_status,
            p_num_nodes, p_active_leaf, p_topk, p_spec_correct, p_spec_proposed,
            p_spec_verify, p_spec_completion)
    ON CONFLICT (session_id) DO NOTHING
    RETURNING id INTO v_id;
  IF v_id IS NULL THEN
    -- Sessions are never deleted (migration 0003): the row that won is there.
    SELECT open_fingerprint INTO STRICT v_fingerprint FROM sessions
      WHERE session_id = p_session_id;
    RETURN v_fingerprint;
  END IF;
  FOR i IN 1 .. coalesce(array_length(p_label_keys, 1), 0) LOOP
    INSERT INTO session_labels (session_id, key, value_text)
      VALUES (p_session_id, p_label_keys[i], p_label_values[i]);
  END LOOP;
  INSERT INTO events (session_id, type, payload, recorded_us)
    VALUES (p_session_id, 'session_opened', p_payload, p_created_us);
  RETURN NULL;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_OPEN_FN)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS turnlog_open({SIGNATURE})")
