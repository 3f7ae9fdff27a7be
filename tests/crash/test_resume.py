"""A restarted session server resumes from `GET …/state` and finishes the session
exactly as if it had never crashed.

A toy session server builds each turn from its own checkpoint (the previous
turn's tokens) and, in addition mode, asks for R3 rows from
`len(checkpoint) - 1` on. One run goes through uninterrupted; the other
"crashes" after k turns (the client and every bit of memory are dropped), and
a new client carries on from `resume()` alone. Both sessions yield the same
samples, and their R3 equals a full forward over the sample's tokens."""

from __future__ import annotations

import base64
import random
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np
import pytest

from app.main import create_app
from app.sim.simulator import OUTPUT_BASE, VOCAB, route
from turnlog_client import TurnlogClient

LAYERS, TOPK, EXPERTS = 3, 2, 16
TURNS, CRASH_AFTER = 6, 3


@pytest.fixture
async def connect(settings) -> AsyncIterator[Callable[[], TurnlogClient]]:
    """New clients of one in-process app: each stands for a (re)started session server."""
    app = create_app(settings)
    clients: list[TurnlogClient] = []

    def make() -> TurnlogClient:
        clients.append(TurnlogClient("http://turnlog",
                                     transport=httpx.ASGITransport(app=app)))
        return clients[-1]

    yield make
    for client in clients:
        await client.aclose()
    await app.state.services.db.dispose()


def toy_turn(index: int, checkpoint: list[int], start: int | None) -> dict[str, Any]:
    """Turn `index` of the toy session: deterministic in `index` and the checkpoint,
    so both runs send identical bodies when they stand at the same place."""
    rng = random.Random(index)
    prompt = checkpoint + [rng.randrange(1, OUTPUT_BASE) for _ in range(rng.randint(1, 5))]
    output = [rng.randrange(OUTPUT_BASE, VOCAB) for _ in range(rng.randint(1, 6))]
    tokens = np.asarray(prompt + output, dtype=np.int64)
    rows = route(tokens, LAYERS, TOPK, EXPERTS)[start or 0:]
    request: dict[str, Any] = {"model": "default", "input_ids": prompt,
                               "return_routed_experts": True}
    if start is not None:
        request["routed_experts_start_len"] = start
    meta = {
        "output_token_logprobs": [[-0.01 * (i + 1), tok] for i, tok in enumerate(output)],
        "completion_tokens": len(output),
        "weight_version": str(1 + index // 2),
        "routed_experts": base64.b64encode(rows.astype("<i4").tobytes()).decode("ascii"),
    }
    return {
        "event_id": f"turn-{index}",
        "record": {"timestamp": 1755800000.0 + index, "request": request,
                   "response": {"choices": [{"finish_reason": "stop",
                                             "message": {"role": "assistant", "content": "x"},
                                             "meta_info": meta}]}},
    }


class ToySessionServer:
    """Keeps the checkpoint in memory, like miles' session server (and loses it on a crash)."""

    def __init__(self, client: TurnlogClient, session_id: str, addition: bool,
                 checkpoint: list[int] | None = None) -> None:
        self.client = client
        self.session_id = session_id
        self.addition = addition
        self.checkpoint = checkpoint or []

    def next_start(self) -> int | None:
        return max(len(self.checkpoint) - 1, 0) if self.addition else None

    async def turn(self, index: int) -> None:
        body = toy_turn(index, self.checkpoint, self.next_start())
        reply = await self.client.append_body(self.session_id, body)
        assert reply["seq"] == index
        output = [tok for _, tok in
                  body["record"]["response"]["choices"][0]["meta_info"]["output_token_logprobs"]]
        self.checkpoint = body["record"]["request"]["input_ids"] + output


async def open_session(client: TurnlogClient, version: str, mode: str) -> str:
    summary = await client.open(version=version, pause_generation_mode=mode,
                                r3={"num_layers": LAYERS}, session_id=f"res-{uuid.uuid4().hex}")
    return str(summary["session_id"])


@pytest.mark.parametrize(("version", "mode"), [("v1", "in_place"), ("v2", "in_place"),
                                               ("v1", "retract"), ("v2", "retract")])
async def test_resumed_session_equals_uninterrupted_one(connect, version, mode):
    addition = mode == "in_place"

    whole = ToySessionServer(connect(), await open_session(connect(), version, mode), addition)
    for index in range(TURNS):
        await whole.turn(index)
    await whole.client.close(whole.session_id, metadata={"reward": 1.0})

    first = ToySessionServer(connect(), await open_session(connect(), version, mode), addition)
    for index in range(CRASH_AFTER):
        await first.turn(index)
    expected_checkpoint = first.checkpoint
    sid = first.session_id
    await first.client.aclose()
    del first  # the crash: nothing of the old session server survives

    client = connect()
    state = await client.resume(sid)
    assert state["status"] == "open"
    assert state["active_leaf"] == CRASH_AFTER - 1
    assert state["num_nodes"] == CRASH_AFTER
    assert state["checkpoint_token_ids"] == expected_checkpoint
    assert state["use_addition_r3"] is addition
    rows = len(expected_checkpoint) - 1
    assert state["next_routed_experts_start_len"] == (rows if addition else None)
    assert state["covered_r3_rows"] == rows

    resumed = ToySessionServer(client, sid, addition, state["checkpoint_token_ids"])
    assert resumed.next_start() == state["next_routed_experts_start_len"]
    for index in range(CRASH_AFTER, TURNS):
        await resumed.turn(index)
    await client.close(sid, metadata={"reward": 1.0})

    got, want = await client.samples(sid), await client.samples(whole.session_id)
    assert {**got, "session_id": None} == {**want, "session_id": None}
    assert len(got["samples"]) == 1  # a linear session: one path
    for sample in got["samples"]:
        tensor = await client.r3(sid, sample["index"])
        assert tensor.shape == (len(sample["tokens"]) - 1, LAYERS, TOPK)
        assert tensor.tobytes() == (await client.r3(whole.session_id, sample["index"])).tobytes()
        assert tensor.tobytes() == route(np.asarray(sample["tokens"]), LAYERS, TOPK,
                                         EXPERTS).tobytes()
