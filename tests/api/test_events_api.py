"""`GET /v1/sessions/{sid}/events`: each event type's fields, paging by position, the
resolved parent, and `include_r3=false` (docs/api.md "A session's events").
"""

from __future__ import annotations

import pytest

from tests.api.helpers import K, L, append, close, opened
from tests.factory import r3_b64, turn


async def test_events_carry_the_documented_fields_of_each_type(client, sid):
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
