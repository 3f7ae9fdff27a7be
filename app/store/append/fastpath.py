"""The append in one round trip on PostgreSQL: one call of `turnlog_append`; and
the open in one: one call of `turnlog_open`.

The function (created by migration 0008) takes the session's row lock, checks
that the session is still open with the number of turns the caller folded,
and writes the event, the R3 patch, the node and the session head. The call
runs outside an explicit transaction on a plain asyncpg connection, so the
lock, the four writes and the durable commit are one round trip, with no
SQLAlchemy statement building. It answers the event's position, or None when
the session moved on (another worker appended, or it was closed): nothing was
written and the caller takes the general path, which folds under the lock.

With group commit on (`group.py`) the call is handed to a `Grouped` instead of
a pool: it then shares one transaction, and one durable commit, with the
concurrent calls of other sessions, and answers the same way.

`turnlog_open` (migration 0010) inserts a session's row, labels and
`session_opened` event, or answers the `open_fingerprint` of the session
that already has the id, for the caller to compare. An open under a request's
deadline (`X-Turnlog-Timeout`) runs as its own transaction instead (BEGIN, the
call, COMMIT: two more round trips) so that an open past the deadline is rolled
back, not committed.

Owns: binding the rows the domain computed to the functions' arguments, and
the single calls.
Refuses: deciding anything (validation, attachment and idempotency are the
domain's and `writes.py`'s), and SQLite (no functions; see `writes.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

import asyncpg

from app.domain.log.events import StoredTurn
from app.store.engine.db import check_deadline, has_deadline

APPEND = "SELECT turnlog_append(" + ", ".join(f"${i}" for i in range(1, 39)) + ")"

# The node columns in the order of the function's node arguments.
NODE_COLUMNS = ("parent", "depth", "num_tokens", "prompt_len", "prompt_lcp", "output_len",
                "r3_start", "r3_end", "finish_reason", "weight_version", "spec_correct",
                "spec_proposed", "spec_verify", "spec_completion", "cached_tokens",
                "record_ts", "record_hour", "record_day")
# The `sessions` columns in the order of `turnlog_open`'s first arguments.
SESSION_COLUMNS = ("session_id", "version", "pause_generation_mode", "num_layers", "spec",
                   "max_trim_tokens", "labels", "open_fingerprint", "created_us", "status",
                   "num_nodes", "active_leaf", "topk", "spec_correct", "spec_proposed",
                   "spec_verify", "spec_completion")
OPEN = "SELECT turnlog_open(" + ", ".join(f"${i}" for i in range(1, 21)) + ")"
HEAD_COLUMNS = ("active_leaf", "topk", "spec_correct", "spec_proposed", "spec_verify",
                "spec_completion")


def append_args(
    session_id: str, num_nodes: int, seq: int, event_id: str, stored: StoredTurn,
    recorded_us: int, node: Mapping[str, Any], head: Mapping[str, Any],
) -> tuple[Any, ...]:
    """The 38 arguments of `turnlog_append`, in its order (migration 0008)."""
    patch = stored.patch
    patch_args: tuple[Any, ...] = (None,) * 6 if patch is None else (
        patch.start, patch.end, patch.num_layers, patch.topk, patch.dtype, patch.data)
    return (
        session_id, num_nodes,
        seq, event_id, stored.payload, stored.prompt_lcp, stored.prompt_delta, recorded_us,
        *patch_args,
        *(node[name] for name in NODE_COLUMNS),
        *(head[name] for name in HEAD_COLUMNS),
    )


def open_args(row: Mapping[str, Any], labels: Sequence[Mapping[str, Any]],
              payload: str) -> tuple[Any, ...]:
    """The 20 arguments of `turnlog_open`, in its order (migration 0010): the
    `sessions` row, the label rows' keys and values, the event's payload."""
    return (*(row[name] for name in SESSION_COLUMNS),
            [label["key"] for label in labels], [label["value_text"] for label in labels],
            payload)


async def open_session(pool: asyncpg.Pool, args: tuple[Any, ...]) -> str | None:
    """Call `turnlog_open` in its own transaction: None when it opened the session,
    else the `open_fingerprint` of the session that already had the id. Under a
    request's deadline (`check_deadline`) the call runs in a transaction of its own,
    committed only while the deadline has not passed."""
    async with pool.acquire() as conn, discard_if_broken(conn):
        if not has_deadline():
            stored = await conn.fetchval(OPEN, *args)
        else:
            async with conn.transaction():
                stored = await conn.fetchval(OPEN, *args)
                if stored is None:  # it opened the session (a repeat wrote nothing)
                    check_deadline()
    return None if stored is None else str(stored)


class Grouped(Protocol):
    """Where a call shares its commit with others (`group.GroupCommit`)."""

    async def append(self, args: tuple[Any, ...]) -> int | None: ...


async def append(via: asyncpg.Pool | Grouped, args: tuple[Any, ...]) -> int | None:
    """The position, or None (moved on): alone on a pool, or in a group commit."""
    if isinstance(via, asyncpg.Pool):
        return await call(via, args)
    return await via.append(args)


async def call(pool: asyncpg.Pool, args: tuple[Any, ...]) -> int | None:
    """Call `turnlog_append` in its own transaction: the position, or None (moved on)."""
    async with pool.acquire() as conn, discard_if_broken(conn):
        position = await conn.fetchval(APPEND, *args)
    return None if position is None else int(position)


@contextlib.asynccontextmanager
async def discard_if_broken(conn: asyncpg.Connection) -> AsyncIterator[None]:
    """Close a connection whose protocol broke under a call, before the pool takes it back.

    A backend terminated between two calls (`pg_terminate_backend`, a restart)
    can leave the driver's protocol mid-message before the socket's end is read:
    the next call on it raises `InternalClientError` ("cannot switch to state
    …"), and the pool would hand the same connection out again. Nothing of the
    call reached the server; the API answers it as a lost connection (503).
    """
    try:
        yield
    except asyncpg.exceptions.InternalClientError:
        conn.terminate()
        raise
