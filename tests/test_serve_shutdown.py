"""`turnlog serve` stopped (SIGTERM) while a request only waits: a feed's long poll (the
API's feed and the UI's live list alike) is answered at once with its page as it
stands, a trainer's waiting claim as when its wait runs out, and the server exits on
its own, instead of holding the shutdown for the rest of the wait (up to 30 s: a
deploy's grace period, and every test process's end, waited for it).

Oracle: the poll's answer and the server's exit status (it ended by itself, on the
SIGTERM uvicorn passes on once it has shut down; a SIGKILL after the stop's timeout
would show as -9)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serverproc import ServerProcess, turnlog_serve

WAIT_S = 30  # the longest poll the feed holds
STOP_TIMEOUT_S = 20  # shorter than the poll: a server waiting it out is killed


def answer_while_stopping(server: ServerProcess, wait: Callable[[], httpx.Response]
                         ) -> httpx.Response:
    """`wait()` (a request that waits on the server) sent from a thread; the server
    stopped while it waits: its answer, once the server has ended by itself."""
    answer: dict[str, Any] = {}

    def send() -> None:
        try:
            answer["reply"] = wait()
        except httpx.HTTPError as exc:
            answer["error"] = exc

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    time.sleep(1.0)  # the request is waiting on the server
    assert sender.is_alive()
    server.stop(timeout=STOP_TIMEOUT_S)
    sender.join(10)
    assert server.proc is not None
    assert server.proc.returncode in (0, -signal.SIGTERM), server.log_tail()
    assert "error" not in answer, answer
    reply: httpx.Response = answer["reply"]
    return reply


@pytest.mark.parametrize("path", ["/v1/events", "/ui/feed"])  # the API's, the live list's
def test_a_long_poll_does_not_hold_the_shutdown(tmp_path: Path, path: str) -> None:
    server = turnlog_serve(f"sqlite:///{tmp_path / 'feed.db'}", tmp_path / "serve.log")
    server.start()
    try:
        server.wait_ready_sync()
        first = httpx.get(f"{server.url}/v1/events", timeout=10)
        assert first.status_code == 200, first.text
        cursor = first.json()["next"]
        reply = answer_while_stopping(server, lambda: httpx.get(
            f"{server.url}{path}", params={"after": cursor, "wait": WAIT_S}, timeout=60))
        assert reply.status_code == 200, reply.text
        # Nothing arrived: the page is empty, and the cursor to poll again is the same.
        assert reply.json() == {"events": [], "next": cursor}
    finally:
        server.stop()


def test_a_waiting_claim_does_not_hold_the_shutdown(tmp_path: Path) -> None:
    """A trainer's claim waiting for a closed session is answered as when its wait runs
    out: an empty claim, 201."""
    server = turnlog_serve(f"sqlite:///{tmp_path / 'claims.db'}", tmp_path / "serve.log")
    server.start()
    try:
        server.wait_ready_sync()
        made = httpx.put(f"{server.url}/v1/consumers/trainer", json={"labels": {}}, timeout=10)
        assert made.status_code in (200, 201), made.text
        reply = answer_while_stopping(server, lambda: httpx.post(
            f"{server.url}/v1/consumers/trainer/claims",
            json={"claim_id": "step-1", "limit": 4, "wait": WAIT_S}, timeout=60))
        assert reply.status_code == 201, reply.text
        assert reply.json()["sessions"] == []
    finally:
        server.stop()
