"""Black-box checks of /work/shared/CONTRACT.md that no other test pins down.

One behaviour per test, over HTTP, on both backends (the `client` fixture).
Each test names the contract rule it checks; the contract's wording is quoted
where the rule is easy to misread.
"""

from __future__ import annotations

import base64
import io
import uuid
from typing import Any

import httpx
import numpy as np
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from tests.factory import open_body, r3_b64, turn

L, K = 2, 2
SUMMARY_KEYS = {"session_id", "version", "pause_generation_mode", "use_addition_r3", "r3",
                "spec", "max_trim_tokens", "labels", "status", "num_nodes", "created_at",
                "closed_at"}
TREE_KEYS = {"seq", "parent", "depth", "num_tokens", "completion_span", "finish_reason",
             "weight_version", "is_leaf", "r3"}
TURN_REPLY_KEYS = {"session_id", "seq", "parent", "depth", "num_tokens", "r3",
                   "finish_reason", "position"}
SAMPLE_KEYS = {"index", "leaf", "path", "tokens", "response_length", "loss_mask",
               "rollout_log_probs", "status", "weight_versions", "spec_info", "reward",
               "metadata", "r3"}


def assert_problem(r: httpx.Response, status: int, slug: str | None = None) -> dict[str, Any]:
    """RFC 9457 problem+json with the contract's four members and a `urn:turnlog:` type."""
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


# --- errors: every one is problem+json ---------------------------------------------------


async def test_an_unknown_route_is_a_problem_json_404(client):
    assert_problem(await client.get("/v1/no-such-route"), 404)


async def test_a_wrong_method_is_a_problem_json_405(client, sid):
    assert_problem(await client.delete("/v1/sessions"), 405)
    assert_problem(await client.put(f"/v1/sessions/{sid}/turns", json={}), 405)


async def test_an_empty_turn_body_is_422_naming_event_id(client, sid):
    await opened(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/turns", content=b"")
    assert assert_problem(r, 422, "invalid-request")["field"] == "event_id"


@pytest.mark.parametrize("raw", [b"[]", b"null", b'"x"', b"1"])
async def test_a_close_body_that_is_not_an_object_is_422(client, sid, raw):
    await opened(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/close", content=raw)
    assert assert_problem(r, 422, "invalid-request")["field"] == "body"
    assert (await client.get(f"/v1/sessions/{sid}")).json()["status"] == "open"


async def test_malformed_json_is_422_naming_the_body(client, sid):
    await opened(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/turns", content=b'{"event_id": "e1",',
                          headers={"content-type": "application/json"})
    problem = assert_problem(r, 422, "invalid-request")
    assert problem["field"] == "body" and "expected" in problem and "actual" in problem


async def test_a_body_in_another_content_type_is_415(client, sid):
    r = await client.post("/v1/sessions", content=b'{"session_id": "%s", "version": "v2"}'
                          % sid.encode(), headers={"content-type": "text/plain"})
    assert assert_problem(r, 415, "unsupported-media-type")["field"] == "content-type"
    r = await client.post("/v1/sessions", content=b'{"session_id": "%s", "version": "v2"}'
                          % sid.encode(), headers={"content-type": "application/json; v=1"})
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(("url", "field"), [
    ("/v1/events?limit=abc", "limit"),
    ("/v1/events?wait=soon", "wait"),
    ("/v1/metrics/rollout?strict=maybe", "strict"),
    ("/v1/sessions/{sid}/events?include_r3=maybe", "include_r3"),
    ("/v1/sessions/{sid}/events?after=-1", "after"),
    ("/v1/sessions/{sid}/samples?arrays=maybe", "arrays"),
    ("/v1/sessions/{sid}/state?leaf=abc", "leaf"),
    ("/v1/sessions/{sid}/samples/abc/r3", "index"),
])
async def test_framework_validation_errors_are_problem_json_naming_the_parameter(
        client, sid, url, field):
    await opened(client, sid)
    problem = assert_problem(await client.get(url.format(sid=sid)), 422, "invalid-request")
    assert problem["field"] == field
    assert "expected" in problem and "actual" in problem


@pytest.mark.parametrize("path", ["", "/state", "/events", "/samples", "/samples/0/r3"])
async def test_reads_of_an_unknown_session_are_404_unknown_session(client, sid, path):
    problem = assert_problem(await client.get(f"/v1/sessions/{sid}{path}"), 404,
                             "unknown-session")
    assert problem["field"] == "session_id" and problem["actual"] == sid


async def test_closing_an_unknown_session_is_404(client, sid):
    assert_problem(await client.post(f"/v1/sessions/{sid}/close", json={}), 404,
                   "unknown-session")


# --- §1 open ------------------------------------------------------------------------------


async def test_open_repeat_with_version_true_is_the_same_as_v1(client, sid):
    await opened(client, sid, version="v1", labels={"a": 1, "b": "x"})
    r = await client.post("/v1/sessions", json={"session_id": sid, "version": True,
                                                "labels": {"b": "x", "a": 1}, "r3": None})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == "v1"


async def test_a_generated_session_id_is_uuid4_hex(client):
    r = await client.post("/v1/sessions", json={"version": "v2"})
    assert r.status_code == 201
    generated = r.json()["session_id"]
    parsed = uuid.UUID(hex=generated)
    assert parsed.hex == generated and parsed.version == 4


async def test_two_opens_without_session_id_are_two_sessions(client):
    a = (await client.post("/v1/sessions", json={"version": "v2"})).json()["session_id"]
    b = (await client.post("/v1/sessions", json={"version": "v2"})).json()["session_id"]
    assert a != b


async def test_the_open_reply_is_the_session_summary_without_tree(client, sid):
    reply = await opened(client, sid, labels={"run_id": "r"})
    assert set(reply) == SUMMARY_KEYS
    full = (await client.get(f"/v1/sessions/{sid}")).json()
    assert {k: v for k, v in full.items() if k != "tree"} == reply


async def test_an_open_repeat_after_close_answers_200_with_the_current_summary(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3]))
    await close(client, sid)
    r = await client.post("/v1/sessions", json=open_body(sid))
    assert r.status_code == 200
    assert r.json()["status"] == "closed" and r.json()["num_nodes"] == 1
    assert r.json()["closed_at"] is not None


async def test_use_addition_r3_cannot_be_sent(client, sid):
    r = await client.post("/v1/sessions", json=open_body(sid, use_addition_r3=True))
    assert assert_problem(r, 422, "invalid-request")["field"] == "use_addition_r3"


# --- §1 turns -----------------------------------------------------------------------------


async def test_the_turn_reply_has_exactly_the_contract_fields(client, sid):
    await opened(client, sid)
    reply = await append(client, sid, turn([1, 2], [3]))
    assert set(reply) == TURN_REPLY_KEYS
    assert reply["r3"] is None


async def test_the_turn_reply_position_is_the_one_the_feed_shows(client, sid):
    cursor = await feed_tail(client)
    await opened(client, sid)
    reply = await append(client, sid, turn([1, 2], [3]))
    page = (await client.get("/v1/events", params={"after": cursor, "limit": 1000})).json()
    mine = [e for e in page["events"] if e["session_id"] == sid and e["seq"] == 0]
    assert [e["position"] for e in mine] == [reply["position"]]


async def test_a_repeat_after_close_with_other_content_is_409(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3], event_id="e1"))
    await close(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2], [4], event_id="e1"))
    problem = assert_problem(r, 409)
    assert problem["type"] in ("urn:turnlog:idempotency-conflict", "urn:turnlog:session-closed")


async def test_a_repeat_keeps_its_201_position_and_seq_after_later_turns(client, sid):
    await opened(client, sid)
    body = turn([1, 2], [3])
    first = await append(client, sid, body)
    await append(client, sid, turn([1, 2, 3, 4], [5]))
    again = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    assert again.status_code == 200 and again.json() == first


async def test_the_derived_parent_is_the_deepest_match_before_the_latest(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3]))                      # seq 0, depth 0
    await append(client, sid, turn([1, 2, 3, 4], [5]))                # seq 1, depth 1
    await append(client, sid, turn([1, 2, 3, 4], [5], parent=None))   # seq 2, a root
    reply = await append(client, sid, turn([1, 2, 3, 4, 5, 6], [7]))
    # seq 0, 1 and 2 all prefix the prompt; seq 1 is deepest although 2 is newer.
    assert (reply["parent"], reply["depth"]) == (1, 2)


async def test_the_derived_parent_with_trim_ignores_up_to_max_trim_tokens(client, sid):
    await opened(client, sid, max_trim_tokens=2)
    await append(client, sid, turn([1, 2], [3, 98, 99]))
    reply = await append(client, sid, turn([1, 2, 3, 4], [5]))
    assert reply["parent"] == 0
    other = await append(client, sid, turn([1, 2, 7, 7], [5]))
    assert other["parent"] is None  # three unmatched tokens exceed the trim


async def test_a_v1_rollback_is_a_branch_and_nothing_is_discarded(client, sid):
    await opened(client, sid, version="v1")
    await append(client, sid, turn([1, 2], [3]))
    await append(client, sid, turn([1, 2, 3, 4], [5]))
    rolled = await append(client, sid, turn([1, 2, 3, 9], [10]))
    assert rolled["parent"] == 0 and rolled["seq"] == 2
    tree = (await client.get(f"/v1/sessions/{sid}")).json()["tree"]
    assert [n["seq"] for n in tree] == [0, 1, 2]


async def test_a_derived_parent_that_hit_the_length_limit_is_409(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3], finish_reason="length"))
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2, 3, 4], [5]))
    assert_problem(r, 409, "parent-truncated")


@pytest.mark.parametrize("kind", ["special_token_count", "special_token_type",
                                  "non_assistant_text", "assistant_text"])
async def test_each_mismatch_type_of_the_contract_is_accepted(client, sid, kind):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3], metadata={
        "tito_session_mismatch": [{"type": kind, "segment_index": 1}]}))


async def test_a_turn_without_finish_reason_or_timestamp_is_accepted(client, sid):
    await opened(client, sid)
    body = turn([1, 2], [3], finish_reason=None)
    del body["record"]["timestamp"]
    reply = await append(client, sid, body)
    assert reply["finish_reason"] is None


async def test_completion_tokens_absent_is_accepted(client, sid):
    await opened(client, sid)
    body = turn([1, 2], [3, 4])
    del body["record"]["response"]["choices"][0]["meta_info"]["completion_tokens"]
    assert (await append(client, sid, body))["num_tokens"] == 4


async def test_full_mode_r3_covers_rows_from_zero(client, sid):
    await opened(client, sid, r3={"num_layers": L})
    await append(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K)))
    reply = await append(client, sid, turn([1, 2, 3, 4, 5, 6], [7], r3=r3_b64(6, L, K)))
    assert reply["r3"] == {"start": 0, "end": 6}


async def test_an_addition_root_after_the_first_must_start_at_row_0(client, sid):
    await opened(client, sid, pause_generation_mode="in_place", r3={"num_layers": L})
    await append(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn(
        [7, 8, 9], [4, 5], r3=r3_b64(2, L, K), start=2, parent=None))
    problem = assert_problem(r, 409, "r3-gap")
    assert (problem["expected"], problem["actual"]) == (0, 2)


# --- §1 GET session, events, state -------------------------------------------------------


async def test_the_session_has_its_fields_and_tree_entries_in_seq_order(client, sid):
    await opened(client, sid, pause_generation_mode="in_place", r3={"num_layers": L})
    await append(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0,
                                   weight_version="7"))
    await append(client, sid, turn([1, 2, 3, 4, 5, 6], [7], r3=r3_b64(2, L, K), start=4,
                                   weight_version="8", finish_reason="tool_calls"))
    await append(client, sid, turn([1, 2, 3, 4, 5, 9], [8], parent=0))
    body = (await client.get(f"/v1/sessions/{sid}")).json()
    assert set(body) == SUMMARY_KEYS | {"tree"}
    assert body["num_nodes"] == 3 and body["status"] == "open" and body["closed_at"] is None
    assert [set(n) for n in body["tree"]] == [TREE_KEYS] * 3
    assert body["tree"] == [
        {"seq": 0, "parent": None, "depth": 0, "num_tokens": 5, "completion_span": [3, 5],
         "finish_reason": "stop", "weight_version": "7", "is_leaf": False,
         "r3": {"start": 0, "end": 4}},
        {"seq": 1, "parent": 0, "depth": 1, "num_tokens": 7, "completion_span": [6, 7],
         "finish_reason": "tool_calls", "weight_version": "8", "is_leaf": True,
         "r3": {"start": 4, "end": 6}},
        {"seq": 2, "parent": 0, "depth": 1, "num_tokens": 7, "completion_span": [6, 7],
         "finish_reason": "stop", "weight_version": "1", "is_leaf": True, "r3": None},
    ]


async def test_events_carry_the_contract_fields_of_each_type(client, sid):
    await opened(client, sid, labels={"run_id": "r"})
    body = turn([1, 2], [3], metadata={"tito_session_mismatch": []})
    await append(client, sid, body)
    await close(client, sid, metadata={"reward": 0.5})
    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert [e["type"] for e in evs] == ["session_opened", "turn_recorded", "session_closed"]
    positions = [e["position"] for e in evs]
    assert positions == sorted(positions) and len(set(positions)) == 3
    common = {"position", "type", "seq", "event_id", "recorded_at"}
    opened_ev, turn_ev, closed_ev = evs
    assert set(opened_ev) == common | {"session"}
    assert opened_ev["seq"] is None and opened_ev["event_id"] is None
    assert opened_ev["session"] == {
        "session_id": sid, "version": "v2", "pause_generation_mode": "retract", "r3": None,
        "spec": False, "max_trim_tokens": 0, "labels": {"run_id": "r"}}
    assert set(turn_ev) == common | {"parent", "record", "metadata"}
    assert (turn_ev["seq"], turn_ev["event_id"], turn_ev["parent"]) == (0, body["event_id"],
                                                                         None)
    assert turn_ev["record"] == body["record"] and turn_ev["metadata"] == body["metadata"]
    assert set(closed_ev) == common | {"close"}
    assert closed_ev["seq"] is None and closed_ev["event_id"] is None
    assert closed_ev["close"]["metadata"] == {"reward": 0.5}
    assert closed_ev["close"].get("max_seq_len") is None
    assert all(e["recorded_at"].endswith("Z") for e in evs)


async def test_events_after_a_position_and_limit_page_in_commit_order(client, sid):
    await opened(client, sid)
    for i in range(3):
        await append(client, sid, turn([1, 2 + i], [3]))
    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    page = (await client.get(f"/v1/sessions/{sid}/events",
                             params={"after": evs[1]["position"], "limit": 2})).json()
    assert [e["seq"] for e in page] == [1, 2]
    rest = (await client.get(f"/v1/sessions/{sid}/events",
                             params={"after": page[-1]["position"]})).json()
    assert rest == []


async def test_an_event_records_the_resolved_parent(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3]))
    await append(client, sid, turn([1, 2, 3, 4], [5]))
    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert [e.get("parent") for e in evs[1:]] == [None, 0]


@pytest.mark.parametrize("empty", ["", None])
async def test_include_r3_false_leaves_out_a_payload_of_zero_rows(client, sid, empty):
    await opened(client, sid, pause_generation_mode="in_place", r3={"num_layers": L})
    await append(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    body = turn([1, 2, 3, 4, 5], [], start=4, return_r3=True)
    body["record"]["response"]["choices"][0]["meta_info"]["routed_experts"] = empty
    await append(client, sid, body)
    with_r3 = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert with_r3[2]["record"] == body["record"]  # exactly as appended
    without = (await client.get(f"/v1/sessions/{sid}/events?include_r3=false")).json()
    for event in without[1:]:
        assert "routed_experts" not in event["record"]["response"]["choices"][0]["meta_info"]


async def test_include_r3_false_leaves_out_a_null_payload_of_a_turn_without_r3(client, sid):
    await opened(client, sid)
    body = turn([1, 2], [3])
    body["record"]["response"]["choices"][0]["meta_info"]["routed_experts"] = None
    await append(client, sid, body)
    assert (await client.get(f"/v1/sessions/{sid}/events")).json()[1]["record"] == \
        body["record"]
    without = (await client.get(f"/v1/sessions/{sid}/events?include_r3=false")).json()
    assert "routed_experts" not in without[1]["record"]["response"]["choices"][0]["meta_info"]
    assert without[1]["record"]["request"] == body["record"]["request"]


async def test_state_in_full_mode_has_no_next_start_and_counts_covered_rows(client, sid):
    await opened(client, sid, r3={"num_layers": L})
    empty = (await client.get(f"/v1/sessions/{sid}/state")).json()
    assert empty["next_routed_experts_start_len"] is None and empty["covered_r3_rows"] == 0
    await append(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K)))
    state = (await client.get(f"/v1/sessions/{sid}/state")).json()
    assert state == {"status": "open", "active_leaf": 0, "checkpoint_token_ids": [1, 2, 3, 4, 5],
                     "num_nodes": 1, "use_addition_r3": False,
                     "next_routed_experts_start_len": None, "covered_r3_rows": 4}


async def test_state_without_r3_has_null_covered_rows(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3]))
    state = (await client.get(f"/v1/sessions/{sid}/state")).json()
    assert state["covered_r3_rows"] is None and state["next_routed_experts_start_len"] is None


async def test_state_active_leaf_is_the_most_recent_node_not_the_deepest(client, sid):
    await opened(client, sid, pause_generation_mode="in_place")
    await append(client, sid, turn([1, 2], [3]))
    await append(client, sid, turn([1, 2, 3, 4], [5]))
    await append(client, sid, turn([7], [8], parent=None))
    state = (await client.get(f"/v1/sessions/{sid}/state")).json()
    assert state["active_leaf"] == 2 and state["checkpoint_token_ids"] == [7, 8]
    assert state["next_routed_experts_start_len"] == 1


async def test_state_covered_rows_stop_at_the_first_turn_without_r3(client, sid):
    await opened(client, sid, pause_generation_mode="in_place", r3={"num_layers": L})
    await append(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    await append(client, sid, turn([1, 2, 3, 4, 5, 6], [7]))
    state = (await client.get(f"/v1/sessions/{sid}/state")).json()
    assert state["covered_r3_rows"] == 4 and state["next_routed_experts_start_len"] == 6


async def test_state_is_closed_after_close(client, sid):
    await opened(client, sid)
    await close(client, sid)
    assert (await client.get(f"/v1/sessions/{sid}/state")).json()["status"] == "closed"


# --- §1 close / §2 samples ---------------------------------------------------------------


async def test_the_close_reply_is_the_samples_without_arrays(client, sid):
    await opened(client, sid, spec=True)
    await append(client, sid, turn([1, 2], [3], spec=(1, 1, 2)))
    reply = await close(client, sid, metadata={"reward": 2.0})
    assert reply == (await client.get(f"/v1/sessions/{sid}/samples?arrays=false")).json()


async def test_arrays_false_omits_exactly_tokens_loss_mask_and_log_probs(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3]))
    await close(client, sid)
    full = (await client.get(f"/v1/sessions/{sid}/samples")).json()
    bare = (await client.get(f"/v1/sessions/{sid}/samples?arrays=false")).json()
    assert set(full) == {"session_id", "version", "empty_reason", "errors", "samples",
                         "session_metrics"}
    assert set(full["samples"][0]) == SAMPLE_KEYS
    assert set(bare["samples"][0]) == SAMPLE_KEYS - {"tokens", "loss_mask",
                                                      "rollout_log_probs"}


async def test_a_repeated_close_after_a_turn_repeat_keeps_the_same_result(client, sid):
    await opened(client, sid)
    body = turn([1, 2], [3])
    await append(client, sid, body)
    first = await close(client, sid, max_seq_len=100, metadata={"reward": 1})
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=body)).status_code == 200
    assert await close(client, sid, max_seq_len=100, metadata={"reward": 1}) == first


async def test_a_turn_after_close_stores_nothing(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3]))
    await close(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2, 3, 4], [5]))
    assert_problem(r, 409, "session-closed")
    assert len((await client.get(f"/v1/sessions/{sid}/events")).json()) == 3


async def test_the_r3_tensor_of_an_open_session_is_409_session_open(client, sid):
    await opened(client, sid)
    assert_problem(await client.get(f"/v1/sessions/{sid}/samples/0/r3"), 409, "session-open")


async def v2_forest(client: httpx.AsyncClient, sid: str, version: str = "v2") -> None:
    await opened(client, sid, version=version)
    await append(client, sid, turn([1, 2], [3]))                           # 0
    await append(client, sid, turn([1, 2, 3, 4], [5]))                     # 1 <- 0
    await append(client, sid, turn([1, 2, 3, 4, 5, 6], [7]))               # 2 <- 1 (retried)
    await append(client, sid, turn([1, 2, 3, 8], [9], parent=0))           # 3 <- 0
    await append(client, sid, turn([1, 2, 3, 4, 5, 6], [10], parent=1))    # 4 <- 1


async def test_v2_samples_drop_retries_and_go_longest_path_then_highest_leaf(client, sid):
    await v2_forest(client, sid)
    body = await close(client, sid)
    assert [(s["index"], s["leaf"], s["path"]) for s in body["samples"]] == [
        (0, 4, [0, 1, 4]), (1, 3, [0, 3])]


async def test_v2_shared_completions_train_only_in_the_smallest_leaf_sample(client, sid):
    await v2_forest(client, sid)
    await close(client, sid)
    first, second = (await client.get(f"/v1/sessions/{sid}/samples")).json()["samples"]
    assert first["tokens"] == [1, 2, 3, 4, 5, 6, 10] and first["response_length"] == 5
    # token 3 is node 0's completion: owned by leaf 3 (smaller seq than leaf 4)
    assert first["loss_mask"] == [0, 0, 1, 0, 1]
    assert first["rollout_log_probs"] == [-0.5, 0.0, -0.5, 0.0, -0.5]
    assert second["tokens"] == [1, 2, 3, 8, 9] and second["loss_mask"] == [1, 0, 1]


async def test_v1_has_one_sample_for_the_most_recently_committed_node(client, sid):
    await v2_forest(client, sid, version="v1")
    body = await close(client, sid)
    assert [(s["leaf"], s["path"]) for s in body["samples"]] == [(4, [0, 1, 4])]
    assert body["version"] == "v1"


async def test_an_unalignable_path_does_not_block_close(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3, 4]))
    await append(client, sid, turn([1, 2, 3, 9], [5], parent=0))
    body = await close(client, sid)
    assert body["samples"] == [] and body["empty_reason"] == "assembly_error"
    (error,) = body["errors"]
    assert set(error) == {"leaf", "type", "detail"}
    assert (error["leaf"], error["type"]) == (1, "alignment")
    assert (await client.get(f"/v1/sessions/{sid}")).json()["status"] == "closed"


async def test_max_trim_tokens_lets_the_same_path_align(client, sid):
    await opened(client, sid, max_trim_tokens=1)
    await append(client, sid, turn([1, 2], [3, 4]))
    await append(client, sid, turn([1, 2, 3, 9], [5]))
    await close(client, sid)
    (sample,) = (await client.get(f"/v1/sessions/{sid}/samples")).json()["samples"]
    assert sample["tokens"] == [1, 2, 3, 9, 5] and sample["loss_mask"] == [1, 0, 1]


async def test_all_truncated_when_max_seq_len_leaves_no_turn(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2, 3], [4]))
    body = await close(client, sid, max_seq_len=2)
    assert body["samples"] == [] and body["empty_reason"] == "all_truncated"
    assert body["errors"] == []


async def test_truncation_cuts_the_overshoot_and_the_r3_rows(client, sid):
    await opened(client, sid, r3={"num_layers": L})
    await append(client, sid, turn([1, 2], [3, 4, 5], r3=r3_b64(4, L, K, seed=3)))
    await close(client, sid, max_seq_len=4)
    (sample,) = (await client.get(f"/v1/sessions/{sid}/samples")).json()["samples"]
    assert sample["tokens"] == [1, 2, 3, 4] and sample["status"] == "truncated"
    assert sample["loss_mask"] == [1, 1] and sample["r3"]["shape"] == [3, L, K]
    r = await client.get(f"/v1/sessions/{sid}/samples/0/r3")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy"
    tensor = np.load(io.BytesIO(r.content), allow_pickle=False)
    full = np.frombuffer(base64.b64decode(r3_b64(4, L, K, seed=3)), "<i4")
    assert np.array_equal(tensor, full.reshape(4, L, K)[:3])


@pytest.mark.parametrize(("finish", "status"), [("stop", "completed"),
                                                ("tool_calls", "completed"),
                                                ("length", "truncated"), ("abort", "aborted"),
                                                ("weird", "pending"), (None, "pending")])
async def test_a_sample_status_follows_the_finish_reason(client, sid, finish, status):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3], finish_reason=finish))
    (sample,) = (await close(client, sid))["samples"]
    assert sample["status"] == status


async def test_merging_stops_after_the_first_turn_that_is_not_completed(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3], finish_reason="abort", weight_version="a"))
    await append(client, sid, turn([1, 2, 3, 4], [5], parent=0, weight_version="b"))
    await close(client, sid)
    (sample,) = (await client.get(f"/v1/sessions/{sid}/samples")).json()["samples"]
    assert sample["path"] == [0, 1] and sample["tokens"] == [1, 2, 3]
    assert sample["status"] == "aborted" and sample["weight_versions"] == ["a"]


async def test_sample_metadata_is_the_leaf_turns_mismatch_and_reward_the_close_reward(
        client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3], metadata={
        "tito_session_mismatch": [{"type": "assistant_text"}]}))
    leaf_mismatch = [{"type": "special_token_count", "segment_index": 2}]
    await append(client, sid, turn([1, 2, 3, 4], [5],
                                   metadata={"tito_session_mismatch": leaf_mismatch}))
    (sample,) = (await close(client, sid, metadata={"reward": 0.25}))["samples"]
    assert sample["metadata"] == {"tito_session_mismatch": leaf_mismatch}
    assert sample["reward"] == 0.25


async def test_session_metrics_count_every_node_once_and_sample_spec_only_kept_turns(
        client, sid):
    await opened(client, sid, spec=True)
    await append(client, sid, turn([1, 2], [3], spec=(2, 3, 4)))                  # 0
    await append(client, sid, turn([1, 2, 3, 4], [5], spec=(1, 1, 1)))            # 1 <- 0
    await append(client, sid, turn([1, 2, 3, 4], [6], spec=(5, 5, 5), parent=0))  # 2 retry
    await append(client, sid, turn([1, 2, 3, 7], [8], spec=(0, 9, 9), parent=0))  # 3 no guard
    body = await close(client, sid)
    assert body["session_metrics"] == {"session_id": sid, "metrics": {"spec_info": {
        "spec_num_correct_drafts": 9, "spec_num_proposed_drafts": 10, "spec_verify_ct": 8,
        "completion_tokens": 3}}}
    by_leaf = {s["leaf"]: s["spec_info"] for s in body["samples"]}
    assert set(by_leaf) == {3}  # leaves 1 and 2 are retries of node 0's children
    assert by_leaf[3] == {"spec_num_correct_drafts": 3, "spec_num_proposed_drafts": 4,
                          "spec_verify_ct": 2, "completion_tokens": 1}


async def test_legacy_spec_counter_names_are_read(client, sid):
    await opened(client, sid, spec=True)
    body = turn([1, 2], [3, 4])
    meta = body["record"]["response"]["choices"][0]["meta_info"]
    del meta["completion_tokens"]
    meta.update(spec_verify_ct=2, spec_accept_token_num=3, spec_draft_token_num=5,
                completion_token_num=7)
    await append(client, sid, body)
    metrics = (await close(client, sid))["session_metrics"]["metrics"]["spec_info"]
    assert metrics == {"spec_num_correct_drafts": 3, "spec_num_proposed_drafts": 5,
                       "spec_verify_ct": 2, "completion_tokens": 7}


async def test_an_r3_gap_names_the_turn_and_rows(client, sid):
    await opened(client, sid, pause_generation_mode="in_place", r3={"num_layers": L})
    await append(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    await append(client, sid, turn([1, 2, 3, 4, 5, 6], [7]))
    await close(client, sid)
    problem = assert_problem(await client.get(f"/v1/sessions/{sid}/samples/0/r3"), 422,
                             "r3-gap")
    assert problem["seq"] == 1 and problem["rows"] == [4, 6]


# --- §6 feed and list --------------------------------------------------------------------


async def test_the_feed_default_limit_is_100(client, sid):
    cursor = await feed_tail(client)
    for i in range(101):
        await opened(client, f"{sid}-{i}")
    page = (await client.get("/v1/events", params={"after": cursor})).json()
    assert len(page["events"]) == 100
    assert set(page["events"][0]) == {"position", "session_id", "seq", "type", "recorded_at"}


async def test_the_feed_from_the_beginning_starts_at_the_first_event(client, sid):
    await opened(client, sid)
    first = (await client.get("/v1/events", params={"limit": 1})).json()
    again = (await client.get("/v1/events", params={"limit": 1, "after": ""})).json()
    assert first["events"] == again["events"] and len(first["events"]) == 1


async def test_the_session_list_keeps_its_cursor_on_an_empty_page(client, sid):
    await opened(client, sid, labels={"run_id": sid})
    seen, cursor = await list_tail(client, run_id=sid)
    assert seen == [sid]
    page = (await client.get("/v1/sessions", params={"after": cursor, "run_id": sid})).json()
    assert page == {"sessions": [], "next": cursor}


async def test_the_session_list_entries_are_summaries(client, sid):
    summary = await opened(client, sid, labels={"run_id": sid})
    page = (await client.get("/v1/sessions", params={"run_id": sid})).json()
    assert page["sessions"] == [summary] and isinstance(page["next"], str)


@pytest.mark.parametrize(("value", "query", "matches"), [
    (True, "true", True), (False, "false", True), (12, "12", True), (12, "12.0", False),
    (1.5, "1.5", True), (None, "null", True), ("12", "12", True), ("x", '"x"', False),
])
async def test_label_filters_compare_json_text_without_quotes_for_strings(
        client, sid, value, query, matches):
    await opened(client, sid, labels={"run_id": sid, "flag": value})
    page = (await client.get("/v1/sessions", params={"run_id": sid, "flag": query})).json()
    assert [s["session_id"] for s in page["sessions"]] == ([sid] if matches else [])


async def test_the_status_filter_of_the_session_list(client, sid):
    await opened(client, f"{sid}-a", labels={"run_id": sid})
    await opened(client, f"{sid}-b", labels={"run_id": sid})
    await close(client, f"{sid}-b")
    closed = (await client.get("/v1/sessions", params={"run_id": sid, "status": "closed"}))
    still = (await client.get("/v1/sessions", params={"run_id": sid, "status": "open"}))
    assert [s["session_id"] for s in closed.json()["sessions"]] == [f"{sid}-b"]
    assert [s["session_id"] for s in still.json()["sessions"]] == [f"{sid}-a"]


async def test_the_session_list_never_skips_an_open_that_commits_late(
        client, sid, backend, db_url):
    """CONTRACT §6: the list pages "the same way" as the feed, which never skips."""
    if backend == "sqlite":
        return  # one writer: id order is commit order
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as slow:
            await slow.begin()
            await slow.execute(sa.text(
                "INSERT INTO sessions (session_id, version, pause_generation_mode, spec, "
                "max_trim_tokens, labels, open_fingerprint, created_us, status, num_nodes, "
                "spec_correct, spec_proposed, spec_verify, spec_completion) VALUES "
                "(:s, 'v2', 'retract', false, 0, '{}', 'x', 0, 'open', 0, 0, 0, 0, 0)"),
                {"s": f"{sid}-slow"})
            await opened(client, f"{sid}-fast")
            _, cursor = await list_tail(client)
            await slow.commit()
    finally:
        await engine.dispose()
    later = (await client.get("/v1/sessions", params={"after": cursor})).json()
    assert f"{sid}-slow" in [s["session_id"] for s in later["sessions"]]


# --- §4 / §5 ------------------------------------------------------------------------------


async def test_analytics_label_filters_match_booleans(client, sid):
    await opened(client, f"{sid}-t", labels={"run_id": sid, "flag": True})
    await opened(client, f"{sid}-f", labels={"run_id": sid, "flag": False})
    await append(client, f"{sid}-t", turn([1], [2], spec=(1, 1, 2)))
    await append(client, f"{sid}-f", turn([1], [2], spec=(1, 1, 2)))
    r = await client.get("/v1/analytics/spec", params={"group_by": "run_id", "run_id": sid,
                                                       "flag": "true"})
    (group,) = r.json()["groups"]
    assert (group["key"], group["sessions"], group["turns"]) == (sid, 1, 1)
    assert set(group) == {"key", "sessions", "turns", "spec_num_correct_drafts",
                          "spec_num_proposed_drafts", "spec_verify_ct", "completion_tokens",
                          "accept_rate", "accept_length"}


async def test_rollout_metrics_over_v1_and_v2_never_share_a_tito_key(client, sid):
    for version in ("v1", "v2"):
        s = f"{sid}-{version}"
        await opened(client, s, version=version, labels={"run_id": sid})
        await append(client, s, turn([1, 2], [3], metadata={"tito_session_mismatch": (
            [{"type": "assistant_text"}] if version == "v2" else [])}))
        await close(client, s)
    body = (await client.get("/v1/metrics/rollout", params={"run_id": sid})).json()
    assert body["rollout/tito_session_mismatch_rate/v1"] == 0.0
    assert body["rollout/tito_session_mismatch_rate/v2"] == 1.0
    assert body["rollout/tito_session_mismatch_rate/v2/assistant_text"] == 1.0
    assert "rollout/tito_session_mismatch_rate" not in body
    assert (body["sessions"], body["samples"]) == (2, 2)
