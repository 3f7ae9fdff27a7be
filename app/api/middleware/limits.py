"""Body size and time limits, enforced before any body is parsed (pure ASGI middleware);
a body with a content coding (`Content-Encoding: gzip`, …) is a 415 before it is read.

Each read of a body that is still arriving must deliver within `timeout`
seconds, and the body must keep a minimum pace (byte n within `grace + n /
min_rate` seconds of the first read), or the request is answered 408 and its
connection closed: a client that declares 1,000 bytes and sends 10, or sends
them a byte every 25 s, no longer holds a connection forever.
Once the body is complete, reads pass through untimed (a streaming reply
listens for the disconnect for as long as it runs). One timer per request
keeps the time (`ReadWatch`), not a timeout scope per read.

`WriteDeadline` reads the `X-Turnlog-Timeout` of an open, a close or a reward
(400 if malformed) and makes its writes commit within that many seconds or not
at all (the store's `write_deadline`). Other routes ignore the header: a turn's
append, a repeat of which is answered as one, needs no deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.http_errors import RequestTimeout
from app.api.problem_wire import send_problem
from app.domain.body.deadline import TIMEOUT_HEADER_KEY, keeps_deadline, parse_timeout
from app.domain.body.pace import MinPace
from app.domain.errors import InvalidRequest, TooLarge
from app.domain.wire.media import coded_body
from app.store.engine.db import write_deadline


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float | None = None,
                 min_rate: int = 0, grace: float = 10.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        # Every body keeps a minimum pace too, from its first read (`MinPace`).
        self.pace = MinPace(min_rate, grace)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_problem(send, self._error(int(declared)))
            return
        coded = coded_body(headers)
        if coded is not None:
            await send_problem(send, coded)
            return
        seen, complete = 0, False
        watch = ReadWatch(self.timeout) if self.timeout is not None else None
        started: float | None = None

        def pace_due() -> float:
            assert started is not None
            return started + self.pace.due(seen)

        async def counted() -> Message:
            # A chunked body without Content-Length is counted as it streams in; the
            # domain error reaches the problem+json handler before anything is parsed.
            nonlocal seen, complete, started
            if complete or watch is None:
                message = await receive()
            else:
                if started is None and self.pace:
                    started = watch.loop.time()
                    watch.pace_due = pace_due
                try:
                    message = await watch.read(receive)
                except TimeoutError:
                    if started is not None and watch.loop.time() >= pace_due():
                        raise self.pace.too_slow(seen, watch.loop.time() - started,
                                                 RequestTimeout) from None
                    raise body_silent(watch.timeout, seen) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > self.max_bytes:
                    raise self._error(seen)
            else:
                complete = True
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if watch is not None:
                watch.close()

    def _error(self, size: int) -> TooLarge:
        return TooLarge(
            f"request body exceeds the limit of {self.max_bytes} bytes",
            field="body", expected=f"at most {self.max_bytes} bytes", actual=size,
        )


def body_silent(timeout: float, seen: int) -> RequestTimeout:
    """A body that stopped arriving: no byte for `timeout` seconds after `seen`."""
    return RequestTimeout(
        f"request body not received: no data for {timeout} s",
        field="body", expected=f"the next bytes within {timeout} s",
        actual=f"{seen} bytes, then silence")


class ReadWatch:
    """Each read of one request's body bounded by `timeout` seconds, with one timer
    for the request instead of a timeout scope per read (a 3 MB body arrives in ~50).

    The timer is armed by the first read and, when it fires, re-armed for the read
    then in progress (or left unarmed between reads, until the next one); a read
    that has waited `timeout` seconds is cancelled and raises `TimeoutError`, as
    `asyncio.timeout` would (its task's other cancellations pass through).
    """

    def __init__(self, timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.timeout = timeout
        # When the body's next byte is due by its minimum pace (loop time), if it has one.
        self.pace_due: Callable[[], float] | None = None
        self.since: float | None = None  # when the read in progress began
        self.task: asyncio.Task[Any] | None = None
        self.handle: asyncio.TimerHandle | None = None
        self.expired = False

    async def read(self, receive: Receive) -> Message:
        task = asyncio.current_task()
        assert task is not None
        self.task, self.since, self.expired = task, self.loop.time(), False
        cancelling = task.cancelling()
        if self.handle is None:
            self.handle = self.loop.call_at(self._deadline(self.since), self._due)
        try:
            return await receive()
        except asyncio.CancelledError:
            if self.expired and task.uncancel() <= cancelling:
                raise TimeoutError from None
            raise
        finally:
            self.since = None

    def _due(self) -> None:
        self.handle = None
        if self.since is None or self.task is None:
            return  # between reads: the next one arms the timer again
        due = self._deadline(self.since)
        if self.loop.time() < due:
            self.handle = self.loop.call_at(due, self._due)
            return
        self.expired = True
        self.task.cancel()

    def _deadline(self, since: float) -> float:
        """The read begun at `since` is due: `timeout` after it, or sooner by the pace."""
        due = since + self.timeout
        return due if self.pace_due is None else min(due, self.pace_due())

    def close(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class WriteDeadline:
    """A request's `X-Turnlog-Timeout`: its writes commit within it or not at all."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        values = [v.decode("latin-1") for k, v in scope.get("headers") or ()
                  if k == TIMEOUT_HEADER_KEY]
        if not values or not keeps_deadline(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            seconds = parse_timeout(values)
        except InvalidRequest as error:
            await send_problem(send, error)
            return
        with write_deadline(seconds):
            await self.app(scope, receive, send)
