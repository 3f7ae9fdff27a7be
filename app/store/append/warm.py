"""A new driver-pool connection runs the open and the append once, and rolls them back.

PostgreSQL compiles a PL/pgSQL function the first time a connection calls it, and
plans each statement inside the first time that statement runs. For
`turnlog_open` and `turnlog_append` that first call cost a connection 5-10 ms
more than every later one (the PostgreSQL log of the gateway's benchmark: a
connection's first append ran 14.4 and 16.3 ms, later ones 4.2-9.8 ms). It
fell on the turns of a rollout's start, when eight sessions open together and
each connection makes its first call; those were the benchmark's slowest turns.
So each new connection of the driver pool (`dialect._prepare_driver_connection`)
calls both functions for a throwaway session, with one label and one turn
with R3 so that every statement runs, in a transaction it rolls back: nothing
is written, the only trace is one transaction id used.

The calls' arguments are built by the same domain rules as a real open and
append (`Writer.open`, `Writer._append_one_trip`); a refusal of them by the
server (an error in the functions, a schema older than them) leaves the
connection as it was, and its first real call pays the cost as before.

Owns: the throwaway session and the rolled-back calls. Refuses: anything that
commits; Citus (its connections are not warmed: `dialect`), SQLite (no
functions).
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import asyncpg
import numpy as np
import structlog

from app.domain.body.session import parse_open
from app.domain.body.turn import parse_turn
from app.domain.errors import DomainError
from app.domain.log.events import encode_turn
from app.domain.log.tree import SessionState
from app.domain.projection.rows import label_rows, node_row, session_definition, session_head
from app.domain.wire import jsonio
from app.store.append import fastpath
from app.store.engine.db import now_us

log = structlog.get_logger(__name__)

PREFIX = "turnlog-warm-"
_LAYERS, _TOPK = 1, 2
_PROMPT, _OUTPUT = [1, 2, 3], [4, 5]
# Full R3: a row per token but the last.
_R3 = base64.b64encode(np.zeros((len(_PROMPT) + len(_OUTPUT) - 1, _LAYERS, _TOPK),
                                "<i4").tobytes()).decode("ascii")


def _turn(event_id: str) -> dict[str, Any]:
    return {"event_id": event_id, "record": {
        "timestamp": 0.0, "request_timestamp": 0.0, "method": "POST",
        "path": "/v1/chat/completions", "status_code": 200,
        "request": {"input_ids": _PROMPT, "return_routed_experts": True},
        "response": {"choices": [{"finish_reason": "stop", "meta_info": {
            "output_token_logprobs": [[-0.5, token] for token in _OUTPUT],
            "routed_experts": _R3}}]}}}


def calls(max_nodes: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The arguments of `turnlog_open` and of `turnlog_append` (its first turn) for a
    new throwaway session, by the rules a real open and append follow."""
    session_id = PREFIX + uuid.uuid4().hex
    definition = parse_open({"session_id": session_id, "version": "v2",
                             "r3": {"num_layers": _LAYERS}, "labels": {"warm": "1"}})
    recorded = now_us()
    state = SessionState(definition=definition)
    row = {**session_definition(definition, recorded), **session_head(state)}
    open_args = fastpath.open_args(row, label_rows(definition),
                                   jsonio.dumps({"session": definition.body()}))
    body = parse_turn(_turn(uuid.uuid4().hex), definition, None)
    attachment = state.attach(body, max_nodes)
    stored = encode_turn(body, attachment, definition.num_layers)
    node = state.new_node(attachment.seq, attachment.parent, body.event_id, body.facts,
                          attachment.prompt_lcp)
    append_args = fastpath.append_args(
        session_id, 0, attachment.seq, body.event_id, stored, recorded,
        node_row(session_id, node, 0, recorded), session_head(state, node))
    return open_args, append_args


async def warm_connection(conn: asyncpg.Connection, max_nodes: int) -> bool:
    """Call both functions on `conn` in a transaction rolled back: True when both ran
    (the append wrote its turn, then undone). A server error leaves it unwarmed
    (False, logged), and so does a refusal by the rules; a lost connection raises, as
    any call on it would."""
    try:
        open_args, append_args = calls(max_nodes)
    except DomainError as exc:  # the rules refuse the throwaway turn: a bug, not a failure
        log.warning("driver connection not warmed", error=type(exc).__name__,
                    detail=exc.detail)
        return False
    transaction = conn.transaction()
    await transaction.start()
    try:
        if await conn.fetchval(fastpath.OPEN, *open_args) is not None:
            return False  # the id existed (cannot happen: a fresh uuid)
        return await conn.fetchval(fastpath.APPEND, *append_args) is not None
    except asyncpg.PostgresError as exc:
        log.debug("driver connection not warmed", error=type(exc).__name__, detail=str(exc))
        return False
    finally:
        await transaction.rollback()
