"""The recording gateway end to end: real processes on loopback ports.

fake SGLang (`python -m app.sim.sglang_http`) ← `turnlog gateway` (the real CLI,
a subprocess) ← the session-server-like driver, on each store backend. The
driver plays v1 and v2 sessions in addition and full R3 mode with retries,
rollbacks and tool calls; then the stored turns must equal what went over the
wire (the request as forwarded, the response as received), the samples after
a close must equal the driver's oracle and a fold of those records, and every
sample's R3 must equal a full forward of the causal router over its tokens.
The caller's reply bytes through the gateway equal a direct call's.

These tests need `turnlog gateway`: if the command is missing or does not
come up, they fail (never a skip).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from typing import Any

import httpx
import pytest

from tests.gateway_e2e.checks import (
    Router,
    check_recorded,
    check_reply_r3,
    check_samples,
    open_body,
)
from tests.gateway_e2e.conftest import TURNLOG
from tests.gateway_e2e.scenarios import MODES, TOOLS, play, play_v2
from tests.gateway_e2e.session_driver import ROUTING_HEADER, SessionDriver
from turnlog_client import TurnlogClient
from turnlog_client.errors import TurnlogError

ROUTER = Router()
# Headers a proxy may legitimately change (hop-by-hop ones, and the three the
# gateway may add); every other header must be the upstream's.
HOP_OR_ADDED = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                "proxy-authenticate", "proxy-authorization", "date", "server",
                "x-forwarded-for"}


def gateway_options(version: str, addition: bool, *extra: str) -> list[str]:
    return ["--version", version,
            "--pause-generation-mode", "in_place" if addition else "retract",
            "--num-layers", str(ROUTER.num_layers), "--speculative", *extra]


def end_to_end_headers(headers: httpx.Headers) -> list[tuple[str, str]]:
    return sorted((k.lower(), v) for k, v in headers.multi_items()
                  if k.lower() not in HOP_OR_ADDED)


async def turns_stored(store: TurnlogClient, sid: str) -> int | None:
    """How many turns the store holds for `sid` (None: no such session)."""
    try:
        events = await store.all_events(sid)
    except TurnlogError as exc:
        if exc.slug == "unknown-session":
            return None
        raise
    return sum(event["type"] == "turn_recorded" for event in events)


def test_the_gateway_command_exists() -> None:
    """`turnlog gateway --help` works: the e2e tests below never skip for want of it."""
    # Wide enough that rich does not elide long option names.
    done = subprocess.run([str(TURNLOG), "gateway", "--help"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})
    assert done.returncode == 0, done.stderr
    for option in ("--upstream", "--database-url", "--num-layers", "--version",
                   "--pause-generation-mode"):
        assert option in done.stdout, option


@pytest.mark.parametrize(("version", "addition"), MODES)
async def test_sessions_through_the_gateway_are_stored_as_sent(
        fake_sglang: Any, gateway: Any, store: TurnlogClient, version: str, addition: bool,
        sid: str) -> None:
    upstream = await fake_sglang()
    proxy = await gateway(upstream.base_url, *gateway_options(version, addition))
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=60) as http:
        driver = SessionDriver(http, sid, version=version, addition=addition)
        await play(driver)
    check_reply_r3(driver, ROUTER)
    events = await check_recorded(store, driver)
    session = events[0]["session"]
    assert session["opened_by"] == "gateway"
    assert session["version"] == version
    assert session["pause_generation_mode"] == ("in_place" if addition else "retract")
    assert session["r3"] == {"num_layers": ROUTER.num_layers}
    await check_samples(store, driver, ROUTER)


async def test_concurrent_sessions_keep_their_own_order(
        fake_sglang: Any, gateway: Any, store: TurnlogClient, sid: str) -> None:
    upstream = await fake_sglang()
    proxy = await gateway(upstream.base_url, *gateway_options("v2", True))
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=60) as http:
        drivers = [SessionDriver(http, f"{sid}-{i}", version="v2", addition=True)
                   for i in range(4)]
        await asyncio.gather(*(play_v2(driver) for driver in drivers))
    for driver in drivers:
        await check_samples(store, driver, ROUTER)


async def test_a_session_opened_beforehand_keeps_its_own_open(
        fake_sglang: Any, gateway: Any, store: TurnlogClient, sid: str) -> None:
    """A §1 open with labels wins over the gateway's defaults; an auto-opened
    session takes `--label` plus the caller's `X-Turnlog-Labels` (header wins)."""
    upstream = await fake_sglang()
    proxy = await gateway(upstream.base_url, *gateway_options("v1", False),
                          "--label", "model=fake", "--label", "run_id=cli")
    async with httpx.AsyncClient(base_url=proxy.base_url, timeout=60) as http:
        own = SessionDriver(http, sid, version="v2", addition=True)
        await store.open(open_body(own, ROUTER, labels={"run_id": "mine"}))
        await play(own)
        auto = SessionDriver(http, f"{sid}-auto", version="v1",
                             extra_headers={"X-Turnlog-Labels": '{"run_id": "r9", "n": 3}'})
        await play(auto)
    events = await check_recorded(store, own)
    assert events[0]["session"]["labels"] == {"run_id": "mine"}
    assert "opened_by" not in events[0]["session"] or \
        events[0]["session"]["opened_by"] != "gateway"
    await check_samples(store, own, ROUTER)
    events = await check_recorded(store, auto)
    assert events[0]["session"]["labels"] == {"model": "fake", "run_id": "r9", "n": 3}
    await check_samples(store, auto, ROUTER)


async def test_reply_bytes_equal_a_direct_call(
        fake_sglang: Any, gateway: Any, store: TurnlogClient, sid: str) -> None:
    """Recorded turn, unrecorded turn, streamed turn, an upstream error and the
    router's own routes: through the gateway the caller gets the upstream's
    status, end-to-end headers and bytes. Only the recorded turn is stored."""
    upstream = await fake_sglang()
    proxy = await gateway(upstream.base_url, *gateway_options("v2", True))
    driver = SessionDriver(None, sid, version="v2", addition=True)
    _, body = driver.build_request([{"role": "user", "content": "same seed twice"}], TOOLS,
                                   {"seed": 11})
    encoded = json.dumps(body).encode()
    calls: list[tuple[str, str, dict[str, str], bytes | None]] = [
        ("recorded", "/v1/chat/completions", {ROUTING_HEADER: sid}, encoded),
        ("no-session", "/v1/chat/completions", {}, encoded),
        ("stream", "/v1/chat/completions", {ROUTING_HEADER: f"{sid}-stream"},
         json.dumps({**body, "stream": True}).encode()),
        ("upstream-status", "/v1/chat/completions",
         {ROUTING_HEADER: f"{sid}-error", "X-Sim-Status": "500"}, encoded),
        ("health", "/health", {}, None),
        ("workers", "/workers", {}, None),
    ]
    async with httpx.AsyncClient(timeout=60) as http:
        for name, path, headers, content in calls:
            replies = []
            for base in (upstream.base_url, proxy.base_url):
                method = "GET" if content is None else "POST"
                replies.append(await http.request(
                    method, base + path, content=content,
                    headers={"content-type": "application/json", **headers}))
            direct, through = replies
            assert through.status_code == direct.status_code, name
            assert through.content == direct.content, name
            assert end_to_end_headers(through.headers) == end_to_end_headers(direct.headers), \
                name
        # The fake echoes routes it does not serve: what the engine's router got.
        generate = json.dumps({"input_ids": [3, 4, 5], "sampling_params": {}}).encode()
        for path, params, content in (("/add_worker", {"url": "http://engine-1:30000"}, b""),
                                      ("/generate", {}, generate)):
            echoed = (await http.post(proxy.base_url + path, params=params, content=content,
                                      headers={"content-type": "application/json",
                                               "x-caller": "miles"})).json()
            assert (echoed["method"], echoed["path"]) == ("POST", path)
            assert echoed["body"] == content.decode()
            if params:
                assert echoed["query"] == "url=http%3A%2F%2Fengine-1%3A30000"
            headers = {name.lower(): value for name, value in echoed["headers"]}
            assert headers["x-caller"] == "miles"
            assert headers["host"] == upstream.base_url.removeprefix("http://")
    assert await turns_stored(store, sid) == 1
    for other in (f"{sid}-stream", f"{sid}-error"):
        assert await turns_stored(store, other) is None, other
    events = await store.all_events(sid)
    assert json.loads(encoded) == events[1]["record"]["request"]


async def test_a_rejected_turn_is_still_answered(
        fake_sglang: Any, gateway: Any, store: TurnlogClient, sid: str) -> None:
    """Without `--num-layers` a turn asking for R3 cannot be stored: the caller
    still gets the upstream's reply, the turn is counted `rejected`."""
    upstream = await fake_sglang()
    proxy = await gateway(upstream.base_url, "--version", "v2")
    _, body = SessionDriver(None, sid).build_request([{"role": "user", "content": "r3 please"}],
                                                     None, {})
    async with httpx.AsyncClient(timeout=60) as http:
        headers = {"content-type": "application/json", ROUTING_HEADER: sid}
        direct = await http.post(upstream.base_url + "/v1/chat/completions",
                                 content=json.dumps(body).encode(), headers=headers)
        through = await http.post(proxy.base_url + "/v1/chat/completions",
                                  content=json.dumps(body).encode(), headers=headers)
        assert through.status_code == 200
        assert through.content == direct.content
        metrics = (await http.get(proxy.base_url + "/turnlog/metrics")).text
    assert await turns_stored(store, sid) in (None, 0)
    rejected = [line for line in metrics.splitlines()
                if line.startswith("turnlog_gateway_unrecorded_total")
                and 'reason="rejected"' in line]
    assert rejected and float(rejected[0].split()[-1]) >= 1, metrics
