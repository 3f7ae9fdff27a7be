"""`GET /v1/sessions/{sid}/state`: what a restarted session server resumes from
(docs/api.md "Resume state").
"""

from __future__ import annotations

from tests.api.helpers import K, L, append, close, opened
from tests.factory import r3_b64, turn


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
