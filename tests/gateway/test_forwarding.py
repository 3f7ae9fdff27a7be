"""What the gateway forwards untouched: every route, hop-by-hop headers dropped, streamed
replies streamed, and an upstream that is down or slow answered 502.

These tests do not depend on the store's backend (they record nothing), so they
run on one SQLite file; those that only forward share one gateway.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import chat, metric, python_server, scrape, send_turn
from tests.serverproc import ServerProcess, free_port


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'gateway.db'}"


@pytest.fixture(scope="module")
def forwarder(fake_sglang: ServerProcess,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One gateway, ready, for the tests that only send passthrough routes (nothing is
    recorded, nothing restarted, no test reads a counter another one moves)."""
    home = tmp_path_factory.mktemp("forwarder")
    argv = ["-m", "app", "gateway", "--upstream", fake_sglang.url,
            "--database-url", _sqlite(home), "--spool-dir", str(home / "spool")]
    with python_server(argv, home / "gateway.log", "/turnlog/healthz") as gateway:
        gateway.wait_ready_sync()
        yield gateway


async def test_other_routes_pass_through_intact(forwarder, fake_sglang):
    gateway = forwarder
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http, \
            httpx.AsyncClient(base_url=fake_sglang.url, timeout=30) as direct:
        body = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 3}}).encode()
        for method, path in (("POST", "/generate?rid=7&x=%20a%2Fb"),
                             ("POST", "/add_worker?url=http%3A%2F%2F127.0.0.1%3A1"),
                             ("PUT", "/some/other/route"), ("DELETE", "/workers/3")):
            reply = await http.request(method, path, content=body,
                                       headers={"X-Custom": "v1", "Authorization": "Bearer t",
                                                "Content-Type": "application/json"})
            assert reply.status_code == 200, reply.text
            echo = reply.json()
            assert echo["method"] == method
            assert echo["path"] + ("?" + echo["query"] if echo["query"] else "") == path
            assert echo["body"] == body.decode()
            headers = dict(echo["headers"])
            assert headers["x-custom"] == "v1" and headers["authorization"] == "Bearer t"
            assert headers["host"] == f"127.0.0.1:{fake_sglang.port}"
            assert headers["content-length"] == str(len(body))
            assert headers["x-forwarded-for"] == "127.0.0.1"
        health = await http.get("/health")
        assert (health.status_code, health.content) == (200, b"OK")
        up = await http.get("/metrics")
        assert up.status_code == 200 and up.text.startswith("sglang_num_requests_total")
        assert up.headers["content-type"] == (await direct.get("/metrics")).headers[
            "content-type"]
        # The gateway's own routes never reach the upstream.
        assert (await http.get("/turnlog/healthz")).json() == {"status": "ok"}
        assert (await http.get("/turnlog/readyz")).status_code == 200
        assert "turnlog_gateway_recorded_total" in (await scrape(http))
        assert (await http.get("/turnlog/nope")).status_code == 404
        # Passthrough routes are not counted as unrecorded turns.
        assert metric(await scrape(http), "turnlog_gateway_unrecorded_total",
                      'reason="no-session"') == 0


def raw_request(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks)


async def test_hop_by_hop_headers_are_dropped(forwarder):
    gateway = forwarder
    body = b"0123456789"
    request = (b"POST /generate HTTP/1.1\r\nHost: localhost\r\n"
               b"Connection: close, X-Per-Hop\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n"
               b"Trailer: X-Sum\r\nProxy-Authorization: Basic eA==\r\nProxy-Foo: bar\r\n"
               b"X-Per-Hop: 1\r\nX-End-To-End: kept\r\nContent-Length: 10\r\n\r\n" + body)
    reply = raw_request(gateway.port, request)
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    echo = json.loads(payload)
    names = {name for name, _ in echo["headers"]}
    # X-Per-Hop is named by the Connection header: hop-by-hop too (RFC 9110 §7.6.1).
    assert not names & {"connection", "keep-alive", "te", "trailer", "proxy-authorization",
                        "proxy-foo", "transfer-encoding", "x-per-hop"}, names
    assert dict(echo["headers"])["x-end-to-end"] == "kept"
    assert echo["body"] == body.decode()

    # A chunked request body goes up whole (the upstream sees no Transfer-Encoding of ours).
    chunked = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    head, _, payload = raw_request(gateway.port, chunked).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert json.loads(payload)["body"] == "hello world"


@pytest.mark.parametrize("method", ["POST", "DELETE", "PUT", "PATCH", "PROPFIND"])
async def test_a_request_sent_without_a_body_goes_up_without_one(forwarder, method):
    """A review's finding: a POST sent with no body and no `Content-Length` (curl's
    `-X POST`, an engine registering at `/add_worker`) reached the upstream with a
    `Content-Length: 0` the caller never sent (aiohttp adds it). The gateway adds only
    `X-Forwarded-For` (and `Host` is the upstream's)."""
    request = (f"{method} /add_worker?url=http%3A%2F%2F127.0.0.1%3A1 HTTP/1.1\r\n"
               "Host: localhost\r\nConnection: close\r\nX-A: 1\r\n\r\n").encode()
    head, _, payload = raw_request(forwarder.port, request).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    echo = json.loads(payload)
    assert (echo["method"], echo["body"]) == (method, "")
    assert sorted(name for name, _ in echo["headers"]) == ["host", "x-a", "x-forwarded-for"]
    # One sent with `Content-Length: 0` keeps it, as sent.
    sent = request.replace(b"X-A: 1\r\n", b"X-A: 1\r\nContent-Length: 0\r\n")
    echo = json.loads(raw_request(forwarder.port, sent).partition(b"\r\n\r\n")[2])
    assert dict(echo["headers"])["content-length"] == "0"


async def test_a_browser_page_elsewhere_is_refused(forwarder):
    """A tester's findings: the gateway served any `Host` (a page's own name resolved to
    127.0.0.1 — DNS rebinding — recorded turns with its labels and read the upstream's
    routes) and any `Origin` (a page of another site closed sessions with an untyped
    body). On a loopback bind it answers as the store does without tokens: 421."""
    port = forwarder.port
    rebound = raw_request(port, b"GET /v1/models HTTP/1.1\r\nHost: evil.example:%d\r\n"
                                b"Connection: close\r\n\r\n" % port)
    assert rebound.startswith(b"HTTP/1.1 421"), rebound[:200]
    assert b'"field":"Host"' in rebound
    close = b'{"metadata": {"reward": -5}}'
    for origin in (b"http://evil.example", b"http://127.0.0.1:3000"):
        forged = raw_request(port, b"POST /turnlog/v1/sessions/s-csrf/close HTTP/1.1\r\n"
                                   b"Host: 127.0.0.1:%d\r\nOrigin: %s\r\nConnection: close\r\n"
                                   b"Content-Length: %d\r\n\r\n%s" % (port, origin, len(close),
                                                                      close))
        assert forged.startswith(b"HTTP/1.1 421"), forged[:200]
        assert b'"field":"Origin"' in forged
    # Its own origin, and no Origin at all (a script), are served.
    own = raw_request(port, b"GET /turnlog/healthz HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                            b"Origin: http://127.0.0.1:%d\r\nConnection: close\r\n\r\n"
                      % (port, port))
    assert own.startswith(b"HTTP/1.1 200"), own[:200]


async def test_trailer_fields_are_never_taken_for_headers(forwarder):
    """A tester's finding: a chunked body's trailer fields were appended to the request's
    headers, so a trailer could name the session recorded and forge X-Forwarded-For,
    depending on how TCP split the request (RFC 9112 §7.1.2: never merged)."""
    request = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
               b"X-SMG-Routing-Key: s-header\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\nhello\r\n0\r\nX-SMG-Routing-Key: s-trailer\r\n"
               b"X-Forwarded-For: 6.6.6.6\r\nAuthorization: Bearer forged\r\n\r\n")
    head, _, payload = raw_request(forwarder.port, request).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    echo = json.loads(payload)
    assert [v for k, v in echo["headers"] if k == "x-smg-routing-key"] == ["s-header"]
    assert dict(echo["headers"])["x-forwarded-for"] == "127.0.0.1"
    assert "authorization" not in dict(echo["headers"])
    assert echo["body"] == "hello"


async def test_a_utf8_header_value_goes_up_as_it_came(forwarder, fake_sglang):
    """A tester's finding: header values went up decoded as latin-1 and re-encoded as
    UTF-8 by the HTTP client, so a routing key `s-é` reached the router as another key."""
    request = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
               b"X-SMG-Routing-Key: s-caf\xc3\xa9\r\nContent-Length: 2\r\n\r\nhi")
    echoes = [json.loads(raw_request(port, request).partition(b"\r\n\r\n")[2])
              for port in (fake_sglang.port, forwarder.port)]
    straight, via = (dict(echo["headers"])["x-smg-routing-key"] for echo in echoes)
    assert via == straight == b"s-caf\xc3\xa9".decode("latin-1")


async def test_an_http10_caller_gets_a_held_chunked_reply_with_its_length(forwarder):
    """A tester's finding: a turn's reply that came chunked went back chunked to an
    HTTP/1.0 caller, which read the chunk sizes as part of the JSON (RFC 9112 §6.1)."""
    body = json.dumps(chat([1, 2, 3])).encode()
    request = (b"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1\r\n"
               b"Content-Type: application/json\r\nX-SMG-Routing-Key: s-http10\r\n"
               b"X-Sim-Chunks: 2\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    head, _, payload = raw_request(forwarder.port, request).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    lines = head.lower().split(b"\r\n")
    assert not any(line.startswith(b"transfer-encoding") for line in lines), head
    (length,) = [int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length")]
    assert length == len(payload) and payload == b"chunk 0\nchunk 1\n"  # the fake's chunks


async def test_a_chunked_streaming_reply_stays_streamed(forwarder):
    gateway = forwarder
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http, \
            http.stream("GET", "/stream?chunks=4&size=1000&delay=0.3") as reply:
        assert reply.status_code == 200
        assert reply.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in reply.headers
        arrivals, data = [], b""
        async for chunk in reply.aiter_raw():
            arrivals.append(time.monotonic())
            data += chunk
    assert data == b"".join(bytes([65 + i]) * 1000 for i in range(4))
    # Chunks arrived as the upstream sent them, not all at once at the end.
    assert len(arrivals) >= 2 and arrivals[-1] - arrivals[0] > 0.3


@pytest.mark.parametrize(("status", "content_type", "reason"), [
    ("503", "application/json", "upstream-status"),
    ("200", "text/event-stream", "not-json"),
])
async def test_a_turn_whose_reply_cannot_be_recorded_is_streamed(forwarder, status,
                                                                  content_type, reason):
    """A turn-shaped request whose reply completes no turn whatever its body (not 200,
    an event stream) gets that reply as it comes, not held until its end."""
    gateway = forwarder
    sid = f"s-stream-{reason}"
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        before = metric(await scrape(http), "turnlog_gateway_unrecorded_total",
                        f'reason="{reason}"')
        headers = {"X-SMG-Routing-Key": sid, "X-Sim-Chunks": "4", "X-Sim-Status": status,
                   "X-Sim-Content-Type": content_type}
        async with http.stream("POST", "/v1/chat/completions", json=chat([1, 2, 3]),
                               headers=headers) as reply:
            assert reply.status_code == int(status)
            assert reply.headers["content-type"] == content_type
            assert "content-length" not in reply.headers
            arrivals, data = [], b""
            async for chunk in reply.aiter_raw():
                arrivals.append(time.monotonic())
                data += chunk
        assert data == b"".join(f"chunk {i}\n".encode() for i in range(4))
        # The first chunk came while the upstream was still sending (0.3 s apart).
        assert len(arrivals) >= 2 and arrivals[-1] - arrivals[0] > 0.3
        after = metric(await scrape(http), "turnlog_gateway_unrecorded_total",
                       f'reason="{reason}"')
        assert after == before + 1
        assert (await http.get("/turnlog/healthz")).status_code == 200


async def test_a_chunked_turn_reply_held_to_be_judged_stays_chunked(forwarder, fake_sglang):
    """A 200 JSON reply to a turn is held whole (only its end says whether it is a turn);
    one that came chunked goes back chunked, not re-framed with a Content-Length."""
    headers = {"X-SMG-Routing-Key": "s-chunked-json", "X-Sim-Chunks": "2"}
    replies = []
    for base in (fake_sglang.url, forwarder.url):
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            replies.append(await http.post("/v1/chat/completions", json=chat([1, 2, 3]),
                                           headers=headers))
    straight, via = replies
    assert straight.headers.get("transfer-encoding") == "chunked"
    assert via.status_code == 200 and via.content == straight.content
    assert via.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in via.headers


async def test_an_upstream_that_is_down_or_slow_is_a_502(tmp_path, gateway_process):
    closed_port = free_port()  # nothing listens there
    # Credentials in the upstream's URL are never shown to callers (a 502 showed them).
    down = gateway_process(_sqlite(tmp_path),
                           upstream=f"http://user:hunter2@127.0.0.1:{closed_port}")
    await down.wait_ready()
    async with httpx.AsyncClient(base_url=down.url, timeout=30) as http:
        for reply in (await http.post("/generate", content=b"x"),
                      await http.get("/health"),
                      (await http.post("/v1/chat/completions", json=chat([1, 2]),
                                       headers={"X-SMG-Routing-Key": "s-502"}))):
            assert reply.status_code == 502, reply.text
            assert reply.headers["content-type"] == "application/problem+json"
            problem = reply.json()
            assert problem["type"] == "urn:turnlog:upstream-unavailable"
            assert problem["status"] == 502
            assert "hunter2" not in reply.text and "user:" not in reply.text, reply.text
        # The turn-shaped request (a recorded path, a session) is counted; the others
        # are passthrough, not counted there.
        metrics = await scrape(http)
        assert metric(metrics, "turnlog_gateway_unrecorded_total",
                      'reason="upstream-unavailable"') == 1
    slow = gateway_process(_sqlite(tmp_path), "--upstream-timeout", "0.5")
    await slow.wait_ready()
    async with httpx.AsyncClient(base_url=slow.url, timeout=30) as http:
        turn = await send_turn(http, "s-slow", chat([1, 2]), {"X-Sim-Delay": "3"})
        assert turn.status == 502
        assert json.loads(turn.reply)["type"] == "urn:turnlog:upstream-unavailable"
        assert metric(await scrape(http), "turnlog_gateway_unrecorded_total",
                      'reason="upstream-unavailable"') == 1


def _option(process: ServerProcess, name: str) -> str:
    return process.argv[process.argv.index(name) + 1]


async def test_a_second_gateway_on_the_same_spool_is_refused(forwarder, fake_sglang):
    # The first gateway is the running forwarder: a second one on its spool is refused.
    spool, database = _option(forwarder, "--spool-dir"), _option(forwarder, "--database-url")
    second = subprocess.run(
        [sys.executable, "-m", "app", "gateway", "--upstream", fake_sglang.url,
         "--port", str(free_port()), "--database-url", database,
         "--spool-dir", spool], capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("TURNLOG_")})
    assert second.returncode == 2, second.stderr
    assert "in use by another gateway" in second.stderr
    assert (second.stderr.count("\n") <= 2), second.stderr  # one line, no traceback


async def test_a_caller_that_goes_away_stops_the_relay(forwarder, fake_sglang):
    gateway = forwarder

    async def abandoned() -> float:
        async with httpx.AsyncClient(base_url=fake_sglang.url) as direct:
            return metric((await direct.get("/metrics")).text, "sim_streams_abandoned_total")

    before = await abandoned()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http, \
            http.stream("GET", "/stream?chunks=200&size=1000&delay=0.05") as reply:
        async for _chunk in reply.aiter_raw():
            break  # the first chunk, then hang up
    deadline = time.monotonic() + 20
    while "caller went away mid-reply" not in gateway.log_tail(200):
        assert time.monotonic() < deadline, gateway.log_tail()
        await asyncio.sleep(0.1)
    # The gateway closed its upstream connection too: the upstream stopped streaming
    # long before its 200 chunks (10 s) were out.
    while await abandoned() == before:
        assert time.monotonic() < deadline, "the upstream never saw the caller go"
        await asyncio.sleep(0.1)
    async with httpx.AsyncClient(base_url=gateway.url) as http:  # it goes on serving
        assert (await http.get("/health")).status_code == 200


async def test_x_forwarded_for_gets_the_peer_added_never_taken_as_the_peer(forwarder):
    async with httpx.AsyncClient(base_url=forwarder.url, timeout=30) as http:
        reply = await http.post("/generate", content=b"x",
                                headers={"X-Forwarded-For": "1.2.3.4"})
    assert dict(reply.json()["headers"])["x-forwarded-for"] == "1.2.3.4, 127.0.0.1"


async def test_a_path_goes_up_as_sent_and_only_the_recorded_path_is_a_turn(forwarder):
    """Dot segments and escapes are the upstream's to read: forwarded as they came,
    and never taken for the recorded path (the upstream may not read them so)."""
    async with httpx.AsyncClient(base_url=forwarder.url, timeout=30) as http:
        before = await scrape(http)
        for target in (b"/a/../v1/chat/completions", b"/./v1/chat/completions",
                       b"/v1/chat%2Fcompletions", b"/v1//chat/completions"):
            request = (b"POST " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                       b"X-SMG-Routing-Key: s-dots\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 2\r\n\r\n{}")
            head, _, payload = raw_request(forwarder.port, request).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            assert json.loads(payload)["path"] == target.decode()  # the echo: as received
        after = await scrape(http)
    for name, labels in (("turnlog_gateway_recorded_total", ""),
                         ("turnlog_gateway_unrecorded_total", 'reason="no-session"'),
                         ("turnlog_gateway_unrecorded_total", 'reason="not-tito"')):
        assert metric(after, name, labels) == metric(before, name, labels)


async def test_own_routes_answer_get_and_head_only(forwarder):
    async with httpx.AsyncClient(base_url=forwarder.url, timeout=30) as http:
        for route in ("/turnlog/healthz", "/turnlog/readyz", "/turnlog/metrics",
                      "/turnlog/sessions/s-1"):
            assert (await http.head(route)).status_code == 200
            for method in ("POST", "PUT", "DELETE", "OPTIONS"):
                reply = await http.request(method, route, content=b"{}")
                assert reply.status_code == 405, (method, route, reply.text)
                assert reply.headers["content-type"] == "application/problem+json"
                assert reply.headers["allow"] == "GET, HEAD"
                problem = reply.json()
                assert (problem["field"], problem["actual"]) == ("method", method)
        # An escaped own route is not one: it is the upstream's (here, its echo).
        assert (await http.get("/turnlog%2Fhealthz")).json()["path"] == "/turnlog%2Fhealthz"


async def test_a_session_route_says_how_many_spooled_turns_the_gateway_holds(forwarder):
    """`GET /turnlog/sessions/{sid}`: what a client closing the session asks first
    (the miles hook); none here, the store being up. The id is read percent-decoded."""
    async with httpx.AsyncClient(base_url=forwarder.url, timeout=30) as http:
        for raw, sid in (("s-1", "s-1"), ("%2E%2E", ".."), ("a%3Ab", "a:b")):
            reply = await http.get(f"/turnlog/sessions/{raw}")
            assert reply.status_code == 200, reply.text
            assert reply.json() == {"session_id": sid, "spooled_turns": 0,
                                   "spooled_writes": 0}
        for missing in ("/turnlog/sessions/a/b", "/turnlog/sessions/"):
            reply = await http.get(missing)
            assert reply.status_code == 404, reply.text
        # A tester's finding: an id no session can have was answered as one with nothing
        # spooled.
        for bad in ("bad%20id", "x" * 129, "%C3%A9"):
            reply = await http.get(f"/turnlog/sessions/{bad}")
            assert reply.status_code == 422, reply.text
            assert reply.headers["content-type"] == "application/problem+json"
            assert reply.json()["field"] == "session_id", reply.json()
        assert "/turnlog/sessions/{session_id}" in (await http.get("/turnlog/x")).json()["detail"]


async def test_a_websocket_handshake_is_refused_not_a_500(forwarder):
    for path in (b"/turnlog/healthz", b"/generate"):
        request = (b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                   b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                   b"Sec-WebSocket-Version: 13\r\n\r\n")
        reply = raw_request(forwarder.port, request)
        assert reply.startswith(b"HTTP/1.1 403"), reply[:200]
        # A tester's finding: the refusal was an empty text/plain 403, not a problem.
        head, _, body = reply.partition(b"\r\n\r\n")
        assert b"content-type: application/problem+json" in head.lower(), head
        problem = json.loads(body)
        assert problem["type"] == "urn:turnlog:websocket-refused", problem
        assert "does not proxy WebSocket" in problem["detail"], problem
    assert "Traceback" not in forwarder.log_tail(200)
