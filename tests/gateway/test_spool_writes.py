"""The gateway's spool writes off the event loop (`Spool.add_async`): a turn's file is
encoded, written and fsynced on a worker thread, so while the store is down (every
turn spooled) one slow disk write does not stall every other session's relaying.
The writes stay in order (tracked, and drained, by sequence number), a write begun
is tracked even if its caller is cancelled, and a full spool still refuses.
Oracle: a ticker on the loop, and the files on disk read back by a new `Spool`."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from app.gateway import spool as spool_module
from app.gateway.errors import SpoolFull
from app.gateway.spool import CLOSE, Spool
from tests.factory import turn

FSYNC_S = 0.2


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fsync of the spool takes FSYNC_S (a busy disk, a network volume)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        time.sleep(FSYNC_S)
        real(fd)

    monkeypatch.setattr(spool_module.os, "fsync", fsync)


def body(index: int) -> dict[str, object]:
    return {**turn(list(range(1, 200)), [7, 8]), "event_id": f"e{index}"}


async def test_a_slow_spool_write_leaves_the_event_loop_free(tmp_path: Path,
                                                             slow_disk: None) -> None:
    spool = Spool(tmp_path / "spool", 1 << 30)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        started = time.monotonic()
        entry = await spool.add_async("s-1", body(0), {"session_id": "s-1"})
        took = time.monotonic() - started
    finally:
        task.cancel()
        spool.close()
    assert took >= 2 * FSYNC_S  # the file's fsync and the directory's
    # The loop ran all along: a tick every ~10 ms (with a synchronous write: none).
    assert ticks >= took / 0.01 / 3, (ticks, took)
    assert entry.sequence == 0 and entry.event_id == "e0"


async def test_concurrent_spool_writes_are_tracked_in_order_and_survive_a_restart(
        tmp_path: Path, slow_disk: None) -> None:
    spool = Spool(tmp_path / "spool", 1 << 30)
    try:
        writes = [asyncio.create_task(spool.add_async(f"s-{i % 3}", body(i), None))
                  for i in range(6)]
        await asyncio.sleep(FSYNC_S / 2)
        writes[0].cancel()  # its caller went away mid-write: the write is still kept
        writes[5].cancel()  # this one had not begun (waiting its turn): never written
        done = await asyncio.gather(*writes, return_exceptions=True)
        assert isinstance(done[0], asyncio.CancelledError)
        assert isinstance(done[5], asyncio.CancelledError)
        assert [e.sequence for e in spool.entries] == list(range(5))
        assert [e.event_id for e in spool.entries] == [f"e{i}" for i in range(5)]
        assert spool.turns == 5
    finally:
        spool.close()
    again = Spool(tmp_path / "spool", 1 << 30)
    try:
        assert [again.read(e).body["event_id"] for e in again.entries] == \
            [f"e{i}" for i in range(5)]
    finally:
        again.close()


async def test_a_full_spool_refuses_an_async_write(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", 1000)
    try:
        await spool.add_async("s-1", {"metadata": {}}, None, CLOSE)
        with pytest.raises(SpoolFull):
            await spool.add_async("s-1", body(1), None)
        assert len(spool) == 1 and sorted(p.name for p in (tmp_path / "spool").glob("*.turn")) \
            == [f"{0:020d}.turn"]
    finally:
        spool.close()
