"""A turn the store could never take (above `TURNLOG_MAX_BODY_BYTES`, the store's body
limit) is forwarded, counted `rejected` and never held whole by the gateway: a large
request body, a large reply, a small compressed reply that inflates past the limit,
and a reply that declares a length it never sends. A turn within the limit is
recorded as always.

The bounds do not depend on the store's backend (the turns they concern are not
stored), so they run on one SQLite file.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import chat, metric, python_server, scrape, send_turn
from tests.serverproc import ServerProcess

LIMIT = 256 * 1024
HEADER = "X-SMG-Routing-Key"


@pytest.fixture
def bounded_gateway(tmp_path: Path, fake_sglang: ServerProcess) -> Iterator[ServerProcess]:
    argv = ["-m", "app", "gateway", "--upstream", fake_sglang.url,
            "--database-url", f"sqlite:///{tmp_path / 'g.db'}",
            "--spool-dir", str(tmp_path / "spool")]
    process = python_server(argv, tmp_path / "gateway.log", "/turnlog/healthz")
    process.env["TURNLOG_MAX_BODY_BYTES"] = str(LIMIT)
    with process:
        process.wait_ready_sync()
        yield process


def too_large(gateway: ServerProcess) -> dict[str, Any]:
    """The last "turn not recorded: too large" line of the gateway's (JSON) log."""
    lines = [json.loads(line) for line in gateway.log_tail(200).splitlines()
             if '"turn not recorded: too large"' in line]
    assert lines, gateway.log_tail(50)
    return lines[-1]


async def counts(http: httpx.AsyncClient) -> tuple[float, float]:
    text = await scrape(http)
    return (metric(text, "turnlog_gateway_recorded_total"),
            metric(text, "turnlog_gateway_unrecorded_total", 'reason="rejected"'))


async def test_a_turn_within_the_limit_is_recorded(bounded_gateway):
    async with httpx.AsyncClient(base_url=bounded_gateway.url, timeout=30) as http:
        sent = await send_turn(http, "bound-ok", chat([1, 2, 3]))
        assert sent.status == 200
        assert await counts(http) == (1, 0)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_request_above_the_limit_is_forwarded_not_held(bounded_gateway, fake_sglang,
                                                              framing):
    request = chat([1, 2, 3], padding="y" * (2 * LIMIT))
    body = json.dumps(request).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for at in range(0, len(body), 50_000):
            yield body[at:at + 50_000]

    content: Any = body if framing == "content-length" else pieces()
    headers = {HEADER: f"bound-req-{framing}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=bounded_gateway.url, timeout=30) as http, \
            httpx.AsyncClient(base_url=fake_sglang.url, timeout=30) as direct:
        reply = await http.post("/v1/chat/completions", content=content, headers=headers)
        expected = await direct.post("/v1/chat/completions", content=body, headers=headers)
        # The whole body went up: the upstream's answer is the one it gives directly.
        assert (reply.status_code, reply.content) == (200, expected.content)
        assert await counts(http) == (0, 1)
    # The size logged: as declared, else at least what was read (a helper's finding:
    # a declared reply past the limit was logged as 0 bytes).
    logged = too_large(bounded_gateway)
    assert logged["part"] == "request" and logged["limit"] == LIMIT
    if framing == "content-length":
        assert logged["bytes"] == len(body)
    else:
        assert LIMIT < logged["at_least"] <= len(body)


async def test_a_reply_above_the_limit_is_relayed_not_held(bounded_gateway, fake_sglang):
    headers = {"X-Sim-Pad": str(2 * LIMIT)}
    async with httpx.AsyncClient(base_url=bounded_gateway.url, timeout=30) as http, \
            httpx.AsyncClient(base_url=fake_sglang.url, timeout=30) as direct:
        sent = await send_turn(http, "bound-reply", chat([1, 2, 3]), headers)
        expected = await direct.post("/v1/chat/completions", json=chat([1, 2, 3]),
                                     headers=headers)
        assert sent.status == 200 and sent.reply == expected.content
        assert len(sent.reply) > 2 * LIMIT
        assert await counts(http) == (0, 1)
    logged = too_large(bounded_gateway)
    assert (logged["part"], logged["bytes"]) == ("reply", len(sent.reply))
    assert 0 < logged["request_bytes"] < 1000  # the small request sharing the limit


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
async def test_a_reply_that_inflates_past_the_limit_is_not_inflated(bounded_gateway,
                                                                   fake_sglang, encoding):
    """A few KB that inflate to 8 x the limit: relayed compressed, not recorded."""
    headers = {"X-Sim-Pad": str(8 * LIMIT), "X-Sim-Encoding": encoding,
               "Accept-Encoding": encoding}
    async with httpx.AsyncClient(base_url=bounded_gateway.url, timeout=30) as http, \
            httpx.AsyncClient(base_url=fake_sglang.url, timeout=30) as direct:
        sent = await send_turn(http, f"bound-bomb-{encoding}", chat([1, 2, 3]), headers)
        expected = await direct.post("/v1/chat/completions", json=chat([1, 2, 3]),
                                     headers=headers)
        # Passed on as compressed as it came (httpx inflates both for the comparison).
        assert sent.status == 200 and sent.reply == expected.content
        assert expected.headers["content-encoding"] == encoding
        assert len(expected.content) > 8 * LIMIT
        assert await counts(http) == (0, 1)
    logged = too_large(bounded_gateway)
    assert logged["part"] == "decompressed reply"
    # Inflated only past what the limit leaves beside the request, never to its end.
    assert logged["at_least"] == LIMIT - logged["request_bytes"] + 1


async def test_a_declared_length_past_the_limit_allocates_nothing(tmp_path, gateway_process):
    """An upstream that declares 4 GB and sends two bytes: the reply is relayed as it
    comes (cut off when the upstream closes), no buffer of the declared size is made."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 4000000000\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    upstream = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=upstream)
        await gateway.wait_ready()
        before = _rss_kib(gateway)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            with pytest.raises(httpx.RemoteProtocolError):
                await http.post("/v1/chat/completions", json=chat([1, 2, 3]),
                                headers={HEADER: "bound-lie"})
            assert _rss_kib(gateway) - before < 64 * 1024
            _, rejected = await counts(http)
            assert rejected == 1
    assert "MemoryError" not in gateway.log_tail(200)


def _rss_kib(process: ServerProcess) -> int:
    assert process.proc is not None
    for line in Path(f"/proc/{process.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize(("path", "extra"), [
    (b"/v1/chat/completions", b"X-SMG-Routing-Key: s-stalled\r\n"),  # a turn: gathered
    (b"/generate", b""),  # passthrough: streamed up as it comes
    (b"/turnlog/v1/sessions/s-stalled/close", b""),  # the gateway's own write route
], ids=["turn", "passthrough", "own-close"])
async def test_a_caller_whose_body_stops_gets_408_and_nothing_is_stored(
        tmp_path, gateway_process, fake_sglang, path, extra):
    """A caller that declares more body than it sends held its connection (and, for a
    turn, the gateway's buffer) for as long as it liked: `turnlog serve` answers 408
    after TURNLOG_BODY_TIMEOUT_S without a byte, and the gateway now does the same."""
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}",
                              env={"TURNLOG_BODY_TIMEOUT_S": "1"})
    await gateway.wait_ready()
    started = asyncio.get_running_loop().time()
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n" + extra
                 + b"Content-Length: 1000\r\n\r\n" + b'{"input_ids": [1, 2')
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    problem = json.loads(await reader.readexactly(length))
    # And the connection closes: the rest of that body never came, and would have been
    # read as the next request (a helper's finding: the socket stayed open, dead).
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"connection: close" in head.lower()
    assert problem["type"] == "urn:turnlog:request-timeout" and problem["field"] == "body"
    assert "TURNLOG_BODY_TIMEOUT_S" in problem["expected"]
    assert asyncio.get_running_loop().time() - started < 15
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        assert metric(await scrape(http), "turnlog_gateway_recorded_total") == 0
    assert "Traceback" not in gateway.log_tail(200)


@pytest.mark.parametrize(("path", "extra"), [
    (b"/v1/chat/completions", b"X-SMG-Routing-Key: s-trickled\r\n"),
    (b"/generate", b""),
    (b"/turnlog/v1/sessions/s-trickled/close", b""),
], ids=["turn", "passthrough", "own-close"])
async def test_a_body_trickled_in_below_the_minimum_pace_gets_408(
        tmp_path, gateway_process, fake_sglang, path, extra):
    """A tester's finding: a byte every 25 s (each within the body timeout) held a turn,
    a passthrough and a close for as long as the caller liked. The gateway keeps the
    store's minimum pace: here 100 bytes/s after a 1 s grace, a byte every 0.5 s."""
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", env={
        "TURNLOG_BODY_TIMEOUT_S": "1", "TURNLOG_MIN_UPLOAD_RATE": "100",
        "TURNLOG_UPLOAD_GRACE_S": "1"})
    await gateway.wait_ready()
    loop = asyncio.get_running_loop()
    started = loop.time()
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n" + extra
                 + b"Content-Length: 1000\r\n\r\n{")
    await writer.drain()
    head = b""
    while not head and loop.time() - started < 8:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.5)
        except TimeoutError:
            writer.write(b" ")
            await writer.drain()
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    problem = json.loads(await reader.readexactly(length))
    writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert "slower than 100 bytes/s" in problem["detail"], problem
    assert loop.time() - started < 6
    assert "Traceback" not in gateway.log_tail(200)


async def _exchange(port: int, request: bytes, timeout: float = 20) -> tuple[bytes, Any, bytes]:
    """Send `request` raw; the answer's head, its problem body and what followed (b""
    when the gateway closed the connection)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = json.loads(await reader.readexactly(length))
        rest = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    return head, body, rest


async def test_the_gateway_holds_the_stores_http_bounds(tmp_path, gateway_process):
    """A helper's findings: one caller's 300 MB header froze every session's relaying
    (85 s, +570 MB), a connection that sent half a header (or nothing) was never closed,
    and malformed HTTP got uvicorn's plain-text 400. The gateway now speaks through the
    store's guarded protocol: 431, 408 after TURNLOG_HEADER_TIMEOUT_S, problem+json."""
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}",
                              env={"TURNLOG_HEADER_TIMEOUT_S": "1"})
    await gateway.wait_ready()
    flood = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"
    head, problem, rest = await _exchange(gateway.port, flood)
    assert head.startswith(b"HTTP/1.1 431") and rest == b"", head
    assert problem["type"] == "urn:turnlog:headers-too-large"
    started = asyncio.get_running_loop().time()
    head, problem, rest = await _exchange(gateway.port,
                                          b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    assert head.startswith(b"HTTP/1.1 408") and rest == b"", head
    assert problem["field"] == "headers"
    assert asyncio.get_running_loop().time() - started < 8
    head, problem, rest = await _exchange(
        gateway.port, b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/problem+json" in head, head
    assert problem["field"] == "request"
    # A tester's finding: a body after an Upgrade head (`curl --http2` on plain http) was
    # never parsed; the gateway relayed the head and waited for the body for its
    # upstream timeout (600 s). Refused at once; without a body it is served.
    started = asyncio.get_running_loop().time()
    head, problem, rest = await _exchange(
        gateway.port, b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, "
                      b"HTTP2-Settings\r\nUpgrade: h2c\r\nContent-Length: 5\r\n\r\nhello")
    assert head.startswith(b"HTTP/1.1 400") and rest == b"", head
    assert problem["field"] == "Upgrade" and problem["actual"] == "h2c"
    assert asyncio.get_running_loop().time() - started < 5
    # Refused before anything acts on it (a review's finding: the 400 went out, and the
    # close went through with an empty body, its reward lost).
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        assert (await send_turn(http, "s-upgrade", chat([1, 2, 3]))).status == 200
    close = b'{"metadata": {"reward": 1.0}}'
    head, problem, rest = await _exchange(
        gateway.port, b"POST /turnlog/v1/sessions/s-upgrade/close HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Connection: Upgrade\r\nUpgrade: h2c\r\nContent-Type: application/json"
                      b"\r\nContent-Length: %d\r\n\r\n" % len(close) + close)
    assert head.startswith(b"HTTP/1.1 400"), head
    await asyncio.sleep(0.5)
    with sqlite3.connect(tmp_path / "g.db") as db:
        assert db.execute("SELECT status FROM sessions WHERE session_id = 's-upgrade'"
                          ).fetchone() == ("open",)
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\n"
                 b"Upgrade: h2c\r\n\r\n")
    assert (await asyncio.wait_for(reader.readline(), 20)).startswith(b"HTTP/1.1 200")
    writer.close()
    async with httpx.AsyncClient(base_url=gateway.url) as http:  # and it still serves
        assert (await http.get("/turnlog/healthz")).status_code == 200
    assert "Traceback" not in gateway.log_tail(200)


async def test_a_compressed_body_to_the_gateways_own_routes_is_415(tmp_path, gateway_process):
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}")
    await gateway.wait_ready()
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        r = await http.post("/turnlog/v1/sessions/s-gz/close", content=b"\x1f\x8b\x08\x00",
                            headers={"content-type": "application/json",
                                     "content-encoding": "gzip"})
    assert r.status_code == 415, r.text
    assert r.json()["field"] == "content-encoding"
