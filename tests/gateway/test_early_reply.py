"""A recorded turn's reply goes out while its turn is written, all but its last byte
(`Gateway._answer_while_recording`): the caller holds no complete reply before the
turn is durable, and the reply's relaying overlaps the store's write.

What makes that safe is room promised in the spool (`Spool.reserve`): a turn whose
reply has begun can no longer be answered 503 `spool-full`, so it must be able to
be spooled whatever the spool holds by then. Oracles: the bytes a streaming caller
holds while the store is locked, the rows of the SQLite file, the spool's files
read back by a new `Spool`, and a turn's file measured against the bound promised.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from app.gateway.errors import SpoolFull
from app.gateway.metrics import GatewayMetrics
from app.gateway.proxy import Gateway, TurnNotKept, _held_back
from app.gateway.recorder import RECORDED, SPOOL_FULL
from app.gateway.spool import Spool, turn_file_bound
from tests.factory import turn
from tests.gateway.conftest import chat, metric, scrape, sqlite_lock

# -- the spool's promises ------------------------------------------------------------


def body(index: int, size: int = 200) -> dict[str, Any]:
    return {**turn(list(range(1, size)), [7, 8]), "event_id": f"e{index}"}


def test_a_promise_takes_room_until_it_is_released(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", 1000)
    try:
        first = spool.reserve(600)
        assert first is not None and spool.reserved == 600
        assert spool.reserve(401) is None  # 600 + 401 > 1000
        second = spool.reserve(400)
        assert second is not None and spool.reserved == 1000
        first.release()
        first.release()  # once only
        assert spool.reserved == 400
        assert spool.reserve(600) is not None
    finally:
        spool.close()


def test_a_promised_turn_is_spooled_where_an_unpromised_write_is_refused(
        tmp_path: Path) -> None:
    size = len(json.dumps(body(0)))
    spool = Spool(tmp_path / "spool", 3 * size)
    try:
        promise = spool.reserve(2 * size)
        assert promise is not None
        spool.add("s-1", body(0), None)  # fits beside the promise
        with pytest.raises(SpoolFull):
            spool.add("s-1", body(1), None)  # the rest is promised
        entry = spool.add("s-1", body(2), None, reservation=promise)
        # Its bytes now count as spooled, and the promise is spent, not counted twice.
        assert not promise.held and spool.reserved == 0
        assert spool.bytes == sum(e.size for e in spool.entries)
        assert [e.event_id for e in spool.entries] == ["e0", "e2"]
        promise.release()  # the gateway's release after the outcome: nothing left
        assert spool.reserved == 0
    finally:
        spool.close()
    reread = Spool(tmp_path / "spool", 3 * size)
    try:
        assert [e.event_id for e in reread.entries] == ["e0", entry.event_id]
    finally:
        reread.close()


async def test_a_write_under_way_takes_its_room_from_the_promises(tmp_path: Path,
                                                                 monkeypatch: Any) -> None:
    """A write past its check but not yet on disk counts as taken: a promise made
    meanwhile cannot overcommit the spool (a promised turn must find its room)."""
    size = len(json.dumps(body(0)))
    spool = Spool(tmp_path / "spool", 3 * size)
    started, release = threading.Event(), threading.Event()
    real = spool._write

    def slow_write(sequence: int, data: bytes) -> None:
        started.set()
        release.wait(10)
        real(sequence, data)

    monkeypatch.setattr(spool, "_write", slow_write)
    try:
        writing = asyncio.create_task(spool.add_async("s-1", body(0), None))
        await asyncio.to_thread(started.wait, 10)
        assert spool.bytes == 0 and spool.writing > 0
        assert spool.reserve(3 * size - spool.writing + 1) is None
        promise = spool.reserve(2 * size)
        assert promise is not None
        release.set()
        await writing
        assert spool.writing == 0 and spool.bytes + spool.reserved <= 3 * size
        spool.add("s-2", body(1), None, reservation=promise)  # its room is there
    finally:
        release.set()
        spool.close()


async def test_a_promised_async_write_counts_its_promise_once(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", 1 << 20)
    try:
        promise = spool.reserve(1 << 19)
        assert promise is not None
        await spool.add_async("s-1", body(0), None, reservation=promise)
        assert spool.reserved == 0 and spool.turns == 1
    finally:
        spool.close()


@pytest.mark.parametrize("text", [
    "1e15",  # written back as 1000000000000000.0: the widest a number grows
    "1e5",
    '"\\u00e9\\ud83d\\ude00"',  # escapes written back as UTF-8: shorter
], ids=["float-1e15", "float-1e5", "escapes"])
def test_a_turn_s_file_stays_within_the_bound_promised(tmp_path: Path, text: str) -> None:
    """The worst the gateway's re-encoding does: every value of the reply a number
    written in its shortest form, which the spool's JSON writes out in full."""
    request = json.dumps(chat([1, 2, 3], padding=[0.5] * 10)).encode()
    values = ",".join([text] * 20_000)
    reply_text = ('{"choices":[{"meta_info":{"output_token_logprobs":[[-0.5,7]]},'
                  f'"values":[{values}]}}]}}').encode()
    record = {"timestamp": 1.0, "request_timestamp": 0.5, "method": "POST",
              "path": "/v1/chat/completions", "status_code": 200,
              "request": json.loads(request), "response": json.loads(reply_text)}
    # The labels as a header would carry them, numbers at their shortest.
    header = "{" + ",".join([f'"{"k" * 60}":"{"v" * 4000}"',
                             *(f'"n{i}":1e15' for i in range(500))]) + "}"
    opening = {"session_id": "s-1", "labels": json.loads(header)}
    spool = Spool(tmp_path / "spool", 1 << 30)
    try:
        entry = spool.add("s-1", {"event_id": uuid.uuid4().hex, "record": record}, opening)
    finally:
        spool.close()
    assert entry.size <= turn_file_bound(len(request) + len(reply_text) + len(header))
    if text.startswith("1e"):
        assert entry.size > 2 * len(reply_text)  # the case the factor is for


# -- the gateway's answer ------------------------------------------------------------


class Sends:
    """An ASGI `send` that keeps the messages."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    def body(self) -> bytes:
        return b"".join(bytes(m["body"]) for m in self.messages
                        if m["type"] == "http.response.body")


def answering(outcome: str, seen: list[int], sends: Sends) -> Any:
    async def recording() -> str:
        await asyncio.sleep(0.05)
        seen.append(len(sends.messages))  # what had gone out while the turn was written
        return outcome
    return recording()


async def answer(tmp_path: Path, outcome: str, scope: dict[str, Any],
                 headers: tuple[tuple[bytes, bytes], ...] = ()
                 ) -> tuple[Sends, list[int], Any, Any]:
    spool = Spool(tmp_path / "spool", 1 << 30)
    promise = spool.reserve(1000)
    assert promise is not None
    gateway = SimpleNamespace(metrics=GatewayMetrics())
    sends, seen = Sends(), []
    raw = b'{"choices": [1, 2, 3]}'
    try:
        await Gateway._answer_while_recording(
            gateway, scope, sends, "s-1", 200, [(b"content-length", b"22"), *headers], raw,
            answering(outcome, seen, sends), promise, 0.0, 0.0)
    finally:
        assert spool.reserved == 0  # released whatever the outcome
        spool.close()
    return sends, seen, gateway.metrics, raw


@pytest.mark.parametrize(("raw", "headers", "held"), [
    (b'{"a": 1}', [], 1),
    (b'{"a": 1}\r\n \n', [], 5),  # a document is incomplete without its last bracket
    (b'{"a": 1}', [(b"content-encoding", b"identity")], 1),
    (b"\x1f\x8b compressed", [(b"Content-Encoding", b"gzip")], 13),  # all of it
    (b"  ", [], 2),
], ids=["json", "trailing-blank", "identity", "gzip", "blank"])
def test_what_waits_for_the_turn(raw: bytes, headers: list[Any], held: int) -> None:
    assert _held_back(raw, headers) == held


async def test_the_last_byte_goes_out_once_the_turn_is_durable(tmp_path: Path) -> None:
    sends, seen, metrics, raw = await answer(tmp_path, RECORDED, {})
    # While the turn was written: the head, and the body but its last byte.
    assert seen == [2]
    assert sends.messages[0] == {"type": "http.response.start", "status": 200,
                                 "headers": [(b"content-length", b"22")]}
    assert sends.messages[1]["more_body"] is True
    assert bytes(sends.messages[1]["body"]) == raw[:-1]
    assert sends.messages[2] == {"type": "http.response.body", "body": raw[-1:]}
    assert sends.body() == raw
    assert metrics.added._sum.get() > 0


async def test_an_encoded_reply_sends_only_its_head_while_the_turn_is_written(
        tmp_path: Path) -> None:
    sends, seen, _, raw = await answer(tmp_path, RECORDED, {},
                                       ((b"content-encoding", b"br"),))
    assert seen == [1]  # the head alone
    assert sends.messages[1] == {"type": "http.response.body", "body": memoryview(raw)}
    assert sends.body() == raw


async def test_a_turn_neither_stored_nor_spooled_is_never_completed(tmp_path: Path) -> None:
    cuts: list[Any] = []
    scope = {"extensions": {"turnlog.cut_connection": cuts.append}}
    sends, _, metrics, raw = await answer(tmp_path, SPOOL_FULL, scope)
    assert cuts == [scope]  # the connection cut under the incomplete reply
    assert sends.body() == raw[:-1]
    assert not any(m["type"] == "http.response.body" and not m.get("more_body")
                   for m in sends.messages)
    assert metrics.unrecorded.labels(SPOOL_FULL)._value.get() == 1


async def test_without_a_cut_the_request_ends_unanswered(tmp_path: Path) -> None:
    with pytest.raises(TurnNotKept):
        await answer(tmp_path, SPOOL_FULL, {})


# -- end to end ----------------------------------------------------------------------


async def test_a_caller_holds_all_but_the_last_byte_until_the_turn_commits(
        tmp_path: Path, gateway_process: Any, fake_sglang: Any) -> None:
    path = tmp_path / "store.db"
    gateway = gateway_process(f"sqlite:///{path}", "--store-timeout", "60")
    await gateway.wait_ready()
    session = f"gw-{uuid.uuid4().hex[:12]}"
    headers = {"content-type": "application/json", "X-SMG-Routing-Key": session}
    types = "SELECT type FROM events WHERE session_id = ? ORDER BY position"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        first = await http.post("/v1/chat/completions", json=chat([3, 1, 4]), headers=headers)
        assert first.status_code == 200
        output = [t for _, t in first.json()["choices"][0]["meta_info"]["output_token_logprobs"]]
        request = chat([3, 1, 4, *output, 5])
        with sqlite_lock(path) as lock:
            async with http.stream("POST", "/v1/chat/completions", json=request,
                                   headers=headers) as reply:
                assert reply.status_code == 200  # the head came while the store is locked
                length = int(reply.headers["content-length"])
                held = bytearray()

                async def read() -> None:
                    async for chunk in reply.aiter_raw():
                        held.extend(chunk)

                reading = asyncio.create_task(read())
                for _ in range(200):
                    if len(held) >= length - 1:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                assert len(held) == length - 1  # the last byte waits for the commit
                promised = metric(await scrape(http), "turnlog_gateway_spool_promised_bytes")
                before = [row[0] for row in lock.execute(types, (session,))]
                lock.execute("ROLLBACK")  # the lock goes: the turn commits
                await asyncio.wait_for(reading, 30)
        assert len(held) == length
        assert before == ["session_opened", "turn_recorded"]  # not the held turn
        page = await scrape(http)
        assert metric(page, "turnlog_gateway_recorded_total") == 2
        # Room was promised while the turn was written, and given back after.
        assert promised >= 5 * length
        assert metric(page, "turnlog_gateway_spool_promised_bytes") == 0
        # Straight from the upstream: the same bytes.
        straight = await http.post(f"{fake_sglang.url}/v1/chat/completions", json=request)
    with sqlite3.connect(path) as db:
        stored = [row[0] for row in db.execute(types, (session,))]
    assert stored == ["session_opened", "turn_recorded", "turn_recorded"]
    assert held == straight.content
