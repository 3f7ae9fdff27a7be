"""The state cache is bounded in bytes and keeps token ids as deltas (issue 13, item 6).

A cached node holds only the tokens its parent does not (as the log does);
full token arrays are rebuilt on demand and must equal the simulator's
(an independent, list-based model). The cache evicts by bytes, not only by
count. Memory and speed figures live in `bench/state_cache.py`.
"""

from __future__ import annotations

import random

import httpx
import msgspec
import numpy as np
import pytest

from app.main import create_app
from app.sim.simulator import SessionSimulator, SimConfig, SimRates
from app.store.fold.loader import StateCache
from tests.factory import open_body, r3_b64, turn
from tests.wire import MSGPACK, to_msgpack


async def chain(client, sid: str, turns: int, new: int, out: int) -> list[list[int]]:
    assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 201
    tokens: list[int] = []
    seen: list[list[int]] = []
    for i in range(turns):
        prompt = tokens + [1000 + i * new + k for k in range(new)]
        output = [50_000 + i * out + k for k in range(out)]
        r = await client.post(f"/v1/sessions/{sid}/turns", json=turn(prompt, output))
        assert r.status_code == 201, r.text
        tokens = prompt + output
        seen.append(tokens)
    return seen


async def test_cached_nodes_hold_deltas_and_rebuild_full_tokens(client, sid):
    turns, new, out = 48, 40, 8
    expected = await chain(client, sid, turns, new, out)
    svc = client._transport.app.state.services
    svc.cache.clear()
    state = (await client.get(f"/v1/sessions/{sid}/state")).json()
    assert state["checkpoint_token_ids"] == expected[-1]
    cached = svc.cache.get(sid)
    assert cached is not None
    for node, tokens in zip(cached.nodes, expected, strict=True):
        assert node.tail.size == new + out  # the delta only, not the whole context
        assert node.tokens.tolist() == tokens
        assert node.output.tolist() == tokens[-out:]
        assert node.prompt.tolist() == tokens[:-out]
    full = sum(len(t) for t in expected) * 8  # int64 token arrays per node, as before
    assert cached.nbytes < full / 4, (cached.nbytes, full)
    events = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert [e["record"]["request"]["input_ids"] for e in events[1:]] == \
        [t[:-out] for t in expected]


async def test_random_trees_rebuild_the_simulators_tokens(client):
    for seed in range(4):
        sim = SessionSimulator(SimConfig(session_id=f"tree-{seed}-{random.random():.9f}",
                                         version="v2", pause_generation_mode="retract",
                                         max_trim_tokens=seed % 2),
                               random.Random(seed), SimRates(omit_parent=0.4))
        sid = sim.config.session_id
        assert (await client.post("/v1/sessions", json=sim.open_body())).status_code == 201
        for body in sim.random_session(24):
            r = await client.post(f"/v1/sessions/{sid}/turns", json=body)
            assert r.status_code == 201, r.text
        svc = client._transport.app.state.services
        svc.cache.clear()
        for seq, node in enumerate(sim.nodes):
            r = await client.get(f"/v1/sessions/{sid}/state", params={"leaf": seq})
            assert r.json()["checkpoint_token_ids"] == list(node.tokens), (seed, seq)


async def test_the_cache_evicts_by_bytes(client, sid):
    await chain(client, sid, 16, 64, 8)
    await chain(client, sid + "-b", 16, 64, 8)
    svc = client._transport.app.state.services
    svc.cache.clear()
    await client.get(f"/v1/sessions/{sid}/state")
    one = svc.cache.get(sid)
    assert one is not None and svc.cache.nbytes == one.nbytes > 0
    small = StateCache(capacity=100, max_bytes=int(one.nbytes * 1.5))
    small.put(sid, one)
    other = svc.cache.get(sid)  # the same state object stands in for a second session
    small.put("other", other)
    assert len(small) == 1 and small.get(sid) is None and small.get("other") is other
    assert small.nbytes == one.nbytes
    tiny = StateCache(capacity=100, max_bytes=16)
    tiny.put(sid, one)
    assert len(tiny) == 0 and tiny.nbytes == 0


def test_tokens_beyond_int32_are_kept_whole():
    from app.domain.log.tree import compact

    wide = np.array([1, 2**40], dtype=np.int64)
    assert compact(wide).dtype == np.int64
    assert compact(np.array([1, 2], dtype=np.int64)).dtype == np.int32


def kept_bytes(state) -> int:
    """An independent count of what a cached state keeps alive: its token and
    log-prob arrays, any R3 values its nodes still hold, and the message texts."""
    total = 0
    for node in state.nodes:
        total += node.tail.nbytes + node.logprobs.nbytes + len(node.facts.content)
        if node.facts.r3_values is not None:
            total += node.facts.r3_values.nbytes
    return total


@pytest.mark.parametrize("wire", ["json", "msgpack"])
async def test_the_cache_keeps_only_what_the_fold_needs_and_counts_it(settings, wire, sid):
    # Issue 21: a cached turn kept its decoded R3 values (on MessagePack a view of the
    # whole request body) and the byte count ignored them and the message text, so
    # a 10 MB budget grew ~10 MB per turn.
    budget = 200_000
    app = create_app(settings.replace(state_cache_bytes=budget))
    svc = app.state.services
    layers, topk, rows, text = 8, 8, 1_500, 60_000
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://turnlog") as http:
        r = await http.post("/v1/sessions", json=open_body(
            sid, pause_generation_mode="in_place", r3={"num_layers": layers}))
        assert r.status_code == 201, r.text
        for i in range(3):
            body = turn(list(range(1, rows)), [7, 8], r3=r3_b64(rows, layers, topk, seed=i),
                        start=0, parent=None)
            body["record"]["response"]["choices"][0]["message"]["content"] = "y" * text
            content = to_msgpack(body) if wire == "msgpack" else msgspec.json.encode(body)
            r = await http.post(f"/v1/sessions/{sid}/turns", content=content, headers={
                "content-type": MSGPACK if wire == "msgpack" else "application/json"})
            assert r.status_code == 201, r.text
            appended = svc.cache.get(sid)  # measured again, evicted if over the budget
            assert appended is not None
            assert all(n.facts.r3_values is None for n in appended.nodes)
            assert appended.nbytes >= kept_bytes(appended)
            assert svc.cache.nbytes <= budget
            if svc.cache.nbytes:  # still held: counted in full
                assert svc.cache.nbytes >= kept_bytes(appended)
        # Three turns of 60 kB text are more than the budget: not kept at all.
        assert svc.cache.get(sid) is None and svc.cache.nbytes == 0
        big = app.state.services.cache
        big.max_bytes = None
        state = (await http.get(f"/v1/sessions/{sid}/state")).json()
        assert len(state["checkpoint_token_ids"]) == rows + 1
        folded = big.get(sid)
        assert folded is not None and len(folded.nodes) == 3
        assert all(n.facts.r3_values is None for n in folded.nodes)
        assert folded.nbytes >= kept_bytes(folded) >= 3 * text
    await svc.db.dispose()
