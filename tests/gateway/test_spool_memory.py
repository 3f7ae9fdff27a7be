"""The spool holds its writes on disk, not in memory: `--spool-max-bytes` bounds the
disk, and a parsed turn takes ~10x its bytes on disk (a prompt's ids as Python ints),
so a full spool of long prompts kept in memory took ~10 GB. Oracle: tracemalloc, the
memory Python holds, against the bytes the spool wrote. A spooled file that cannot be
read back holds the drain (readiness says so) and is never dropped: once it is
readable again it is stored (three backends, in process)."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import uuid
from pathlib import Path

from app.gateway.metrics import GatewayMetrics
from app.gateway.recorder import Recorder
from app.gateway.spool import Spool
from app.services import build_services
from app.settings import Settings
from tests.factory import open_body, turn
from tests.gateway.conftest import wait_for

PROMPT = 20_000


def long_turn(index: int) -> dict[str, object]:
    body = turn(list(range(1, PROMPT + 1)), [7, 8])
    body["event_id"] = f"e{index}"
    return body


def held_while(action: object) -> int:
    """Bytes Python still holds after `action()` (its own garbage collected)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        action()  # type: ignore[operator]
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_the_spool_keeps_its_bodies_on_disk_not_in_memory(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", 1 << 30)
    try:
        held = held_while(lambda: [spool.add(f"s-{i % 4}", long_turn(i), {"session_id": "x"})
                                   for i in range(30)])
        on_disk = spool.bytes
        assert spool.turns == 30 and on_disk > 30 * PROMPT  # a few bytes an id
        # Bodies in memory would be ~36 bytes an id: ~8x the disk. Tracking is a few KB.
        assert held < on_disk / 20, (held, on_disk)
    finally:
        spool.close()
    # A gateway starting over that spool reads every file and keeps no body either.
    again: list[Spool] = []
    try:
        held = held_while(lambda: again.append(Spool(tmp_path / "spool", 1 << 30)))
        assert again[0].turns == 30 and held < on_disk / 20, (held, on_disk)
        # What the drain reads back is the turn as it was spooled.
        first = again[0].read(again[0].entries[0])
        assert first.body["event_id"] == "e0" and first.open_body == {"session_id": "x"}
        assert first.body["record"]["request"]["input_ids"] == list(range(1, PROMPT + 1))
    finally:
        for spool in again:
            spool.close()


async def test_a_spooled_write_that_cannot_be_read_holds_the_drain(db_url: str,
                                                                   tmp_path: Path) -> None:
    svc = build_services(Settings.load(database_url=db_url, migrate_on_start=False,
                                       api_tokens=""))
    spool = Spool(tmp_path / "spool", 1 << 30)
    sid = f"sp-{uuid.uuid4().hex[:10]}"
    entry = spool.add(sid, turn([1, 2, 3], [4]), open_body(sid))
    [path] = (tmp_path / "spool").glob("*.turn")
    kept = path.read_bytes()
    path.write_bytes(b"{damaged")
    recorder = Recorder(svc, spool, GatewayMetrics(), store_timeout=10)
    recorder.start()
    try:
        async def not_ready() -> bool:
            return not (await recorder.ready())[0]

        await wait_for(not_ready, what="readiness to say the spool cannot drain")
        await asyncio.sleep(0.3)
        assert list(spool.entries) == [entry]  # kept, not dropped
        path.write_bytes(kept)  # restored: the next round stores it

        async def drained() -> bool:
            return len(spool) == 0

        await wait_for(drained, timeout=30, what="the restored write to drain")
        assert [n["parent"] for n in (await svc.reader.session(sid))["tree"]] == [None]
        assert (await recorder.ready())[0]
    finally:
        await recorder.stop()
        spool.close()
        await svc.db.dispose()
