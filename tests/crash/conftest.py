"""Fixtures for the crash-safety tests: a real `turnlog serve` subprocess that can be
SIGKILLed and restarted on the same port, and simulated sessions played through
`turnlog_client` and checked against an uninterrupted in-memory run."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.domain.body.session import parse_close, parse_open
from app.domain.projection.samples import build_samples
from app.domain.wire.jsonio import strict_equal
from app.sim.simulator import SessionSimulator, SimConfig, SimRates, fold_in_memory, route
from tests.serverproc import ServerProcess, server_env, turnlog_serve
from turnlog_client import TurnlogClient


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[Any]:
    """A factory `spawn(database_url, env=None) -> ServerProcess`: `python -m app serve`
    on a fixed loopback port (restartable after a SIGKILL), started, not yet ready;
    `env` adds TURNLOG_* settings. Every server it made is stopped at teardown."""
    made: list[ServerProcess] = []

    def spawn(database_url: str, env: dict[str, str] | None = None) -> ServerProcess:
        server = turnlog_serve(database_url, tmp_path / f"server-{len(made)}.log",
                               env=server_env(env))
        made.append(server)
        server.start()
        return server

    yield spawn
    for server in made:
        server.stop()


# -- simulated sessions ------------------------------------------------------------

MODES = (("v2", "retract"), ("v1", "in_place"), ("v2", "in_place"), ("v1", "retract"))


@dataclass
class Played:
    """What a client sent for one session (bodies in append order)."""

    config: SimConfig
    open_body: dict[str, Any]
    bodies: list[dict[str, Any]] = field(default_factory=list)
    close: dict[str, Any] | None = None
    generated_ids: bool = False

    @property
    def session_id(self) -> str:
        return str(self.open_body["session_id"])


def simulator(session_id: str, index: int, seed: int) -> SessionSimulator:
    version, mode = MODES[index % len(MODES)]
    config = SimConfig(session_id=session_id, version=version, pause_generation_mode=mode,
                       speculative=True, max_trim_tokens=index % 2,
                       labels={"run_id": "crash", "rollout_id": index})
    return SessionSimulator(config, random.Random(seed), SimRates(omit_parent=0.3))


async def play(client: TurnlogClient, sim: SessionSimulator, turns: int, *,
               generated_ids: bool, on_append: Callable[[], None] | None = None) -> Played:
    """Open, append `turns` random turns and close, through the client's retries.

    With `generated_ids` the turns go without an event_id, so the client makes
    one up and its retries must reuse it.
    """
    played = Played(sim.config, sim.open_body(), generated_ids=generated_ids)
    await client.open(played.open_body)
    for _ in range(turns):
        body = sim.random_turn()
        played.bodies.append(body)
        if generated_ids:
            options: dict[str, Any] = {"metadata": body.get("metadata")}
            if "parent" in body:
                options["parent"] = body["parent"]
            await client.append(played.session_id, body["record"], **options)
        else:
            await client.append_body(played.session_id, body)
        if on_append is not None:
            on_append()
    played.close = {"max_seq_len": None, "metadata": {"reward": 1.0}}
    await client.close(played.session_id, metadata=played.close["metadata"])
    return played


async def check_session(client: TurnlogClient, played: Played) -> None:
    """The log holds exactly the turns sent, in order, and the samples and R3
    equal an uninterrupted run of the same bodies."""
    sid = played.session_id
    events = await client.all_events(sid)
    types = [e["type"] for e in events]
    assert types == (["session_opened"] + ["turn_recorded"] * len(played.bodies)
                     + ["session_closed"]), f"{sid}: {types}"
    assert strict_equal(events[0]["session"], parse_open(played.open_body).body())
    turns = events[1:-1]
    assert len({e["event_id"] for e in turns}) == len(turns), f"{sid}: duplicate event ids"
    for seq, (event, body) in enumerate(zip(turns, played.bodies, strict=True)):
        assert event["seq"] == seq
        assert strict_equal(event["record"], body["record"]), f"{sid} turn {seq}"
        assert strict_equal(event["metadata"], body.get("metadata")), f"{sid} turn {seq}"
        if not played.generated_ids:
            assert event["event_id"] == body["event_id"]
    assert played.close is not None
    assert strict_equal(events[-1]["close"], played.close)

    state, _ = fold_in_memory(played.open_body, played.bodies)
    expected = build_samples(state, parse_close(played.close)).to_json(arrays=True)
    got = await client.samples(sid)
    assert strict_equal(got, expected), f"{sid}: samples differ from an uninterrupted run"
    c = played.config
    for sample in got["samples"]:
        assert sample["r3"] is not None
        tensor = await client.r3(sid, sample["index"])
        forward = route(np.asarray(sample["tokens"]), c.num_layers or 0, c.topk, c.num_experts,
                        c.router_seed)
        assert tensor.dtype == np.dtype("<i4")
        assert tensor.tobytes() == forward.tobytes(), f"{sid} sample {sample['index']}"
