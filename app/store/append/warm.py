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
with R3 so that every statement runs, and group commit's wrapper
`turnlog_try_append`, in a transaction it rolls back. Nothing is committed; it
leaves what any rolled-back write leaves: a transaction id and a session-row id
used (positions and ids already have gaps), dead row versions for vacuum, a
few KB of WAL and one rollback in `pg_stat_database`.

The calls' arguments are built by the same domain rules as a real open and
append (`Writer.open`, `Writer._append_one_trip`). Any failure (the server
refuses them: a schema older than the functions, no write privilege; or a bug
here) leaves the connection as it was, logged once as a warning, and its first
real call pays the cost as before: a quicker first call is never worth a
failed one.

Owns: the throwaway session and the rolled-back calls. Refuses: anything that
commits; Citus (its connections are not warmed: `dialect`), SQLite (no
functions).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import asyncpg
import numpy as np
import structlog

from app.domain.body.session import parse_open
from app.domain.body.turn import parse_turn
from app.domain.log.events import encode_turn
from app.domain.log.tree import SessionState
from app.domain.projection.rows import label_rows, node_row, open_rows, session_head
from app.store.append import fastpath
from app.store.append.group import TRY_APPEND
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
    row, payload = open_rows(definition, recorded)
    open_args = fastpath.open_args(row, label_rows(definition), payload)
    state = SessionState(definition=definition)
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
    """Call the functions on `conn` in a transaction rolled back: True when the open and
    the append both ran (the append wrote its turn, then undone). Best effort: any
    failure short of a lost connection leaves the connection unwarmed (False, logged),
    as it was before; a lost connection raises, as any call on it would, and a cancel
    (a shutdown while the pool opens) drops the connection without waiting for a
    rollback."""
    transaction = conn.transaction()
    await transaction.start()
    warmed = False
    try:
        open_args, append_args = calls(max_nodes)
        if await conn.fetchval(fastpath.OPEN, *open_args) is None:  # None: it opened it
            warmed = await conn.fetchval(fastpath.APPEND, *append_args) is not None
            # Group commit's wrapper (migration 0009) too: the session now holds the
            # turn, so this call of the same turn writes nothing and answers NULL.
            await conn.fetchval(TRY_APPEND, *append_args)
    except asyncio.CancelledError:
        conn.terminate()
        raise
    except Exception as exc:  # noqa: BLE001 - a quicker first call is not worth an error
        if conn.is_closed():
            raise
        _not_warmed(exc)
        warmed = False
    await transaction.rollback()  # raises only if the connection is lost
    return warmed


_warned = False


def _not_warmed(exc: Exception) -> None:
    """Say why once per process as a warning (a schema older than the functions, no
    write privilege, a bug), then at debug level: every new connection would repeat it."""
    global _warned
    detail = getattr(exc, "detail", None) or str(exc)
    if _warned:
        log.debug("driver connection not warmed", error=type(exc).__name__, detail=detail)
        return
    _warned = True
    log.warning("driver connections are not warmed: their first calls will be slower",
                error=type(exc).__name__, detail=detail)
