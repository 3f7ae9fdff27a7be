"""Big bodies must not stall everyone else (issue 13, item 7), on both backends.

A turn above `TURNLOG_OFFLOAD_BODY_BYTES`, or above
`TURNLOG_LARGE_BODY_BYTES` once its R3 payload is set aside (many values), is
parsed and encoded on a worker thread, never on the event loop; a turn that is
mostly its R3 payload stays on the loop, where it costs less. At most
`TURNLOG_MAX_LARGE_UPLOADS` turns above `TURNLOG_LARGE_BODY_BYTES` are in
flight at once. A large events page is streamed in batches and reads back
identical to the same events fetched in small pages. The latency figures are
in `bench/big_bodies.py`.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
import uuid
from typing import Any

import httpx
import numpy as np
import pytest

import app.store.append.writes as writes
from app.domain.wire import msgpackio
from app.main import create_app
from tests.factory import open_body, turn
from turnlog_client.async_client import _encode_turn

R3_LAYERS, R3_TOPK = 2, 256  # a 3-row turn's R3: 6 KB of int32, 8 KB of base64


def large_turn(with_r3: bool) -> dict:
    """A body above the test's 2000-byte large-body threshold: 2,000 token ids, or a
    3-token turn whose R3 payload is nearly all of it."""
    if not with_r3:
        return turn(list(range(1, 2001)), [7])
    rows = np.arange(3 * R3_LAYERS * R3_TOPK, dtype="<i4") % 128
    return turn([1, 2, 3], [7], r3=base64.b64encode(rows.tobytes()).decode())


@pytest.mark.parametrize(("offload_body_bytes", "with_r3", "on_loop"), [
    (2000, True, False),  # above the offload size: a worker thread
    (16 << 20, False, False),  # many values: the loop would wait on them, so a thread
    (16 << 20, True, True),  # the R3 payload is one value: on the loop
], ids=["offloaded", "many-values", "r3-payload"])
@pytest.mark.parametrize("wire", ["json", "msgpack"])
async def test_large_turns_are_parsed_a_few_at_a_time(settings, monkeypatch, offload_body_bytes,
                                                     with_r3, on_loop, wire):
    app = create_app(settings.replace(large_body_bytes=2000, max_large_uploads=1,
                                      offload_body_bytes=offload_body_bytes))
    loop_thread = threading.get_ident()
    lock = threading.Lock()
    seen: list[tuple[int, bool]] = []  # (thread, a large turn?) per parse
    active = [0, 0]  # now, max
    real = writes.parse_turn

    def parse(raw, spec, *args):
        with lock:
            active[0] += 1
            active[1] = max(active[1], active[0])
        try:
            time.sleep(0.05)  # long enough for the other uploads to catch up
            return real(raw, spec, *args)
        finally:
            with lock:
                active[0] -= 1
            seen.append((threading.get_ident(), len(raw["record"]["request"]["input_ids"]) != 2))

    def post(session: str, body: dict) -> Any:
        if wire == "json":
            return http.post(f"/v1/sessions/{session}/turns", json=body)
        packed, kind = _encode_turn(body, "msgpack")
        return http.post(f"/v1/sessions/{session}/turns", content=packed,
                         headers={"content-type": kind})

    monkeypatch.setattr(writes, "parse_turn", parse)
    real_layout, laid_out = msgpackio.layout, []

    def layout(raw):
        laid_out.append(threading.get_ident())
        return real_layout(raw)

    monkeypatch.setattr(msgpackio, "layout", layout)
    base = f"big-{uuid.uuid4().hex[:8]}"
    opened = {"r3": {"num_layers": R3_LAYERS}} if with_r3 else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        for i in range(3):
            assert (await http.post("/v1/sessions",
                                    json=open_body(f"{base}-{i}", **opened))).is_success
        replies = await asyncio.gather(*(post(f"{base}-{i}", large_turn(with_r3))
                                         for i in range(3)))
        assert [r.status_code for r in replies] == [201, 201, 201], [r.text for r in replies]
        small = await http.post(f"/v1/sessions/{base}-0/turns",
                                json=turn([1, 2], [9], parent=None))
        assert small.status_code == 201, small.text
    big = [thread for thread, large in seen if large]
    assert len(big) == 3
    if on_loop:
        assert set(big) == {loop_thread}, "a turn the loop should take left it"
    else:
        assert loop_thread not in big, "a turn for a worker thread was parsed on the loop"
    if wire == "msgpack" and offload_body_bytes < 16 << 20:
        # Above the offload size not even the typed pass runs on the loop.
        assert laid_out and loop_thread not in laid_out
    assert [thread for thread, large in seen if not large] == [loop_thread]
    assert active[1] == 1, f"{active[1]} large uploads at once with a cap of 1"
    await app.state.services.db.dispose()


async def test_a_large_events_page_is_streamed_and_equals_small_pages(client, sid):
    assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 201
    prompt = [1, 2]
    for i in range(80):
        r = await client.post(f"/v1/sessions/{sid}/turns", json=turn(prompt, [100 + i]))
        assert r.status_code == 201, r.text
        prompt = [*prompt, 100 + i, 5]
    whole = await client.get(f"/v1/sessions/{sid}/events", params={"limit": 100_000})
    assert whole.status_code == 200
    assert "content-length" not in whole.headers, "a large page was built whole in memory"
    assert whole.headers["content-type"].startswith("application/json")
    pages: list[dict] = []
    after = None
    while True:
        params = {"limit": 7, **({} if after is None else {"after": after})}
        page = (await client.get(f"/v1/sessions/{sid}/events", params=params)).json()
        if not page:
            break
        pages += page
        after = page[-1]["position"]
    assert whole.json() == pages and len(pages) == 81
    small = await client.get(f"/v1/sessions/{sid}/events", params={"limit": 3})
    assert small.headers["content-length"] == str(len(small.content))
