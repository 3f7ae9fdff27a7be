"""The blocking facade for trainers: `SyncTurnlogClient`.

Owns running a `TurnlogClient` on a private event loop in a daemon thread
and turning each of its calls into a blocking one (async iterators into
generators). Refuses to own any call, argument or retry: every method is
the async client's, bound by name, so the two can never drift apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from turnlog_client.async_client import Claim, TurnlogClient

__all__ = ["SyncTurnlogClient"]

_T = TypeVar("_T")


class SyncTurnlogClient:
    """Blocking facade for trainers: the async client on a private event loop in a
    daemon thread. Same methods and arguments; iterators become generators."""

    def __init__(self, base_url: str, token: str | None = None, **options: Any) -> None:
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
        async def call() -> _T:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result()

    def _iterate(self, iterator: AsyncIterator[_T]) -> Iterator[_T]:
        try:
            while True:
                try:
                    yield self._run(iterator.__anext__())
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
            return self._run(getattr(self._client, name)(*args, **kwargs))

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
    def claim(self, group: str, **options: Any) -> Iterator[Claim]:
        """`with tl.claim(group, limit=32) as c:` — acknowledged with `c.step` when
        the block succeeds, released when it raises."""
        context = self._client.claim(group, **options)
        claim = self._run(context.__aenter__())
        try:
            yield claim
        except BaseException as exc:
            self._run(context.__aexit__(type(exc), exc, exc.__traceback__))
            raise
        self._run(context.__aexit__(None, None, None))
