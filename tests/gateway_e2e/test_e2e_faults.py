"""Whole sessions through a store outage: the spool keeps their shape.

The gateway's own fault tests (tests/gateway/test_faults.py) check linear
conversations; here the driver plays branchy sessions (tool calls, retries,
a second root, a v1 rollback, a session auto-opened while the store is down)
with the store failing mid-session, on SQLite (the file locked by another
process) and PostgreSQL (`pg_ctl stop -m immediate`). Every caller is served;
once the store is back and the spool drained, each session's stored turns,
seqs and parents are the driver's, and its samples equal the oracle and a full
forward — the spooled turns drained in order, exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.store.engine import migrate
from tests.gateway_e2e.checks import Router, check_samples, open_body
from tests.gateway_e2e.conftest import store_at
from tests.gateway_e2e.scenarios import play_v1, play_v2
from tests.gateway_e2e.session_driver import SessionDriver
from tests.pg.stoppable import migrated_stoppable_cluster

ROUTER = Router()
# Turns the first session records before the store fails.
BEFORE_FAULT = 2


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in the gateway's metrics:\n{text}")


async def wait_drained(http: httpx.AsyncClient, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = (await http.get("/turnlog/metrics")).text
        if metric(text, "turnlog_gateway_spooled_turns") == 0:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the spool did not drain in {timeout}s")


class SqliteLock:
    """Another process's exclusive lock on the file: every write waits, then fails."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn: sqlite3.Connection | None = None

    def fail(self) -> None:
        # fail() and recover() run on whichever executor thread `to_thread` picks.
        self.conn = sqlite3.connect(self.path, isolation_level=None, timeout=30,
                                    check_same_thread=False)
        self.conn.execute("BEGIN EXCLUSIVE")

    def recover(self) -> None:
        assert self.conn is not None
        self.conn.execute("ROLLBACK")
        self.conn.close()


@contextlib.asynccontextmanager
async def store_with_fault(kind: str, tmp_path: Path
                           ) -> AsyncIterator[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """A migrated database and how to make it fail and recover."""
    if kind == "sqlite":
        path = tmp_path / "store.db"
        url = f"sqlite+aiosqlite:///{path}"
        await migrate.upgrade_async(url)
        lock = SqliteLock(path)
        yield url, lock.fail, lock.recover
        return
    async with migrated_stoppable_cluster() as cluster:
        yield cluster.url, lambda: cluster.stop("immediate"), cluster.start


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_branchy_sessions_survive_a_store_outage(
        kind: str, fake_sglang: Any, gateway_at: Any, tmp_path: Path) -> None:
    upstream = await fake_sglang()
    sid = f"fault-{uuid.uuid4().hex[:10]}"
    async with store_with_fault(kind, tmp_path) as (url, fail, recover):
        proxy = await gateway_at(url, upstream.base_url, "--version", "v2",
                                 "--pause-generation-mode", "in_place",
                                 "--num-layers", str(ROUTER.num_layers), "--speculative",
                                 "--store-timeout", "1")
        async with httpx.AsyncClient(base_url=proxy.base_url, timeout=120) as http:
            first = SessionDriver(http, f"{sid}-a", version="v2", addition=True)
            own = SessionDriver(http, f"{sid}-b", version="v1", addition=False)
            late = SessionDriver(http, f"{sid}-c", version="v2", addition=True)
            async with store_at(url) as store:
                await store.open(open_body(own, ROUTER))
            down = False

            async def maybe_fail(accepted: int) -> None:
                nonlocal down
                if accepted == BEFORE_FAULT and not down:
                    await asyncio.to_thread(fail)
                    down = True

            first.before_turn = maybe_fail
            await play_v2(first)
            assert down
            await play_v1(own)
            await play_v2(late)  # auto-opened while the store is down
            ready = await http.get("/turnlog/readyz")
            assert ready.status_code == 503, ready.text
            text = (await http.get("/turnlog/metrics")).text
            spooled = len(first.nodes) - BEFORE_FAULT + len(own.nodes) + len(late.nodes)
            assert metric(text, "turnlog_gateway_spooled_turns") == spooled
            await asyncio.to_thread(recover)
            await wait_drained(http)
            assert (await http.get("/turnlog/readyz")).status_code == 200
        async with store_at(url) as store:
            for driver in (first, own, late):
                await check_samples(store, driver, ROUTER)
