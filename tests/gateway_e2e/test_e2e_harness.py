"""The harness on its own, without the gateway: the fake SGLang over HTTP and the
session-server-like driver.

A real fake-SGLang process answers like SGLang (R3 rows are a full forward's,
the same request gives the same bytes, streaming and the router's routes
work), and the driver's oracle of the samples agrees with the store when its
records are appended as a session server would append them — so a gateway test
that fails points at the gateway, not at the harness.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from turnlog_client import TurnlogClient
from tests.gateway_e2e.checks import Router, check_reply_r3, check_samples, open_body
from tests.gateway_e2e.scenarios import MODES, TOOLS, play
from tests.gateway_e2e.session_driver import SessionDriver

ROUTER = Router()


@pytest.fixture
async def upstream(fake_sglang: Any) -> Any:
    return await fake_sglang()


@pytest.mark.parametrize(("version", "addition"), MODES)
async def test_replies_carry_a_full_forward_and_repeat_byte_for_byte(
        upstream: Any, version: str, addition: bool, sid: str) -> None:
    async with httpx.AsyncClient(base_url=upstream.base_url, timeout=30) as http:
        driver = SessionDriver(http, sid, version=version, addition=addition)
        await play(driver)
        check_reply_r3(driver, ROUTER)
        for exchange in driver.wire[:3]:
            again = await http.post("/v1/chat/completions", json=exchange.request)
            assert again.content == exchange.content


async def test_streaming_and_router_routes(upstream: Any, sid: str) -> None:
    async with httpx.AsyncClient(base_url=upstream.base_url, timeout=30) as http:
        driver = SessionDriver(http, sid)
        _, body = driver.build_request([{"role": "user", "content": "hi"}], TOOLS, {})
        async with http.stream("POST", "/v1/chat/completions",
                               json={**body, "stream": True}) as reply:
            assert reply.headers["content-type"].startswith("text/event-stream")
            assert "content-length" not in reply.headers
            chunks = [chunk async for chunk in reply.aiter_bytes()]
        events = b"".join(chunks).split(b"\n\n")
        assert events[-2] == b"data: [DONE]"
        assert (await http.get("/health")).status_code == 200
        echoed = (await http.post("/add_worker", params={"url": "http://e1:3"})).json()
        assert (echoed["method"], echoed["path"], echoed["query"]) == \
            ("POST", "/add_worker", "url=http%3A%2F%2Fe1%3A3")
        assert (await http.get("/metrics")).status_code == 200
        failed = await http.post("/v1/chat/completions", json=body,
                                 headers={"X-Sim-Status": "503"})
        assert failed.status_code == 503


@pytest.mark.parametrize(("version", "addition"), MODES)
async def test_oracle_agrees_with_the_store(upstream: Any, store: TurnlogClient,
                                            version: str, addition: bool, sid: str) -> None:
    """The driver's records appended as a session server would (parent derived)
    give the samples the driver predicts, with R3 equal to a full forward."""
    async with httpx.AsyncClient(base_url=upstream.base_url, timeout=30) as http:
        driver = SessionDriver(http, sid, version=version, addition=addition)
        await play(driver)
    await store.open(open_body(driver, ROUTER))
    for node in driver.nodes:
        now = time.time()
        record = {**node.record, "timestamp": now, "request_timestamp": now - 0.1}
        node.record = json.loads(json.dumps(record))
        reply = await store.append(sid, node.record)
        assert (reply["seq"], reply["parent"]) == (node.seq, node.parent)
    await check_samples(store, driver, ROUTER)
