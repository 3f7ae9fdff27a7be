"""Sessions for the UI tests and screenshots, appended through the real HTTP API.

`story` is a hand-built v2 tree with a retry (a dropped leaf), a branch, a
truncated turn, spec counters, weight-version bumps, TITO mismatch reports and
turns an hour apart; its `SimNode`s are the simulator's own record of what it
sent, the oracle the tests compare the page against. `showcase` adds random
simulated sessions (closed and open) under one run label.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import httpx

from app.sim.simulator import SessionSimulator, SimConfig, SimNode, SimRates

HOUR = 3600.0


@dataclass
class Story:
    session_id: str
    nodes: list[SimNode]
    closed: bool
    timestamps: list[float]

    def children(self, seq: int) -> list[int]:
        return [n.seq for n in self.nodes if n.parent == seq]

    def is_retry(self, seq: int) -> bool:
        """Independent of the domain: a later node has the same parent."""
        node = self.nodes[seq]
        return node.parent is not None and any(
            n.parent == node.parent and n.seq > seq for n in self.nodes)

    def is_leaf(self, seq: int) -> bool:
        return not self.children(seq)

    def sample_leaves(self) -> list[int]:
        return [n.seq for n in self.nodes if self.is_leaf(n.seq) and not self.is_retry(n.seq)]


def _with_messages(body: dict[str, Any], user: str, reply: str) -> dict[str, Any]:
    body["record"]["request"]["messages"] = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": user},
    ]
    body["record"]["response"]["choices"][0]["message"] = {"role": "assistant",
                                                           "content": reply}
    return body


def story(http: httpx.Client, session_id: str, labels: dict[str, Any], *,
          close: bool = True, message: str = "List the files, then fix the failing test.",
          mode: str = "in_place") -> Story:
    config = SimConfig(session_id=session_id, version="v2", pause_generation_mode=mode,
                       num_layers=6, topk=2, num_experts=16, speculative=True, max_trim_tokens=1,
                       labels=labels)
    sim = SessionSimulator(config, random.Random(7), SimRates())
    http.post("/v1/sessions", json=sim.open_body()).raise_for_status()
    spec = {"spec_verify_ct": 3, "spec_num_correct_drafts": 5, "spec_num_proposed_drafts": 9}
    mismatch = [{"type": "assistant_text", "segment_index": 1, "expected_text": "a",
                 "actual_text": "b", "detail": ""}]
    plan: list[tuple[Any, dict[str, Any]]] = [
        (None, {"new_tokens": 12, "output_tokens": 8, "weight_version": "7"}),
        (0, {"new_tokens": 5, "output_tokens": 6, "weight_version": "7"}),
        ("retry-1", {"output_tokens": 7, "weight_version": "8"}),
        (2, {"new_tokens": 4, "output_tokens": 9, "weight_version": "8",
             "finish_reason": "tool_calls"}),
        (2, {"new_tokens": 6, "output_tokens": 5, "weight_version": "8",
             "finish_reason": "length"}),
        (3, {"new_tokens": 3, "output_tokens": 6, "weight_version": "9", "mismatch": mismatch,
             "trim": 1}),
    ]
    timestamps = []
    for step, (parent, options) in enumerate(plan):
        sim.clock += HOUR if step % 2 else 0.0
        if parent == "retry-1":
            body = sim.turn(sim.nodes[1].parent, prompt=sim.nodes[1].prompt, spec_info=spec,
                            **options)
        else:
            body = sim.turn(parent, spec_info=spec if step != 1 else {}, **options)
        text = message if step == 3 else f"step {step}: run the tests"
        _with_messages(body, text, f"reply {step}: calling a tool")
        timestamps.append(body["record"]["timestamp"])
        http.post(f"/v1/sessions/{session_id}/turns", json=body).raise_for_status()
    if close:
        http.post(f"/v1/sessions/{session_id}/close",
                  json={"metadata": {"reward": 0.75}}).raise_for_status()
    return Story(session_id, list(sim.nodes), close, timestamps)


def random_session(http: httpx.Client, session_id: str, labels: dict[str, Any], seed: int,
                   *, turns: int = 12, close: bool = True) -> None:
    config = SimConfig(session_id=session_id, version="v2",
                       pause_generation_mode=("in_place", "retract")[seed % 2], num_layers=4,
                       topk=2, num_experts=16, speculative=True, max_trim_tokens=seed % 2,
                       labels=labels)
    sim = SessionSimulator(config, random.Random(seed), SimRates(retry=0.3))
    sim.clock += seed * HOUR
    http.post("/v1/sessions", json=sim.open_body()).raise_for_status()
    for body in sim.random_session(turns):
        http.post(f"/v1/sessions/{session_id}/turns", json=body).raise_for_status()
    if close:
        http.post(f"/v1/sessions/{session_id}/close",
                  json={"max_seq_len": 200, "metadata": {"reward": seed % 3 / 2}}
                  ).raise_for_status()


def showcase(http: httpx.Client, run_id: str, count: int = 5) -> Story:
    """`count` random sessions (the last left open) and the story, all under `run_id`."""
    for index in range(count):
        random_session(http, f"{run_id}-r{index}", {"run_id": run_id, "rollout_id": index,
                                                     "model": "qwen3-30b-a3b"},
                       seed=index, close=index < count - 1)
    return story(http, f"{run_id}-story", {"run_id": run_id, "rollout_id": count,
                                            "model": "qwen3-30b-a3b"})
