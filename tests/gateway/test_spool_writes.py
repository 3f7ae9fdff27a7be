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


async def test_writes_are_numbered_in_call_order_and_held_from_the_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A review's finding: the encoding ran before the order was taken, so a turn slow
    # to encode was numbered after the close sent behind it (drained first, the turn
    # then refused by the closed session); and until its file was on disk the
    # session did not count as held, so its next turn could go straight to the store.
    real = spool_module._prepare
    slow = {"turn"}

    def prepare(session_id, body, open_body, kind):  # type: ignore[no-untyped-def]
        if kind in slow:
            time.sleep(0.2)
        return real(session_id, body, open_body, kind)

    monkeypatch.setattr(spool_module, "_prepare", prepare)
    spool = Spool(tmp_path / "spool", 1 << 30)
    try:
        turn_write = asyncio.create_task(spool.add_async("s", body(0), None))
        await asyncio.sleep(0)
        assert spool.holds("s") and spool.count_turns("s") == 1  # held from the call
        close_write = asyncio.create_task(spool.add_async("s", {"metadata": {}}, None, CLOSE))
        await asyncio.sleep(0.01)
        await asyncio.gather(turn_write, close_write)
        assert [(e.sequence, e.kind) for e in spool.entries] == [(0, "turn"), (1, "close")]
        assert spool.count_turns("s") == 1 and spool.count_writes("s") == 2
    finally:
        spool.close()


async def test_a_write_cancelled_twice_still_lands_before_the_next(tmp_path: Path,
                                                                   slow_disk: None) -> None:
    spool = Spool(tmp_path / "spool", 1 << 30)
    try:
        first = asyncio.create_task(spool.add_async("s", body(0), None))
        second = asyncio.create_task(spool.add_async("s", body(1), None))
        await asyncio.sleep(FSYNC_S / 2)
        first.cancel()
        await asyncio.sleep(FSYNC_S / 4)
        first.cancel()  # again, while it waits for its write
        await asyncio.gather(first, second, return_exceptions=True)
        assert first.cancelled()
        assert [(e.sequence, e.event_id) for e in spool.entries] == [(0, "e0"), (1, "e1")]
        assert not spool.holds("other")
    finally:
        spool.close()
