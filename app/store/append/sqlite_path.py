"""The append in one call on SQLite: the whole write transaction on aiosqlite's thread.

SQLite has no server-side functions (`fastpath.py` is PostgreSQL's one round
trip), but every statement through SQLAlchemy's aiosqlite adapter costs
several hops to the driver's thread (cursor, execute, fetch, close), and an
append is about a dozen statements with its `BEGIN IMMEDIATE` and `COMMIT`.
Here one function runs on the writer connection's thread instead: `BEGIN
IMMEDIATE`, check that the session is still open with the number of turns
the caller folded, insert the event, the R3 patch and the node, update the
session head, `COMMIT` — with plain `sqlite3` calls on SQL strings built once
per shape of row. It answers the event's position, or None when the session
moved on (nothing written; the caller takes the general path, which folds
under the lock and answers repeats and refusals). The rows are those the
general path writes: the same dicts (`node_row`, `session_head`,
`patch_row`), every key a column.

Owns: the SQL of that one transaction and running it on the driver's thread.
Refuses: deciding anything (validation, attachment and idempotency are the
domain's and `writes.py`'s), and PostgreSQL (`fastpath.py`).
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.exc import DBAPIError

from app.domain.log.events import TURN_RECORDED, StoredTurn
from app.store.engine.db import Database
from app.store.engine.schema import patch_row

CHECK = "SELECT num_nodes, status FROM sessions WHERE session_id = ?"
EVENT = ("INSERT INTO events (session_id, seq, type, event_id, payload, prompt_lcp, "
         "prompt_delta, recorded_us) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")


@functools.cache
def insert_sql(table: str, columns: tuple[str, ...]) -> str:
    return (f"INSERT INTO {table} ({', '.join(columns)}) "
            f"VALUES ({', '.join('?' * len(columns))})")


@functools.cache
def head_sql(columns: tuple[str, ...]) -> str:
    return f"UPDATE sessions SET {', '.join(f'{c} = ?' for c in columns)} WHERE session_id = ?"


def _values(row: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    return tuple(row), tuple(row.values())


def write_turn(
    conn: sqlite3.Connection, session_id: str, num_nodes: int,
    event: Sequence[Any], patch: Mapping[str, Any] | None,
    node: Mapping[str, Any], head: Mapping[str, Any],
) -> int | None:
    """The transaction, on the connection's own thread (autocommit mode: explicit
    BEGIN/COMMIT). The node's `position` is the event's, filled in here."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        found = conn.execute(CHECK, (session_id,)).fetchone()
        if found is None or found[0] != num_nodes or found[1] != "open":
            conn.execute("ROLLBACK")
            return None
        position = conn.execute(EVENT, event).lastrowid
        assert position is not None
        if patch is not None:
            columns, values = _values(patch)
            conn.execute(insert_sql("r3_patches", columns), values)
        columns, values = _values({**node, "position": position})
        conn.execute(insert_sql("nodes", columns), values)
        columns, values = _values(head)
        conn.execute(head_sql(columns), (*values, session_id))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return int(position)


async def append(
    db: Database, session_id: str, num_nodes: int, seq: int, event_id: str,
    stored: StoredTurn, recorded_us: int, node: Mapping[str, Any], head: Mapping[str, Any],
) -> int | None:
    """Write one turn in one call on the writer's thread: the position, or None (moved on).

    Queued behind the process's other writes like `Database.write()`. A driver
    error is raised as SQLAlchemy's (as the general path raises it), so the API
    answers it the same way (e.g. 503 for a locked or lost database).
    """
    event = (session_id, seq, TURN_RECORDED, event_id, stored.payload, stored.prompt_lcp,
             stored.prompt_delta, recorded_us)
    patch = None if stored.patch is None else patch_row(session_id, seq, stored.patch)
    async with db.sqlite_writer() as driver:
        try:
            # aiosqlite runs a function on its connection's thread with `_execute`, the
            # call its own methods (and SQLAlchemy's adapter) are built on.
            return await driver._execute(write_turn, driver._conn, session_id, num_nodes,
                                         event, patch, node, head)
        except sqlite3.Error as exc:
            raise DBAPIError.instance("turnlog one-call append", None, exc,
                                      sqlite3.Error) from exc
