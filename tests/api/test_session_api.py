"""`GET /v1/sessions/{sid}`: the summary fields and the tree in seq order
(docs/api.md "Read a session").
"""

from __future__ import annotations

from tests.api.helpers import SUMMARY_KEYS, TREE_KEYS, K, L, append, opened
from tests.factory import r3_b64, turn


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
