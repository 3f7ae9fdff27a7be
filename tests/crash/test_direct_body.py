"""A multi-MB turn read straight into the append route's buffer, on a real `turnlog serve`.

The hot path reads a body's first message through ASGI and the rest directly from
the socket (`app.api.middleware.serving.DirectBody`): the connection's protocol is
swapped for a buffered reader until the declared length is in, then put back with a
fresh parser. Raw sockets, to send what an HTTP client would not: a body in pieces
with the next request pipelined right behind it, a body that stops, a caller that
hangs up midway, `Expect: 100-continue`, the server SIGKILLed mid-read. The stored
turn must be the one sent, byte for byte (its R3 read back against the array it was
made from), the connection must go on serving exactly where the body ended, and a
body cut short must store nothing.

Transport only: one SQLite store.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from tests.factory import open_body, turn
from tests.serverproc import ServerProcess, server_env, turnlog_serve
from tests.wire import MSGPACK, to_msgpack

LAYERS, TOPK = 48, 8
ROWS = 2000  # ~3 MB of int32 R3: the size a 2k-token Qwen3-30B-A3B turn sends
LIMITS = {"TURNLOG_BODY_TIMEOUT_S": "1"}


@pytest.fixture(scope="module")
def server(fresh_database, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("direct") / "server.log"
    with turnlog_serve(fresh_database("sqlite"), log, env=server_env(LIMITS)) as proc:
        proc.wait_ready_sync()
        yield proc


def big_turn(seed: int) -> tuple[bytes, np.ndarray]:
    """A first turn of ROWS + 1 tokens with full R3, as MessagePack, and its R3."""
    rng = np.random.default_rng(seed)
    r3 = rng.integers(0, 128, size=(ROWS, LAYERS, TOPK), dtype=np.int32)
    prompt = rng.integers(0, 150_000, ROWS - 3).tolist()
    body = turn(prompt, [5, 6, 7, 8], r3=base64.b64encode(r3.tobytes()).decode())
    return to_msgpack(body), r3


def request(method: str, path: str, body: bytes = b"", *extra: bytes) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n".encode() + b"".join(extra)
    if body or method == "POST":
        head += b"Content-Type: %s\r\nContent-Length: %d\r\n" % (
            MSGPACK.encode() if body[:1] != b"{" else b"application/json", len(body))
    return head + b"\r\n" + body


class Conn:
    """One raw connection: send bytes, read whole HTTP/1.1 answers (Content-Length)."""

    def __init__(self, server: ServerProcess) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self) -> tuple[int, bytes, bytes]:
        while b"\r\n\r\n" not in self.pending:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed; had {self.pending[:200]!r}")
            self.pending += chunk
        head, _, rest = self.pending.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed mid-answer")
            rest += chunk
        self.pending = rest[length:]
        return int(head.split()[1]), head, rest[:length]

    def closed_within(self, seconds: float) -> bool:
        self.sock.settimeout(seconds)
        try:
            return self.sock.recv(65536) == b""
        except (TimeoutError, ConnectionResetError):
            return False

    def close(self) -> None:
        self.sock.close()


def opened(conn: Conn, sid: str) -> None:
    conn.send(request("POST", "/v1/sessions", json.dumps(open_body(
        sid, r3={"num_layers": LAYERS})).encode()))
    status, _, body = conn.answer()
    assert status == 201, body


def a_turn_to_send(server: ServerProcess, seed: int) -> tuple[Conn, str, bytes, np.ndarray]:
    """A connection, the session it opened, a large first turn's request for it and
    that turn's R3."""
    sid = f"direct-{uuid.uuid4().hex[:12]}"
    conn = Conn(server)
    opened(conn, sid)
    body, r3 = big_turn(seed)
    return conn, sid, request("POST", f"/v1/sessions/{sid}/turns", body), r3


def r3_of(conn: Conn, sid: str) -> np.ndarray:
    conn.send(request("POST", f"/v1/sessions/{sid}/close", b'{"metadata": {}}'))
    assert conn.answer()[0] == 200
    conn.send(request("GET", f"/v1/sessions/{sid}/samples/0/r3"))
    status, _, body = conn.answer()
    assert status == 200, body
    return np.load(io.BytesIO(body))


def test_a_turn_in_pieces_is_stored_whole_and_the_pipelined_request_after_it_answered(server):
    conn, sid, whole, r3 = a_turn_to_send(server, 1)
    after = request("GET", f"/v1/sessions/{sid}")
    # The head and a first piece; the rest in uneven pieces, the next request on the
    # same connection sent in the same write as the body's last bytes.
    cuts = [0, whole.index(b"\r\n\r\n") + 70_000, len(whole) // 2, len(whole) - 12_345]
    for start, end in zip(cuts, cuts[1:], strict=False):
        conn.send(whole[start:end])
        time.sleep(0.1)
    conn.send(whole[cuts[-1]:] + after)
    status, _, reply = conn.answer()
    assert status == 201, reply
    assert json.loads(reply)["seq"] == 0
    status, _, summary = conn.answer()
    assert status == 200 and json.loads(summary)["num_nodes"] == 1, summary
    # The connection goes on, as it would have without the direct read.
    assert np.array_equal(r3_of(conn, sid), r3)
    conn.close()


def test_two_large_turns_back_to_back_on_one_connection(server):
    sids = [f"direct-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    conn = Conn(server)
    sent = []
    for seed, sid in enumerate(sids):
        opened(conn, sid)
        body, r3 = big_turn(10 + seed)
        conn.send(request("POST", f"/v1/sessions/{sid}/turns", body))
        sent.append(r3)
    for _ in sids:
        status, _, reply = conn.answer()
        assert status == 201, reply
    for sid, r3 in zip(sids, sent, strict=True):
        assert np.array_equal(r3_of(conn, sid), r3)
    conn.close()


def test_a_body_that_stops_midway_is_408_closed_and_stores_nothing(server):
    conn, sid, whole, _ = a_turn_to_send(server, 2)
    started = time.monotonic()
    conn.send(whole[:len(whole) // 3])
    status, _, problem = conn.answer()
    assert status == 408, problem
    assert json.loads(problem)["type"] == "urn:turnlog:request-timeout"
    assert time.monotonic() - started < 10
    # Where the body would have ended is unknown: the connection is closed.
    assert conn.closed_within(5)
    conn.close()
    check = Conn(server)
    check.send(request("GET", f"/v1/sessions/{sid}"))
    status, _, summary = check.answer()
    assert status == 200 and json.loads(summary)["num_nodes"] == 0
    check.close()


def test_a_caller_gone_midway_stores_nothing_and_the_server_serves_on(server):
    conn, sid, whole, r3 = a_turn_to_send(server, 3)
    conn.send(whole[:len(whole) // 2])
    time.sleep(0.2)
    conn.close()
    time.sleep(0.3)
    again = Conn(server)
    again.send(whole)
    status, _, reply = again.answer()
    assert status == 201, reply
    assert np.array_equal(r3_of(again, sid), r3)
    again.close()
    assert "Traceback" not in server.log_tail(300)


def test_expect_100_continue_then_a_large_turn(server):
    sid = f"direct-{uuid.uuid4().hex[:12]}"
    conn = Conn(server)
    opened(conn, sid)
    body, r3 = big_turn(4)
    whole = request("POST", f"/v1/sessions/{sid}/turns", body, b"Expect: 100-continue\r\n")
    head_len = len(whole) - len(body)
    conn.send(whole[:head_len])
    status, _, _ = conn.answer()
    assert status == 100
    conn.send(whole[head_len:])
    status, _, reply = conn.answer()
    assert status == 201, reply
    assert np.array_equal(r3_of(conn, sid), r3)
    conn.close()


async def test_concurrent_large_turns_on_many_connections(server):
    """Eight callers at once, each body in pieces: every turn stored whole."""
    async def one(seed: int) -> None:
        def run() -> None:
            conn, sid, whole, r3 = a_turn_to_send(server, 100 + seed)
            for start in range(0, len(whole), 700_000):
                conn.send(whole[start:start + 700_000])
                time.sleep(0.01)
            status, _, reply = conn.answer()
            assert status == 201, reply
            assert np.array_equal(r3_of(conn, sid), r3)
            conn.close()

        await asyncio.to_thread(run)

    await asyncio.gather(*(one(i) for i in range(8)))


@pytest.mark.parametrize("when", ["mid-body", "body-sent"])
async def test_a_server_killed_during_a_direct_read_stores_the_turn_once(
        fresh_database, server_process, when):
    """SIGKILL while the body is being read straight into its buffer (half sent), or
    right after all of it was sent (the append may or may not have committed): after
    a restart, the caller's retry of the same turn (same event_id) leaves exactly one
    node, with the R3 that was sent, and a second retry is a repeat (200)."""
    proc = server_process(fresh_database("sqlite"), LIMITS)
    await proc.wait_ready()
    conn, sid, whole, r3 = a_turn_to_send(proc, 20)
    conn.send(whole[:len(whole) // 2] if when == "mid-body" else whole)
    await asyncio.sleep(0.3)
    proc.kill()
    conn.close()
    proc.start()
    await proc.wait_ready()

    def retry() -> None:
        again = Conn(proc)
        again.send(whole)
        first, _, reply = again.answer()
        assert first in (200, 201), reply
        if when == "mid-body":
            assert first == 201, "a half-read body was stored"
        again.send(whole)
        assert again.answer()[0] == 200  # the same event_id: a repeat
        again.send(request("GET", f"/v1/sessions/{sid}"))
        status, _, summary = again.answer()
        assert status == 200 and json.loads(summary)["num_nodes"] == 1, summary
        assert np.array_equal(r3_of(again, sid), r3)
        again.close()

    await asyncio.to_thread(retry)
