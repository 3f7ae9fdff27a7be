"""Checks shared by the gateway's end-to-end tests: what the store holds for a
driven session against what went over the wire, and its samples against the
driver's oracle and a full forward of the causal router."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.domain.body.session import parse_close, parse_open
from app.domain.projection.samples import build_samples
from app.domain.wire.jsonio import strict_equal
from app.sim.simulator import fold_in_memory, route
from tests.gateway_e2e.session_driver import CHAT_PATH, SessionDriver
from turnlog_client import TurnlogClient


@dataclass(frozen=True)
class Router:
    """The fake SGLang's MoE shape and seed: enough to run a full forward."""

    num_layers: int = 2
    topk: int = 2
    num_experts: int = 16
    seed: int = 0

    def forward(self, tokens: list[int]) -> np.ndarray:
        return route(np.asarray(tokens, dtype=np.int64), self.num_layers, self.topk,
                     self.num_experts, self.seed)


def check_reply_r3(driver: SessionDriver, router: Router) -> None:
    """Each reply's R3 is the rows [start, len(tokens) - 1) of a full forward."""
    for node in driver.nodes:
        request, response = node.record["request"], node.record["response"]
        if not request.get("return_routed_experts"):
            continue
        payload = response["choices"][0]["meta_info"]["routed_experts"]
        start = request.get("routed_experts_start_len", 0)
        forward = router.forward(node.tokens)[start:]
        assert base64.b64decode(payload) == forward.tobytes(), f"node {node.seq}"


async def check_recorded(store: TurnlogClient, driver: SessionDriver, *,
                         closed: bool = False) -> list[dict[str, Any]]:
    """The session's events are exactly the driver's accepted turns, in order:
    each record's request is the body as forwarded and its response the JSON as
    received; seq and parent are the driver's own. Returns the events."""
    sid = driver.session_id
    events = await store.all_events(sid)
    types = [event["type"] for event in events]
    expected = ["session_opened"] + ["turn_recorded"] * len(driver.nodes)
    assert types == expected + (["session_closed"] if closed else []), f"{sid}: {types}"
    turns = events[1:1 + len(driver.nodes)]
    assert len({event["event_id"] for event in turns}) == len(turns), "duplicate event ids"
    for event, node in zip(turns, driver.nodes, strict=True):
        record = event["record"]
        where = f"{sid} turn {node.seq}"
        assert event["seq"] == node.seq, where
        assert event["parent"] == node.parent, where
        assert record["method"] == "POST" and record["path"] == CHAT_PATH, where
        assert record["status_code"] == 200, where
        assert strict_equal(record["request"], node.record["request"]), where
        assert strict_equal(record["response"], node.record["response"]), where
        assert isinstance(record["timestamp"], float | int), where
        assert record["request_timestamp"] <= record["timestamp"], where
    return events


def _open_body(session: dict[str, Any]) -> dict[str, Any]:
    # The gateway's `opened_by` tag says who opened it; it changes no sample.
    return {key: value for key, value in session.items() if key != "opened_by"}


async def check_samples(store: TurnlogClient, driver: SessionDriver, router: Router,
                        close: dict[str, Any] | None = None) -> dict[str, Any]:
    """Close the session; its samples equal the driver's oracle (leaves, tokens,
    loss mask, log-probs), the domain's fold of the wire records, and each R3
    tensor equals a full forward over the sample's tokens. Returns the samples."""
    sid = driver.session_id
    close = close or {"max_seq_len": None, "metadata": {"reward": 1.0}}
    await store.close(sid, max_seq_len=close["max_seq_len"], metadata=close["metadata"])
    events = await check_recorded(store, driver, closed=True)
    got = await store.samples(sid)

    expected = driver.expected_samples()
    assert [s["leaf"] for s in got["samples"]] == [e.leaf for e in expected], sid
    for sample, oracle in zip(got["samples"], expected, strict=True):
        where = f"{sid} sample {sample['index']}"
        assert sample["path"] == oracle.path, where
        assert sample["tokens"] == oracle.tokens, where
        assert sample["response_length"] == oracle.response_length, where
        assert sample["loss_mask"] == oracle.loss_mask, where
        assert sample["rollout_log_probs"] == oracle.rollout_log_probs, where

    state, _ = fold_in_memory(_open_body(events[0]["session"]),
                              [{"event_id": e["event_id"], "record": e["record"]}
                               for e in events[1:-1]])
    folded = build_samples(state, parse_close(close)).to_json(arrays=True)
    assert strict_equal(got, folded), f"{sid}: samples differ from a fold of the wire records"

    for sample in got["samples"]:
        if not driver.r3:
            assert sample["r3"] is None
            continue
        tensor = await store.r3(sid, sample["index"])
        forward = router.forward(sample["tokens"])
        assert tensor.dtype == np.dtype("<i4")
        assert tensor.shape == forward.shape, f"{sid} sample {sample['index']}"
        assert tensor.tobytes() == forward.tobytes(), f"{sid} sample {sample['index']}"
    return got


def open_body(driver: SessionDriver, router: Router, **extra: Any) -> dict[str, Any]:
    """The §1 open a session server would send for this driver's session."""
    body = {"session_id": driver.session_id, "version": driver.version,
            "pause_generation_mode": "in_place" if driver.addition else "retract",
            "r3": {"num_layers": router.num_layers} if driver.r3 else None,
            "spec": True, **extra}
    parse_open(body)
    return body
