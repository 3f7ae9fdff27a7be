"""The blocking facade for trainers: `SyncTurnlogClient`.

Owns running a `TurnlogClient` on a private event loop in a daemon thread
and turning each of its calls into a blocking one (async iterators into
generators). Refuses to own any call, argument or retry: every method is
the async client's, bound by name, so the two can never drift apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from turnlog_client.async_client import Claim, TurnlogClient

__all__ = ["SyncClaim", "SyncTurnlogClient"]

_T = TypeVar("_T")


class SyncClaim:
    """A claim as `SyncTurnlogClient` hands it out: `ack()` and `release()` block, as
    every call of the sync client does (the async `Claim`'s would only return a
    coroutine: a release that did nothing, then an ack at the end of a `with`).
    Its fields are the claim's; `step` set here is set there."""

    def __init__(self, claim: Claim, run: Callable[[Awaitable[Any]], Any]) -> None:
        self._claim = claim
        self._run = run

    @property
    def group(self) -> str:
        return self._claim.group

    @property
    def claim_id(self) -> str:
        return self._claim.claim_id

    @property
    def epoch(self) -> int:
        return self._claim.epoch

    @property
    def expires_at(self) -> str:
        return self._claim.expires_at

    @property
    def sessions(self) -> list[str]:
        return self._claim.sessions

    @property
    def settled(self) -> bool:
        return self._claim.settled

    @property
    def step(self) -> int | None:
        return self._claim.step

    @step.setter
    def step(self, value: int | None) -> None:
        self._claim.step = value

    def ack(self, sessions: list[str] | None = None, step: int | None = None) -> list[str]:
        """Acknowledge (all, or `sessions`); 409 `lease-lost` if another claim won."""
        acked: list[str] = self._run(self._claim.ack(sessions, step))
        return acked

    def release(self, sessions: list[str] | None = None) -> list[str]:
        """Give the sessions back at once (all, or `sessions`)."""
        released: list[str] = self._run(self._claim.release(sessions))
        return released

    def __repr__(self) -> str:
        return f"Sync{self._claim!r}"


class SyncTurnlogClient:
    """Blocking facade for trainers: the async client on a private event loop in a
    daemon thread. Same methods and arguments; iterators become generators."""

    def __init__(self, base_url: str, token: str | None = None, **options: Any) -> None:
        with contextlib.suppress(RuntimeError):  # no running loop: the expected case
            asyncio.get_running_loop()
            warnings.warn("SyncTurnlogClient blocks its caller: inside a running event loop "
                          "every call stalls that loop; use TurnlogClient (async) there",
                          RuntimeWarning, stacklevel=2)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="turnlog-client", daemon=True)
        self._thread.start()
        try:
            self._client: TurnlogClient = self._run(self._make(base_url, token, options))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            raise

    @staticmethod
    async def _make(base_url: str, token: str | None, options: dict[str, Any]) -> TurnlogClient:
        return TurnlogClient(base_url, token, **options)

    def _run(self, awaitable: Awaitable[_T]) -> _T:
        if self._loop.is_closed():
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # never to run: not left to warn it was never awaited
            raise RuntimeError("this SyncTurnlogClient was shut down: make a new one")

        async def call() -> _T:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result()

    def _blocking(self, value: Any) -> Any:
        """A result as the sync client gives it: a `Claim` as a `SyncClaim`."""
        return SyncClaim(value, self._run) if isinstance(value, Claim) else value

    def _iterate(self, iterator: AsyncIterator[_T]) -> Iterator[Any]:
        try:
            while True:
                try:
                    yield self._blocking(self._run(iterator.__anext__()))
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None and self._loop.is_running():
                self._run(aclose())

    def shutdown(self) -> None:
        """Close the connections and stop the private loop (`close` closes a session)."""
        if not self._loop.is_running():
            return
        self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> SyncTurnlogClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.shutdown()

    def _bind(name: str) -> Callable[..., Any]:  # type: ignore[misc]
        def method(self: SyncTurnlogClient, *args: Any, **kwargs: Any) -> Any:
            return self._blocking(self._run(getattr(self._client, name)(*args, **kwargs)))

        method.__name__ = name
        method.__doc__ = getattr(TurnlogClient, name).__doc__
        return method

    def _bind_iter(name: str) -> Callable[..., Any]:  # type: ignore[misc]
        def method(self: SyncTurnlogClient, *args: Any, **kwargs: Any) -> Any:
            return self._iterate(getattr(self._client, name)(*args, **kwargs))

        method.__name__ = name
        method.__doc__ = getattr(TurnlogClient, name).__doc__
        return method

    open = _bind("open")
    append = _bind("append")
    append_body = _bind("append_body")
    close = _bind("close")
    record_reward = _bind("record_reward")
    session = _bind("session")
    state = _bind("state")
    resume = _bind("resume")
    events = _bind("events")
    all_events = _bind("all_events")
    sessions = _bind("sessions")
    samples = _bind("samples")
    r3 = _bind("r3")
    feed = _bind("feed")
    ready = _bind("ready")
    submit_history = _bind("submit_history")
    metric_history = _bind("metric_history")
    evaluate_gates = _bind("evaluate_gates")
    iter_sessions = _bind_iter("iter_sessions")
    follow = _bind_iter("follow")
    follow_pages = _bind_iter("follow_pages")
    define_group = _bind("define_group")
    group = _bind("group")
    groups = _bind("groups")
    acks = _bind("acks")
    claim_sessions = _bind("claim_sessions")
    ack = _bind("ack")
    release = _bind("release")
    samples_wire = _bind("samples_wire")
    r3_slice = _bind("r3_slice")
    iter_claims = _bind_iter("iter_claims")
    del _bind, _bind_iter

    @contextlib.contextmanager
    def claim(self, group: str, **options: Any) -> Iterator[SyncClaim]:
        """`with tl.claim(group, limit=32) as c:` — acknowledged with `c.step` when
        the block succeeds, released when it raises; `c.ack()` or `c.release()` in
        the block settles it there instead."""
        context = self._client.claim(group, **options)
        claim = SyncClaim(self._run(context.__aenter__()), self._run)
        try:
            yield claim
        except BaseException as exc:
            self._run(context.__aexit__(type(exc), exc, exc.__traceback__))
            raise
        self._run(context.__aexit__(None, None, None))
