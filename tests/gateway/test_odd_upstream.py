"""Replies a real router would rarely send, from a raw-socket upstream: a status that is
not a final HTTP status, an interim 1xx head never followed by a final one, a head with a
control character in a header, a 304 that
declares a length, a body-less 204, a reply cut off
mid-body. The gateway answers each cleanly (a 502 problem, the reply relayed, or the
caller's connection cut as the upstream's was) and its connection to the caller goes on
serving where it can; nothing reaches uvicorn that it would refuse with a traceback.

These record nothing, so they run on one SQLite file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import metric, scrape, wait_for


def _turn_reply(extra_header: bytes) -> bytes:
    body = json.dumps({"id": "r1", "choices": [{
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"},
        "meta_info": {"output_token_logprobs": [[-0.1, 7], [-0.2, 8]],
                      "completion_tokens": 2}}]}).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra_header
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


@contextlib.asynccontextmanager
async def _listening(serve: Any) -> AsyncIterator[str]:
    """A raw upstream: `serve(reader, writer)` for each connection, on a loopback port;
    a connection the gateway ends (mid-request, too) is closed quietly. One `serve`
    returns from is left as it is (held open, say)."""
    async def each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(each, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


def _declared_length(head: bytes) -> int:
    """A request head's Content-Length (0 without one)."""
    return next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                 if line.lower().startswith(b"content-length:")), 0)


# What the raw upstream answers, by request path.
REPLIES = {
    b"/status-999": b"HTTP/1.1 999 Odd\r\nContent-Length: 2\r\n\r\nok",
    b"/status-600": b"HTTP/1.1 600 Odd\r\nContent-Length: 2\r\n\r\nok",
    b"/not-modified": b"HTTP/1.1 304 Not Modified\r\nContent-Length: 1234\r\nETag: \"v1\"\r\n\r\n",
    b"/no-content": b"HTTP/1.1 204 No Content\r\nX-Kept: yes\r\n\r\n",
    b"/plain": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello",
    # Interim heads and then nothing: no final reply ever comes.
    b"/processing": b"HTTP/1.1 102 Processing\r\n\r\n",
    b"/status-199": b"HTTP/1.1 199 Odd\r\nContent-Length: 2\r\n\r\nok",
    b"/v1/chat/completions?processing": b"HTTP/1.1 102 Processing\r\n\r\n",
    # Fewer bytes than declared, then the connection closes (an upstream that died).
    b"/broken": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial",
    # A verbose head: 300 headers and one line of 20 KB (a direct client reads it).
    # A chat turn's reply whose head carries a control character in a header value.
    b"/v1/chat/completions?control": _turn_reply(b"X-Bin: \x01\r\n"),
    b"/v1/chat/completions?expect": _turn_reply(b""),
    b"/control-value": b"HTTP/1.1 200 OK\r\nX-Bin: a\x7fb\r\nContent-Length: 2\r\n\r\nok",
    b"/verbose": (b"HTTP/1.1 200 OK\r\n"
                  + b"".join(b"X-H%d: %d\r\n" % (i, i) for i in range(300))
                  + b"X-Long: " + b"v" * 20_000 + b"\r\nContent-Length: 2\r\n\r\nok"),
}


@pytest.fixture
async def odd_upstream() -> AsyncIterator[str]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(REPLIES[path])
                await writer.drain()
                if path == b"/broken":
                    # The bytes it sent reach the gateway before the close: how much
                    # of a broken reply is relayed does not then hang on timing.
                    await asyncio.sleep(0.2)
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async with _listening(serve) as url:
        yield url


async def _exchange(port: int, requests: bytes) -> bytes:
    """Send `requests` (pipelined) on one connection; everything until it closes."""
    def run() -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
            sock.sendall(requests)
            chunks = []
            while data := sock.recv(65536):
                chunks.append(data)
        return b"".join(chunks)
    return await asyncio.to_thread(run)


def _get(path: bytes, last: bool = False) -> bytes:
    return (b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + (b"Connection: close\r\n" if last else b"") + b"\r\n")


async def test_a_status_that_is_not_final_is_a_502_problem(tmp_path, gateway_process,
                                                           odd_upstream):
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=odd_upstream)
    await gateway.wait_ready()
    for path in (b"/status-999", b"/status-600"):
        reply = await _exchange(gateway.port, _get(path) + _get(b"/plain", last=True))
        first, _, rest = reply.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 502"), reply[:300]
        problem_text, _, second = rest.partition(b"HTTP/1.1 ")
        problem = json.loads(problem_text)
        assert problem["type"] == "urn:turnlog:upstream-unavailable"
        assert str(int(path[-3:])) in problem["detail"]
        # The connection goes on: the next request on it is answered.
        assert second.startswith(b"200 OK") and second.endswith(b"hello"), second
    assert "Traceback" not in gateway.log_tail(300)


@pytest.mark.parametrize(("method", "path"), [
    (b"GET", b"/processing"), (b"GET", b"/status-199"),  # no body
    (b"POST", b"/status-199"),  # passthrough: the body streamed up
    (b"POST", b"/v1/chat/completions?processing"),  # a turn: the body sent whole
])
async def test_an_interim_head_without_a_final_one_is_a_502_at_the_upstream_timeout(
        tmp_path, gateway_process, odd_upstream, path, method):
    """aiohttp stops its read timeout at an interim 1xx head: a `102 Processing` and then
    silence held the caller past --upstream-timeout, an odd `199` (with a body) forever.
    The final head is due within the timeout of the request (GET: of connecting)."""
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", "--upstream-timeout", "1",
                              upstream=odd_upstream)
    await gateway.wait_ready()
    body = b'{"input_ids": [1, 2]}' if method == b"POST" else b""
    request = (method + b" " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
               + (b"X-SMG-Routing-Key: s-interim\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n" % len(body) if body else b"") + b"\r\n" + body)
    reply = await _exchange(gateway.port, request)  # its socket gives up after 15 s
    first, _, rest = reply.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 502"), reply[:300]
    problem = json.loads(rest)
    assert problem["type"] == "urn:turnlog:upstream-unavailable"
    assert "no final reply head" in problem["detail"], problem
    assert "Traceback" not in gateway.log_tail(300)


@pytest.mark.parametrize("path", [b"/plain", b"/v1/chat/completions?expect"])
async def test_a_caller_expecting_100_continue_is_answered_though_the_upstream_sends_none(
        tmp_path, gateway_process, odd_upstream, path):
    """A tester's finding: `Expect: 100-continue` (curl sends it with any body over 1 KB)
    went up as it came, and the gateway then held the body back until the upstream's
    own 100, which this one (like many servers) never sends: the caller waited for ever,
    past --upstream-timeout. The gateway answers the expectation itself; the upstream
    gets the body without being asked."""
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", "--upstream-timeout", "5",
                              upstream=odd_upstream)
    await gateway.wait_ready()
    body = json.dumps({"input_ids": list(range(1, 600))}).encode()
    head = (b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"X-SMG-Routing-Key: s-expect\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))

    def run() -> bytes:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=15) as sock:
            sock.sendall(head)
            interim = sock.recv(65536)  # the 100, as a client that asked waits for it
            assert interim.startswith(b"HTTP/1.1 100"), interim
            sock.sendall(body)
            chunks = []
            while data := sock.recv(65536):
                chunks.append(data)
        return b"".join(chunks)

    reply = await asyncio.to_thread(run)
    first, _, rest = reply.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200"), reply[:300]
    assert rest == REPLIES[path].partition(b"\r\n\r\n")[2]


async def test_a_reply_without_a_body_is_relayed_and_the_connection_goes_on(
        tmp_path, gateway_process, odd_upstream):
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=odd_upstream)
    await gateway.wait_ready()
    reply = await _exchange(gateway.port, _get(b"/not-modified") + _get(b"/no-content")
                            + _get(b"/plain", last=True))
    assert reply.count(b"HTTP/1.1 ") == 3, reply
    not_modified, no_content, plain = reply.split(b"HTTP/1.1 ")[1:]
    assert not_modified.startswith(b"304") and b'etag: "v1"' in not_modified.lower()
    # Its Content-Length described another reply: not passed on (uvicorn would wait
    # for those bytes and cut the connection).
    assert b"content-length" not in not_modified.lower()
    assert no_content.startswith(b"204") and b"x-kept: yes" in no_content.lower()
    assert plain.startswith(b"200 OK") and plain.endswith(b"hello")
    assert "Traceback" not in gateway.log_tail(300)


async def test_a_reply_head_that_cannot_be_relayed_is_a_502_and_no_turn(
        tmp_path, gateway_process, odd_upstream):
    """A control character in a reply header's value: uvicorn refuses to send such a
    head, so relaying it dropped the caller's connection with no answer — after the
    turn had been stored (the caller's retry stored it twice). It is the upstream's
    fault, answered 502 before anything is recorded, as a reply that breaks off."""
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=odd_upstream)
    await gateway.wait_ready()
    body = b'{"input_ids": [1, 2, 3]}'
    turn = (b"POST /v1/chat/completions?control HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"X-SMG-Routing-Key: s-control\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)
    for request in (turn, _get(b"/control-value")):
        reply = await _exchange(gateway.port, request + _get(b"/plain", last=True))
        first, _, rest = reply.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 502"), reply[:300]
        problem_text, _, second = rest.partition(b"HTTP/1.1 ")
        problem = json.loads(problem_text)
        assert problem["type"] == "urn:turnlog:upstream-unavailable"
        assert "control character" in problem["detail"] and "x-bin" in problem["detail"]
        assert second.startswith(b"200 OK") and second.endswith(b"hello"), second
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}") as http:
        page = await scrape(http)
    assert metric(page, "turnlog_gateway_recorded_total") == 0
    assert metric(page, "turnlog_gateway_unrecorded_total",
                  'reason="upstream-unavailable"') == 1
    assert "Traceback" not in gateway.log_tail(300)


async def test_a_verbose_reply_head_is_relayed(tmp_path, gateway_process, odd_upstream):
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=odd_upstream)
    await gateway.wait_ready()
    reply = await _exchange(gateway.port, _get(b"/verbose", last=True))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b"ok", reply[:200]
    assert head.count(b"\r\nx-h") == 300 and b"x-long: " + b"v" * 20_000 in head


async def test_a_reply_that_breaks_off_cuts_the_callers_connection_with_one_log_line(
        tmp_path, gateway_process, odd_upstream):
    """The head is relayed already when the upstream's reply breaks off: the caller's
    connection is cut (it sees fewer bytes than declared), the gateway says so in one
    warning, and no traceback (an upstream's fault is not the gateway's bug)."""
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=odd_upstream)
    await gateway.wait_ready()
    reply = await _exchange(gateway.port, _get(b"/broken") + _get(b"/plain", last=True))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-length: 100" in head.lower()
    assert body == b"partial"  # then the connection closed: the next request not served
    again = await _exchange(gateway.port, _get(b"/plain", last=True))
    assert again.startswith(b"HTTP/1.1 200") and again.endswith(b"hello")
    log = gateway.log_tail(300)
    assert "upstream reply broke off" in log, log
    assert "Traceback" not in log
    # A tester's finding: uvicorn's own error line about the unfinished answer followed.
    assert "without completing response" not in log, log


@pytest.fixture
async def stalled_upstream() -> AsyncIterator[str]:
    """An upstream that accepts connections and never reads from them (a hung router)."""
    held: list[asyncio.StreamWriter] = []

    async def serve(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    async with _listening(serve) as url:
        yield url
        for writer in held:
            writer.close()


async def _post_while_reading(port: int, head: bytes, body: bytes) -> tuple[bytes, bytes]:
    """POST `body` on one connection while reading the reply (a proxy that stops
    taking the body must still be heard): the reply's head and its body (by its
    Content-Length; the connection may stay open, the upload unfinished)."""
    def run() -> tuple[bytes, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            def upload() -> None:
                with contextlib.suppress(OSError):  # the reply came first and closed it
                    sock.sendall(head + body)
            threading.Thread(target=upload, daemon=True).start()
            received = b""
            while b"\r\n\r\n" not in received:
                received += sock.recv(65536) or b"<closed>\r\n\r\n"
            reply_head, _, rest = received.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in reply_head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(rest) < length and (data := sock.recv(65536)):
                rest += data
            return reply_head, rest
    return await asyncio.to_thread(run)


@pytest.mark.parametrize("recorded", [False, True], ids=["passthrough", "turn"])
async def test_an_upstream_that_stops_reading_the_body_is_a_502(
        tmp_path, gateway_process, stalled_upstream, recorded):
    """aiohttp's read timeout starts only once a request body is sent: a body larger than
    the sockets' buffers, to an upstream that takes none of it, must still end in the
    upstream timeout's 502 (it hung the caller for good)."""
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", "--upstream-timeout", "1",
                              upstream=stalled_upstream)
    await gateway.wait_ready()
    # 24 MB: more than the loopback sockets buffer between the gateway and the upstream.
    if recorded:  # a turn, buffered whole by the gateway, then sent up
        body = b'{"input_ids": [1, 2], "pad": "' + b"x" * (24 << 20) + b'"}'
        path, extra = b"/v1/chat/completions", b"X-SMG-Routing-Key: s-stalled\r\n"
    else:  # passthrough, streamed up as it comes
        body, path, extra = b"x" * (24 << 20), b"/generate", b""
    head = (b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + extra + b"Content-Length: %d\r\n\r\n" % len(body))
    first, rest = await _post_while_reading(gateway.port, head, body)
    assert first.startswith(b"HTTP/1.1 502"), first + rest[:300]
    problem = json.loads(rest)
    assert problem["type"] == "urn:turnlog:upstream-unavailable"
    assert "request body" in problem["detail"] and "1 s" in problem["detail"]
    assert "Traceback" not in gateway.log_tail(300)


@pytest.fixture
async def early_upstream() -> AsyncIterator[str]:
    """An upstream that starts its reply as soon as it has a request's head, reads the
    request's body (slowly) to the end, then ends its reply and serves the next request
    on the connection."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = _declared_length(head)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nearly")
                await writer.drain()
                if b"transfer-encoding: chunked" in head.lower():
                    while size := int((await reader.readline()).strip(), 16):
                        await reader.readexactly(size + 2)
                    await reader.readexactly(2)  # the last chunk's CRLF
                while length:
                    length -= len(await reader.read(min(length, 1 << 16)))
                    await asyncio.sleep(0.001)
                writer.write(b"-done")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async with _listening(serve) as url:
        yield url


async def test_a_reply_that_comes_before_the_body_is_sent_is_relayed_whole(
        tmp_path, gateway_process, early_upstream):
    """The upstream starts its reply before it has read the request body, and ends it
    after. The end of the upload comes after the reply's head, whose deadline is gone
    by then: it must not disturb the reply (it broke the connection, and with it the
    reply's rest), and the next request is served."""
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=early_upstream)
    await gateway.wait_ready()
    body = b"x" * (8 << 20)

    async def chunked() -> AsyncIterator[bytes]:  # no length: sent up chunked
        for start in range(0, len(body), 1 << 20):
            yield body[start:start + (1 << 20)]
            await asyncio.sleep(0.01)

    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        for content in (body, chunked(), body):
            reply = await http.post("/generate", content=content)
            assert (reply.status_code, reply.content) == (200, b"early-done")
    assert "Traceback" not in gateway.log_tail(300)


class Hangups:
    """A raw upstream that reads each request, answers `/slow-stream` with a head and
    one chunk of a chunked reply (and never the rest), nothing else at all, and notes
    the path of each request whose connection the gateway closed before an answer
    ended."""

    def __init__(self) -> None:
        self.closed: list[bytes] = []
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        path = b"?"
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1]
            length = _declared_length(head)
            await reader.readexactly(length)
            if path == b"/slow-stream":
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"5\r\nfirst\r\n")
                await writer.drain()
            await reader.read()  # returns at the gateway's close (EOF)
            self.closed.append(path)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.append(path)
        finally:
            writer.close()


@pytest.fixture
async def hangups() -> AsyncIterator[Hangups]:
    upstream = Hangups()
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield upstream


async def _hang_up_after(port: int, request: bytes, first: bytes = b"") -> None:
    """Send `request`, read until `first` has come (nothing: at once), hang up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    received = b""
    while first not in received:
        received += await reader.read(65536)
    await asyncio.sleep(0.3)  # the request is upstream by now
    writer.close()
    await writer.wait_closed()


async def test_a_caller_that_hangs_up_ends_its_upstream_request_at_once(
        tmp_path, gateway_process, hangups):
    """The caller goes away while the upstream generates (no head yet), or while a
    streamed reply waits for its next chunk: the gateway closes its upstream connection
    at once — as the caller's hang-up would have reached the upstream without it
    (SGLang aborts the generation) — not when the upstream answers, its next chunk
    comes, or the upstream timeout (600 s) passes. A turn so given up is counted
    `caller-gone`."""
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=hangups.url)
    await gateway.wait_ready()
    body = b'{"input_ids": [1, 2]}'
    turn = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"X-SMG-Routing-Key: s-gone\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await _hang_up_after(gateway.port, turn)
    await _hang_up_after(gateway.port, _get(b"/generate"))
    await _hang_up_after(gateway.port, _get(b"/slow-stream"), first=b"first")

    async def all_closed() -> bool:
        return len(hangups.closed) == 3

    await wait_for(all_closed, timeout=10, what="the upstream connections to close")
    assert sorted(hangups.closed) == [b"/generate", b"/slow-stream", b"/v1/chat/completions"]
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        assert metric(await scrape(http), "turnlog_gateway_unrecorded_total",
                      'reason="caller-gone"') == 1
    assert "Traceback" not in gateway.log_tail(300)


async def test_a_hang_up_mid_stream_leaves_nothing_holding_the_relay(hangups):
    """The relay stops at a hang-up between two chunks without an error raised into it
    that aiohttp would keep: closing the response under its pending read did that, and
    the kept traceback held the relay's frame and buffers (~16 KB a hang-up, measured
    as the gateway's RSS) until a full collection."""
    import aiohttp

    from app.gateway.proxy import _relay

    first_sent = asyncio.Event()
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        if not sent:
            return {"type": "http.request", "body": b"", "more_body": False}
        await first_sent.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)
        if message.get("body"):
            first_sent.set()

    async with aiohttp.ClientSession() as client:
        response = await client.get(hangups.url + "/slow-stream")
        await asyncio.wait_for(_relay({"path": "/slow-stream"}, receive, send, response), 10)
        error = response.content.exception()
        assert error is None or error.__traceback__ is None, error
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


@pytest.fixture
async def late_reader_upstream() -> AsyncIterator[str]:
    """An upstream that takes a request's head, reads nothing of its body for 3 s (a
    busy router), then reads it all and answers 200."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await asyncio.sleep(3)
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    async with _listening(serve) as url:
        yield url


async def test_an_upstream_slow_to_read_a_body_is_not_the_callers_slow_pace(
        tmp_path, gateway_process, late_reader_upstream):
    """A review's finding: the minimum pace of a caller's body (TURNLOG_MIN_UPLOAD_RATE)
    was kept by the wall clock, so a passthrough body the upstream stopped taking for a
    while got the caller, sending as fast as it could, a 408 saying it was too slow.
    Only the time spent waiting for the caller's bytes counts."""
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=late_reader_upstream,
                              env={"TURNLOG_MIN_UPLOAD_RATE": "4000000",
                                   "TURNLOG_UPLOAD_GRACE_S": "1"})
    await gateway.wait_ready()
    body = b"x" * (32 << 20)  # more than the sockets on the way buffer
    head = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    first, rest = await _post_while_reading(gateway.port, head, body)
    assert first.startswith(b"HTTP/1.1 200"), first + rest[:300]
    assert rest == b"ok"


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close the connection with a TCP reset (SO_LINGER 0), as a crashed or impatient
    peer does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                    (1).to_bytes(4, "little") + (0).to_bytes(4, "little"))
    writer.transport.abort()


@pytest.fixture
async def resetting_upstream() -> AsyncIterator[tuple[str, list[str]]]:
    """An upstream that answers the first request of a connection, and resets the
    connection at the head of the next one, reading none of its body (a kept-alive
    connection closed by the upstream just as the gateway sent a request on it); a
    request to a path ending `?reset-after-body` it reads whole, then resets the
    connection instead of answering. Also yields what it did, in order."""
    seen: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for index in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            if index == 1:
                seen.append(f"reset {path}")
                _reset(writer)
                return
            length = _declared_length(head)
            await reader.readexactly(length)
            if path.endswith("?reset-after-body"):  # it has the request: "generating"
                seen.append(f"received {path} ({length} bytes), then reset")
                await asyncio.sleep(0.3)
                _reset(writer)
                return
            if path == "/plain?slow":  # callers at once: each on a connection of its own
                await asyncio.sleep(0.3)
            seen.append(f"answered {path} ({length} bytes)")
            writer.write(REPLIES[b"/plain"] if path.startswith("/plain")
                         else _turn_reply(b""))
            await writer.drain()

    async with _listening(serve) as url:
        yield url, seen


async def test_a_turn_whose_kept_alive_connection_is_reset_is_sent_again_on_a_new_one(
        tmp_path, gateway_process, resetting_upstream):
    """Seen in a profiled bench run: a turn sent on a pooled connection the upstream had
    just closed was a 502 (`Can not write request body`), though the upstream never
    had it. A turn's body is held whole: sent again, once, on a new connection."""
    upstream, seen = resetting_upstream
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=upstream)
    await gateway.wait_ready()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        assert (await http.get("/plain")).text == "hello"  # the connection, now pooled
        # More than the sockets on the way buffer: the reset comes while it is going up.
        body = b'{"input_ids": [1, 2], "pad": "' + b"x" * (24 << 20) + b'"}'
        reply = await http.post("/v1/chat/completions", content=body,
                                headers={"content-type": "application/json",
                                         "X-SMG-Routing-Key": "s-reset"})
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["id"] == "r1"
    assert seen == ["answered /plain (0 bytes)", "reset /v1/chat/completions",
                    f"answered /v1/chat/completions ({len(body)} bytes)"]
    assert "sending it again" in gateway.log_tail(300)
    assert "Traceback" not in gateway.log_tail(300)


async def test_a_turn_sent_again_after_a_reset_takes_a_new_connection_not_another_idle_one(
        tmp_path, gateway_process, resetting_upstream):
    """An upstream that closes its idle connections closes them all: the request sent
    again after a reset on one of them went on the next idle one, was reset too, and
    was a 502. The second sending opens a connection of its own."""
    upstream, seen = resetting_upstream
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=upstream)
    await gateway.wait_ready()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as one, \
            httpx.AsyncClient(base_url=gateway.url, timeout=60) as two:
        # Two connections to the upstream, both idle in the gateway's pool after.
        replies = await asyncio.gather(one.get("/plain?slow"), two.get("/plain?slow"))
        assert [reply.text for reply in replies] == ["hello", "hello"]
        body = b'{"input_ids": [1, 2], "pad": "' + b"x" * (24 << 20) + b'"}'
        reply = await one.post("/v1/chat/completions", content=body,
                               headers={"content-type": "application/json",
                                        "X-SMG-Routing-Key": "s-reset-twice"})
    assert reply.status_code == 200, reply.text[:300]
    assert seen == ["answered /plain?slow (0 bytes)"] * 2 + [
        "reset /v1/chat/completions", f"answered /v1/chat/completions ({len(body)} bytes)"]


async def test_a_connection_idle_past_the_upstreams_keep_alive_is_not_taken_again(
        tmp_path, gateway_process, resetting_upstream):
    """uvicorn (SGLang's server) closes a connection idle for 5 s; the gateway keeps one
    idle for 4 s at most (`UPSTREAM_IDLE_S`), so it does not send a request on one the
    upstream is closing (aiohttp's own bound is 15 s)."""
    upstream, seen = resetting_upstream
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=upstream)
    await gateway.wait_ready()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        assert (await http.get("/plain")).text == "hello"
        await asyncio.sleep(4.5)
        assert (await http.get("/plain")).text == "hello"
    # A new connection: the first request of each was answered, none was reset.
    assert seen == ["answered /plain (0 bytes)"] * 2


async def test_a_turn_reset_once_its_body_was_all_sent_is_a_502_never_sent_twice(
        tmp_path, gateway_process, resetting_upstream):
    """A review's finding: a reset while waiting for the reply is the same aiohttp error
    as one while the body goes up, but the upstream may be generating by then: the
    turn was sent again and ran twice. Sent again only if its body was not all sent."""
    upstream, seen = resetting_upstream
    gateway = gateway_process(f"sqlite:///{tmp_path / 'g.db'}", upstream=upstream)
    await gateway.wait_ready()
    body = b'{"input_ids": [1, 2]}'
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        reply = await http.post("/v1/chat/completions?reset-after-body", content=body,
                                headers={"content-type": "application/json",
                                         "X-SMG-Routing-Key": "s-reset-late"})
    assert reply.status_code == 502, reply.text[:300]
    assert reply.json()["type"] == "urn:turnlog:upstream-unavailable"
    await asyncio.sleep(0.5)  # a second sending would have reached the upstream by now
    assert seen == [f"received /v1/chat/completions?reset-after-body ({len(body)} bytes), "
                    "then reset"]
    assert "sending it again" not in gateway.log_tail(300)


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
async def test_a_held_reply_is_read_in_the_pieces_received_not_joined_first(chunked):
    """A held reply is read as aiohttp received it, each piece once into the reply's
    buffer: `iter_any` joined the pieces waiting into one `bytes` first, a copy of
    every byte (~1 ms of the gateway's CPU per 4.2 MB turn). Chunked or not, the
    bytes are the reply's, in order, none empty."""
    from aiohttp.base_protocol import BaseProtocol
    from aiohttp.streams import StreamReader

    from app.gateway.proxy import _pieces

    loop = asyncio.get_running_loop()
    reader = StreamReader(BaseProtocol(loop), 2**20, loop=loop)
    sent = [bytes([i]) * 1000 for i in range(1, 5)]
    for piece in sent:
        if chunked:
            reader.begin_http_chunk_receiving()
        reader.feed_data(piece)
        if chunked:
            reader.end_http_chunk_receiving()
    reader.feed_eof()
    read = [piece async for piece in _pieces(reader)]
    assert read == sent
    assert all(got is piece for got, piece in zip(read, sent, strict=True))  # not copied
