"""Small HTTP helpers shared by the API tests: checked calls and the reply key sets.

Each helper asserts the status it expects, so a test reads as the behaviour it
checks. The key sets are the documented shapes of docs/api.md.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.factory import open_body

L, K = 2, 2  # R3 layers and top-k of the small test sessions
SUMMARY_KEYS = {"session_id", "version", "pause_generation_mode", "use_addition_r3", "r3",
                "spec", "max_trim_tokens", "labels", "status", "num_nodes", "created_at",
                "closed_at", "opened_by"}
TREE_KEYS = {"seq", "parent", "depth", "num_tokens", "completion_span", "finish_reason",
             "weight_version", "is_leaf", "r3"}
TURN_REPLY_KEYS = {"session_id", "seq", "parent", "depth", "num_tokens", "r3",
                   "finish_reason", "position"}
SAMPLE_KEYS = {"index", "leaf", "path", "tokens", "response_length", "loss_mask",
               "rollout_log_probs", "status", "weight_versions", "spec_info", "reward",
               "reward_source", "metadata", "r3"}


def assert_problem(r: httpx.Response, status: int, slug: str | None = None) -> dict[str, Any]:
    """RFC 9457 problem+json with its four members and a `urn:turnlog:` type."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = r.json()
    assert {"type", "title", "status", "detail"} <= set(body)
    assert body["status"] == status
    assert body["type"].startswith("urn:turnlog:")
    assert isinstance(body["title"], str) and isinstance(body["detail"], str)
    if slug is not None:
        assert body["type"] == f"urn:turnlog:{slug}"
    return body


async def opened(client: httpx.AsyncClient, sid: str, **over: Any) -> dict[str, Any]:
    r = await client.post("/v1/sessions", json=open_body(sid, **over))
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


async def append(client: httpx.AsyncClient, sid: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    assert r.status_code == 201, r.text
    reply: dict[str, Any] = r.json()
    return reply


async def close(client: httpx.AsyncClient, sid: str, **body: Any) -> dict[str, Any]:
    r = await client.post(f"/v1/sessions/{sid}/close", json=body)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


async def feed_tail(client: httpx.AsyncClient) -> str:
    """The feed cursor after every event committed so far."""
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 1000}
        if cursor is not None:
            params["after"] = cursor
        page = (await client.get("/v1/events", params=params)).json()
        cursor = page["next"]
        if not page["events"]:
            assert cursor is not None
            return cursor


async def list_tail(client: httpx.AsyncClient, **filters: Any) -> tuple[list[str], str]:
    """Every listed session id (matching `filters`) and the cursor after the last."""
    seen: list[str] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 1000, **filters}
        if cursor is not None:
            params["after"] = cursor
        page = (await client.get("/v1/sessions", params=params)).json()
        cursor = page["next"]
        if not page["sessions"]:
            assert cursor is not None
            return seen, cursor
        seen += [s["session_id"] for s in page["sessions"]]
