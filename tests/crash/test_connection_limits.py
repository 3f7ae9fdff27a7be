"""A real `turnlog serve` against floods and slow clients (issue 13, items 3, 8, 12).

Raw sockets, because an HTTP client would never send what these send: header
floods (size and count) are refused with 431 while they stream in, before any
authorization; a body declared longer than sent, headers that never finish
and idle keep-alive connections are cut off after their timeouts; a token in
the query string is refused and never reaches the access log.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time
from collections.abc import Iterator

import pytest

from tests.serverproc import ServerProcess, server_env, turnlog_serve

TIMEOUT_S = 1.0
LIMITS = {
    "TURNLOG_BODY_TIMEOUT_S": str(TIMEOUT_S),
    "TURNLOG_HEADER_TIMEOUT_S": str(TIMEOUT_S),
    "TURNLOG_KEEP_ALIVE_TIMEOUT_S": "1",
    "TURNLOG_MAX_HEADER_BYTES": "16384",
    "TURNLOG_MAX_HEADERS": "50",
    "TURNLOG_API_TOKENS": "a-read-token-0123456789:read",
}
SECRET = "SECRET-0123456789abcdef"


@pytest.fixture(scope="module")
def server(fresh_database, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server with LIMITS for the tests that only open, flood and drop their own
    connections (each closes them; none changes a setting or the database)."""
    log = tmp_path_factory.mktemp("limits") / "server.log"
    with turnlog_serve(fresh_database("sqlite"), log, env=server_env(LIMITS)) as proc:
        proc.wait_ready_sync()
        yield proc


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_all(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes the connection (or the deadline)."""
    out = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk:
            return out + b"<closed>"
        out += chunk
    return out


def flood(sock: socket.socket, head: bytes, line: bytes, total: int) -> int:
    """Send `head`, then `line` repeatedly up to `total` bytes; bytes the server took."""
    sent = 0
    sock.sendall(head)
    try:
        while sent < total:
            sock.sendall(line)
            sent += len(line)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def test_a_header_flood_is_431_long_before_it_ends(server):
    sock = connect(server)
    line = b"X-Pad: " + b"a" * 1000 + b"\r\n"
    # 64 MiB would be buffered whole by plain uvicorn; the server refuses at 16 KiB.
    sent = flood(sock, b"GET /v1/sessions HTTP/1.1\r\nHost: localhost\r\n", line, 64 * 2**20)
    answer = read_all(sock, time.monotonic() + 10)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"urn:turnlog:headers-too-large" in answer
    assert sent < 64 * 2**20, "the server read the whole flood"


def test_too_many_headers_are_431_before_authorization(server):
    sock = connect(server)
    head = b"GET /v1/sessions HTTP/1.1\r\nHost: localhost\r\n"
    head += b"".join(b"X-H%d: 1\r\n" % i for i in range(60)) + b"\r\n"
    sock.sendall(head)
    answer = read_all(sock, time.monotonic() + 10)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]


def test_a_write_body_that_stops_coming_is_408_and_closed(server_process, fresh_database):
    env = {k: v for k, v in LIMITS.items() if k != "TURNLOG_API_TOKENS"}
    server = server_process(fresh_database("sqlite"), env)
    asyncio.run(server.wait_ready())
    sock = connect(server)
    started = time.monotonic()
    sock.sendall(b"POST /v1/sessions HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"session")
    answer = read_all(sock, started + 15)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert b"urn:turnlog:request-timeout" in answer
    assert answer.endswith(b"<closed>"), answer[-100:]
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("path", [
    b"/v1/sessions",  # a FastAPI route
    b"/v1/sessions/trickled/turns",  # the bare hot route (its body read straight in)
    b"/ui/login",  # the web UI's form
])
def test_a_small_body_trickled_in_is_408_once_below_the_minimum_pace(
        server_process, fresh_database, path):
    # A tester's finding: a byte every 25 s (each inside the body timeout) into a body
    # under TURNLOG_LARGE_BODY_BYTES held its connection, and a place under the
    # concurrency limit, for as long as the client liked: the pace was only a large
    # body's. Here: 100 bytes/s after a 1 s grace, a byte every 0.5 s.
    env = {k: v for k, v in LIMITS.items() if k != "TURNLOG_API_TOKENS"}
    env.update(TURNLOG_MIN_UPLOAD_RATE="100", TURNLOG_UPLOAD_GRACE_S="1")
    server = server_process(fresh_database("sqlite"), env)
    asyncio.run(server.wait_ready())
    sock = connect(server)
    started = time.monotonic()
    sock.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    answer = b""
    while time.monotonic() - started < 8 and not answer:
        # No byte after the server answered: a byte it never reads makes its close a
        # reset, which drops the unread answer on this side (a flake under load).
        if select.select([sock], [], [], 0.5)[0]:
            break
        try:
            sock.sendall(b" ")
        except (BrokenPipeError, ConnectionResetError):
            break
        answer = read_all(sock, time.monotonic() + 0.01)
    answer += read_all(sock, time.monotonic() + 2)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert b"arrives slower than 100 bytes/s" in answer, answer
    assert time.monotonic() - started < 5


def test_slow_headers_and_idle_connections_are_closed(server):
    started = time.monotonic()
    slow = [connect(server) for _ in range(20)]
    for sock in slow:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: loc")
    idle = connect(server)
    idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
    answers = [read_all(sock, started + 15) for sock in slow]
    idle_answer = read_all(idle, started + 15)
    for sock in [*slow, idle]:
        sock.close()
    assert all(a.endswith(b"<closed>") for a in answers), answers[:3]
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[:3]
    assert idle_answer.startswith(b"HTTP/1.1 200 ") and idle_answer.endswith(b"<closed>")
    assert time.monotonic() - started < 10


def test_a_token_in_the_query_string_is_refused_and_not_logged(server):
    sock = connect(server)
    sock.sendall(f"GET /v1/sessions?limit=1&access_token={SECRET} HTTP/1.1\r\n"
                 "Host: localhost\r\nConnection: close\r\n\r\n".encode())
    answer = read_all(sock, time.monotonic() + 10)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    time.sleep(0.2)
    log = server.log_path.read_text(errors="replace")
    assert "access_token=REDACTED" in log, log[-2000:]
    assert SECRET not in log


def test_at_the_concurrency_limit_healthz_answers_and_the_rest_is_problem_json(
        server_process, fresh_database):
    # Issue 21: 1,000 open long-polls reached the limit and /healthz answered uvicorn's
    # plain-text 503 for 30 s. Connections held open stand in for the long-polls.
    server = server_process(fresh_database("sqlite"), {
        "TURNLOG_LIMIT_CONCURRENCY": "4", "TURNLOG_HEADER_TIMEOUT_S": "30"})
    asyncio.run(server.wait_ready())
    held = [connect(server) for _ in range(6)]
    time.sleep(0.3)  # every connection accepted by the server
    try:
        answers = {}
        for path in ("/healthz", "/v1/sessions"):
            sock = connect(server)
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n"
                         "Connection: close\r\n\r\n".encode())
            answers[path] = read_all(sock, time.monotonic() + 10)
            sock.close()
    finally:
        for sock in held:
            sock.close()
    assert answers["/healthz"].startswith(b"HTTP/1.1 200 "), answers["/healthz"][:300]
    busy = answers["/v1/sessions"]
    assert busy.startswith(b"HTTP/1.1 503 "), busy[:300]
    assert b"application/problem+json" in busy and b"urn:turnlog:overloaded" in busy, busy


@pytest.mark.parametrize("head", [
    b"FOO /v1/sessions HTTP/1.1\r\nHost: localhost\r\n\r\n",  # no such method
    b"POST /v1/sessions HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/sessions HTTP/1.1\r\nHost: localhost\r\nContent-Length: -1\r\n\r\n{}",
    b"POST /v1/sessions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n{}",
    b"GET /v1/sessions HTTP/1.1\r\nHo st: localhost\r\n\r\n",  # a space in a header name
])
def test_a_request_that_is_not_http_is_a_problem_json_400(server, head):
    # A helper's finding: uvicorn answered these with its own plain-text 400
    # ("Invalid HTTP request received."), the one error that was not problem+json.
    sock = connect(server)
    sock.sendall(head)
    answer = read_all(sock, time.monotonic() + 10)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer[:300]
    head_part, _, body = answer.removesuffix(b"<closed>").partition(b"\r\n\r\n")
    assert b"content-type: application/problem+json" in head_part.lower(), head_part
    assert b"connection: close" in head_part.lower(), head_part
    problem = json.loads(body)
    assert problem["type"] == "urn:turnlog:invalid-request" and problem["status"] == 400
    assert problem["field"] == "request" and problem["expected"]
    assert answer.endswith(b"<closed>")


def ask(server: ServerProcess, method: str, path: str) -> tuple[bytes, bytes]:
    """One request with the read token; the answer's head and body."""
    sock = connect(server)
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                 f"Authorization: Bearer {LIMITS['TURNLOG_API_TOKENS'].split(':')[0]}"
                 "\r\n\r\n".encode())
    answer = read_all(sock, time.monotonic() + 10).removesuffix(b"<closed>")
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


def header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def test_head_is_answered_wherever_get_is_without_a_body(server):
    # A helper's finding: HEAD was a 405 on every GET route (RFC 9110 §9.1: a server
    # that answers GET answers HEAD). uvicorn drops the body of the GET's answer.
    for path in ("/healthz", "/v1/sessions?limit=1", "/v1/analytics/spec"):
        get_head, get_body = ask(server, "GET", path)
        head, body = ask(server, "HEAD", path)
        assert get_head.split(b"\r\n")[0] == head.split(b"\r\n")[0], (path, head)
        assert header(head, b"content-type") == header(get_head, b"content-type"), path
        assert body == b"" and get_body, path


def test_the_host_checks_judge_the_name_the_request_is_for(server_process, fresh_database):
    # The auth helper's findings, on a server without tokens (loopback names only):
    # an absolute-form target's authority was ignored (`GET http://evil.com/…` with
    # `Host: localhost` was served), and with two Host lines the first one won.
    env = {k: v for k, v in LIMITS.items() if k != "TURNLOG_API_TOKENS"}
    server = server_process(fresh_database("sqlite"), env)
    asyncio.run(server.wait_ready())

    def status(request: bytes) -> tuple[int, bytes]:
        sock = connect(server)
        sock.sendall(request)
        answer = read_all(sock, time.monotonic() + 10)
        sock.close()
        return int(answer.split(b" ", 2)[1]), answer

    for target, host, expected in [
        (b"http://evil.com/v1/sessions", b"localhost", 421),
        (b"HTTPS://EVIL.COM/v1/sessions", b"localhost", 421),
        (b"http://localhost/v1/sessions", b"evil.com", 200),  # the target names it
        (b"http://[::1]:8000/v1/sessions", b"evil.com", 200),  # an IPv6 loopback
        (b"/v1/sessions", b"localhost", 200),
    ]:
        code, answer = status(b"GET " + target + b" HTTP/1.1\r\nHost: " + host
                              + b"\r\nConnection: close\r\n\r\n")
        assert code == expected, (target, host, answer[:300])
    code, answer = status(b"GET /v1/sessions HTTP/1.1\r\nHost: localhost\r\nHost: evil.com"
                          b"\r\nConnection: close\r\n\r\n")
    assert code == 400, answer[:300]
    problem = json.loads(answer.removesuffix(b"<closed>").partition(b"\r\n\r\n")[2])
    assert problem["field"] == "Host" and problem["status"] == 400


def test_a_websocket_handshake_is_a_403_problem(server):
    # A tester's finding (on the gateway; the server answered the same): a handshake got
    # an empty text/plain 403, not a problem+json saying what to use instead.
    with connect(server) as sock:
        sock.sendall(b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     b"Sec-WebSocket-Version: 13\r\n\r\n")
        reply = read_all(sock, time.monotonic() + 5)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403"), reply[:300]
    assert b"content-type: application/problem+json" in head.lower(), head
    problem = json.loads(body.removesuffix(b"<closed>"))
    assert problem["type"] == "urn:turnlog:websocket-refused", problem
    assert "GET /v1/events?wait=" in problem["detail"], problem
