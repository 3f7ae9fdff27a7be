"""Client-side failures and the one retry policy that decides whether to resend.

Owns the error types a `TurnlogClient` call raises — `TurnlogError`, the
server's problem+json (`slug`, `status`, `field`, `expected`, `actual`), and
`TurnlogConnectionError`, a transport failure that outlasted the retries —
and the policy (tenacity): bounded exponential backoff with full jitter,
never shorter than a `Retry-After`, resending only errors that are
`retryable` (connection errors, timeouts, 5xx but a write's own
`deadline-exceeded`, whose resend would get a new deadline, and a recording
gateway's `spool-full`; never 4xx). Both error types
carry the `event_id` of the turn they were appending, so a caller that did
not choose one can still resend the same turn later without a duplicate.

Refuses to own the wire: sending requests and reading a response into an
error are `transport.py`'s, making writes idempotent `async_client.py`'s;
nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)
from tenacity.stop import stop_base

__all__ = ["Backoff", "TurnlogConnectionError", "TurnlogError", "retrying"]

URN = "urn:turnlog:"
# Not worth retrying: the request itself is wrong (bad URL, bad proxy setup).
_PERMANENT_TRANSPORT = (httpx.UnsupportedProtocol, httpx.LocalProtocolError, httpx.ProxyError)


# 5xx answers a resend would not change: a write's own deadline missed, a gateway's
# spool full.
NOT_RESENT = frozenset({"deadline-exceeded", "spool-full"})


class TurnlogError(Exception):
    """An answer that is not a success, as the server's problem+json.

    `slug` is the part after `urn:turnlog:` (`"session-closed"`, `"r3-gap"`, …);
    `problem` is the whole body, including rule-specific extras.
    """

    def __init__(self, problem: Mapping[str, Any], *, retry_after: float | None = None,
                 event_id: str | None = None) -> None:
        self.problem: dict[str, Any] = dict(problem)
        self.type: str = str(self.problem.get("type", "about:blank"))
        self.slug: str = self.type.removeprefix(URN)
        status = self.problem.get("status")
        self.status: int | None = status if isinstance(status, int) else None
        self.title: str = str(self.problem.get("title", ""))
        self.detail: str = str(self.problem.get("detail", ""))
        self.field: str | None = self.problem.get("field")
        self.expected: Any = self.problem.get("expected")
        self.actual: Any = self.problem.get("actual")
        self.retry_after = retry_after
        self.event_id = event_id
        # No status: turnlog was not reached (`connection-failed`), nothing answered.
        said = self.slug if self.status is None else f"{self.status} {self.slug}"
        super().__init__(f"{said}: {self.detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the problem, not from `args` (the message): an error raised in a
        # worker process (a ProcessPoolExecutor, multiprocessing, Ray) crosses intact.
        return (_rebuild, (type(self), self.problem, self.retry_after, self.event_id,
                           self.__dict__, self.args))

    @property
    def retryable(self) -> bool:
        # A write refused for its `X-Turnlog-Timeout` is not resent: the resend would be
        # carried out within a new timeout, later than the caller asked for. Nor is one a
        # recording gateway could neither carry out nor spool: its spool stays full for
        # longer than a resend waits.
        return self.status is not None and self.status >= 500 \
            and self.slug not in NOT_RESENT


class TurnlogConnectionError(TurnlogError):
    """The server could not be reached or did not answer in time (after the retries).

    Its `__cause__` is the httpx exception; `status` is None; `url` is the server
    the client was pointed at. The message names that URL and, when nothing
    answered there, how to start a server.
    """

    def __init__(self, cause: httpx.TransportError, *, url: str | None = None,
                 event_id: str | None = None) -> None:
        where = f"turnlog at {url}" if url else "the turnlog server"
        if isinstance(cause, httpx.TimeoutException):
            detail = f"{where} did not answer in time ({_cause_text(cause)})"
        else:
            detail = f"cannot reach {where} ({_cause_text(cause)})"
        if isinstance(cause, httpx.ConnectError):
            detail += ("; is a server running there? Start one with `turnlog serve`"
                       " (or point the client at the right URL)")
        super().__init__({"type": f"{URN}connection-failed", "title": "Connection failed",
                          "detail": detail}, event_id=event_id)
        self.url = url
        self.transient = not isinstance(cause, _PERMANENT_TRANSPORT)
        # No status to show: the message is the slug and the detail alone.
        self.args = (f"{self.slug}: {detail}",)

    @property
    def retryable(self) -> bool:
        return self.transient


def _cause_text(cause: httpx.TransportError) -> str:
    text = str(cause)
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


class Backoff:
    """Full-jitter exponential backoff, but never shorter than a `Retry-After`."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.jitter = wait_random_exponential(multiplier=initial, max=maximum)
        self.maximum = maximum

    def __call__(self, state: RetryCallState) -> float:
        delay = float(self.jitter(state))
        exc = state.outcome.exception() if state.outcome is not None else None
        hint = getattr(exc, "retry_after", None)
        if hint:
            delay = max(delay, min(float(hint), self.maximum))
        return delay


def retrying(retries: int, deadline: float | None, wait: Backoff) -> AsyncRetrying:
    """Up to `retries` resends after the first attempt (within `deadline` seconds if
    given) while the error is a `retryable` `TurnlogError`; the last one is re-raised."""
    stop: stop_base = stop_after_attempt(retries + 1)
    if deadline is not None:
        stop = stop | stop_after_delay(deadline)
    return AsyncRetrying(
        stop=stop,
        wait=wait,
        retry=retry_if_exception(lambda exc: isinstance(exc, TurnlogError) and exc.retryable),
        reraise=True,
    )


def _rebuild(cls: type[TurnlogError], problem: dict[str, Any], retry_after: float | None,
             event_id: str | None, state: dict[str, Any],
             args: tuple[Any, ...]) -> TurnlogError:
    """A pickled `TurnlogError` (or subclass) as it was, without calling its own
    constructor (a `TurnlogConnectionError`'s takes the httpx exception, gone by now)."""
    error = cls.__new__(cls)
    TurnlogError.__init__(error, problem, retry_after=retry_after, event_id=event_id)
    error.__dict__.update(state)
    error.args = args  # the message as the subclass made it
    return error
