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
from typing import Any, Concatenate, ParamSpec, TypeVar

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


# Each method is the async client's, found by name on the instance's client when
# called, and typed from it: mypy checks a sync call's arguments as the async one's.
_P = ParamSpec("_P")


def _named(method: Callable[..., Any], like: Callable[..., Any]) -> None:
    """`method` shows as `like` does (`help()`, `inspect.signature`)."""
    method.__name__ = like.__name__
    method.__qualname__ = f"SyncTurnlogClient.{like.__name__}"
    method.__doc__ = like.__doc__
    method.__signature__ = inspect.signature(like)  # type: ignore[attr-defined]


def _call(fn: Callable[Concatenate[TurnlogClient, _P], Awaitable[_T]]
          ) -> Callable[Concatenate[SyncTurnlogClient, _P], _T]:
    def method(self: SyncTurnlogClient, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        result: _T = self._run(getattr(self._client, fn.__name__)(*args, **kwargs))
        return result

    _named(method, fn)
    return method


def _claim_call(fn: Callable[Concatenate[TurnlogClient, _P], Awaitable[Claim]]
                ) -> Callable[Concatenate[SyncTurnlogClient, _P], SyncClaim]:
    def method(self: SyncTurnlogClient, /, *args: _P.args, **kwargs: _P.kwargs) -> SyncClaim:
        claim = self._run(getattr(self._client, fn.__name__)(*args, **kwargs))
        return SyncClaim(claim, self._run)

    _named(method, fn)
    return method


def _iterated(fn: Callable[Concatenate[TurnlogClient, _P], AsyncIterator[_T]]
              ) -> Callable[Concatenate[SyncTurnlogClient, _P], Iterator[_T]]:
    def method(self: SyncTurnlogClient, /, *args: _P.args, **kwargs: _P.kwargs
               ) -> Iterator[_T]:
        return self._iterate(getattr(self._client, fn.__name__)(*args, **kwargs))

    _named(method, fn)
    return method


def _claims_iterated(fn: Callable[Concatenate[TurnlogClient, _P], AsyncIterator[Claim]]
                     ) -> Callable[Concatenate[SyncTurnlogClient, _P], Iterator[SyncClaim]]:
    def method(self: SyncTurnlogClient, /, *args: _P.args, **kwargs: _P.kwargs
               ) -> Iterator[SyncClaim]:
        for claim in self._iterate(getattr(self._client, fn.__name__)(*args, **kwargs)):
            yield SyncClaim(claim, self._run)

    _named(method, fn)
    return method


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

    open = _call(TurnlogClient.open)
    append = _call(TurnlogClient.append)
    append_body = _call(TurnlogClient.append_body)
    close = _call(TurnlogClient.close)
    record_reward = _call(TurnlogClient.record_reward)
    session = _call(TurnlogClient.session)
    state = _call(TurnlogClient.state)
    resume = _call(TurnlogClient.resume)
    events = _call(TurnlogClient.events)
    all_events = _call(TurnlogClient.all_events)
    sessions = _call(TurnlogClient.sessions)
    samples = _call(TurnlogClient.samples)
    r3 = _call(TurnlogClient.r3)
    feed = _call(TurnlogClient.feed)
    ready = _call(TurnlogClient.ready)
    submit_history = _call(TurnlogClient.submit_history)
    metric_history = _call(TurnlogClient.metric_history)
    evaluate_gates = _call(TurnlogClient.evaluate_gates)
    iter_sessions = _iterated(TurnlogClient.iter_sessions)
    follow = _iterated(TurnlogClient.follow)
    follow_pages = _iterated(TurnlogClient.follow_pages)
    define_group = _call(TurnlogClient.define_group)
    group = _call(TurnlogClient.group)
    groups = _call(TurnlogClient.groups)
    acks = _call(TurnlogClient.acks)
    claim_sessions = _claim_call(TurnlogClient.claim_sessions)
    ack = _call(TurnlogClient.ack)
    release = _call(TurnlogClient.release)
    samples_wire = _call(TurnlogClient.samples_wire)
    r3_slice = _call(TurnlogClient.r3_slice)
    iter_claims = _claims_iterated(TurnlogClient.iter_claims)

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
