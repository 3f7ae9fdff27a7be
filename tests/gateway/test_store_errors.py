"""`recorder.recurs`: which store errors are a verdict on the turn (the store would
raise them again for it: spooled, it would block its session's queue for good) and
which are faults of the moment (spooled and retried)."""

from __future__ import annotations

import sqlite3

import asyncpg
import pytest
import sqlalchemy.exc

from app.gateway.recorder import recurs


def _wrapped(orig: BaseException, kind: type[sqlalchemy.exc.DBAPIError]) -> BaseException:
    return kind("INSERT …", {}, orig)


@pytest.mark.parametrize("error", [
    sqlite3.DataError("string or blob too big"),
    asyncpg.DataError("invalid input syntax"),
    asyncpg.ProgramLimitExceededError("index row size exceeds maximum"),
    _wrapped(sqlite3.DataError("string or blob too big"), sqlalchemy.exc.DataError),
], ids=["sqlite", "asyncpg-22", "asyncpg-54", "sqlalchemy-wrapped"])
def test_a_value_the_database_cannot_hold_recurs(error: BaseException) -> None:
    assert recurs(error)


def test_recurs_follows_the_cause_chain() -> None:
    try:
        try:
            raise asyncpg.DataError("out of range")
        except asyncpg.DataError as inner:
            raise RuntimeError("the append failed") from inner
    except RuntimeError as outer:
        assert recurs(outer)


@pytest.mark.parametrize("error", [
    TimeoutError("the store did not answer"),
    ConnectionRefusedError(),
    OSError("disk I/O error"),
    _wrapped(sqlite3.OperationalError("database is locked"), sqlalchemy.exc.OperationalError),
    asyncpg.PostgresConnectionError("connection lost"),
    asyncpg.SerializationError("could not serialize access"),
], ids=["timeout", "refused", "io", "locked", "pg-connection", "serialization"])
def test_a_fault_of_the_moment_does_not_recur(error: BaseException) -> None:
    assert not recurs(error)
