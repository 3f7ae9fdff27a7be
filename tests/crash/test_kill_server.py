"""SIGKILL the server at random moments while four clients append.

`python -m app serve` runs as a real subprocess; a supervisor kills it with
SIGKILL (no shutdown, no flush) a few times while appends are in flight and
restarts it on the same port. The clients (`turnlog_client`, retries on) play
simulated sessions in both R3 modes, v1 and v2, half of them letting the
client generate the event ids. Afterwards every session holds exactly the
turns its client sent (no loss, no duplicate, JSON-equal records), the feed
shows each event once, and samples and R3 tensors equal an uninterrupted
in-memory run of the same bodies. PostgreSQL runs with group commit on (the
default) and off: a kill during a group's commit must not lose or double an
acknowledged turn either."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter

import httpx
import pytest

from tests.crash.conftest import Played, check_session, play, simulator
from turnlog_client import TurnlogClient

KILLS = 3


class FailureCounter(httpx.AsyncBaseTransport):
    """The real HTTP transport, counting requests whose connection died with the
    server (mid-request, or a keep-alive connection it left behind) apart from
    those refused while it was down, and appends answered as repeats (200):
    turns committed by a server that was killed before it could reply."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.failures: Counter[str] = Counter()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await self.inner.handle_async_request(request)
        except httpx.ConnectError:
            self.failures["refused"] += 1
            raise
        except httpx.TransportError:
            self.failures["in_flight"] += 1
            raise
        if response.status_code == 200 and request.url.path.endswith("/turns"):
            self.failures["repeated_append"] += 1
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()
TURNS = 10
CLIENTS = 4


# PostgreSQL runs twice: with group commit (the default; a wider window, more clients and
# a group whenever a commit is in flight, so that appends of several sessions do share
# commits when the kill comes) and with one transaction per append.
RUNS = {
    "sqlite": ("sqlite", {}, CLIENTS),
    "postgres": ("postgres", {"TURNLOG_GROUP_COMMIT_WINDOW_US": "2000",
                              "TURNLOG_GROUP_COMMIT_SIBLINGS": "1",
                              "TURNLOG_LOG_LEVEL": "debug"}, 2 * CLIENTS),
    "postgres-no-group": ("postgres", {"TURNLOG_GROUP_COMMIT_WINDOW_US": "0"}, CLIENTS),
}


@pytest.mark.parametrize("run", list(RUNS))
async def test_sigkilled_server_loses_and_duplicates_nothing(fresh_database, server_process,
                                                             run):
    backend, env, clients = RUNS[run]
    server = server_process(fresh_database(backend), env)
    await server.wait_ready()
    rng = random.Random(run)
    appended = 0
    stop = asyncio.Event()
    played: list[Played] = []
    transports: list[FailureCounter] = []

    def count() -> None:
        nonlocal appended
        appended += 1

    def client() -> TurnlogClient:
        transports.append(FailureCounter())
        return TurnlogClient(server.base_url, timeout=10, retries=10_000, retry_deadline=90,
                             backoff=0.05, max_backoff=0.5, transport=transports[-1])

    async def worker(index: int) -> None:
        async with client() as tl:
            n = 0
            while not stop.is_set() or n == 0:
                sim = simulator(f"kill-{backend}-{index}-{n}-{uuid.uuid4().hex[:6]}",
                                index + n, rng.randrange(2**32))
                played.append(await play(tl, sim, TURNS, generated_ids=index % 2 == 1,
                                         on_append=count))
                n += 1

    async def supervisor() -> None:
        for _ in range(KILLS):
            # Kill only once the clients are appending again after the last restart.
            seen = appended
            deadline = time.monotonic() + 60
            while appended < seen + 3:
                assert time.monotonic() < deadline, "clients made no progress"
                await asyncio.sleep(0.01)
            await asyncio.sleep(rng.uniform(0.0, 0.3))
            server.kill()
            server.start()
            await server.wait_ready()
        stop.set()

    await asyncio.wait_for(
        asyncio.gather(supervisor(), *(worker(i) for i in range(clients))), 150)
    assert server.starts == KILLS + 1
    failures = sum((t.failures for t in transports), Counter())
    groups = server.log_path.read_text(errors="replace").count("group committed")
    print(f"{run}: {appended} appends, {len(played)} sessions, client failures {failures}, "
          f"{groups} group commits of several sessions")
    assert failures["in_flight"] > 0, "no kill caught a request in flight"
    if env.get("TURNLOG_GROUP_COMMIT_WINDOW_US", "0") != "0":
        assert groups > 0, "no appends of several sessions shared a commit"

    async with client() as tl:
        assert (await tl.ready())["status"] == "ready"
        for item in played:
            await check_session(tl, item)
        turns: Counter[str] = Counter()
        positions: list[int] = []
        async for event in tl.follow(wait=0, until_idle=True, limit=1000):
            positions.append(event["position"])
            if event["type"] == "turn_recorded":
                turns[event["session_id"]] += 1
        assert len(positions) == len(set(positions)), "the feed repeated an event"
        assert turns == {item.session_id: len(item.bodies) for item in played}
