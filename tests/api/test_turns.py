"""POST /v1/sessions/{sid}/turns: replies, derived parents and every status of docs/api.md §1.2.

Every test here runs on every wire: JSON, MessagePack and the narrowed MessagePack
(tests/wire.py).
"""

import base64

import httpx
import numpy as np
import pytest

from tests.api.helpers import TURN_REPLY_KEYS, append, assert_problem, close, feed_tail, opened
from tests.factory import open_body, r3_b64, turn
from tests.wire import WireClient


@pytest.fixture(params=["json", "msgpack", "narrow"])
def client(request, client):
    """The API client of conftest, sending turn bodies on the parametrized wire."""
    return WireClient(client, request.param)

L = 2  # layers
K = 2  # topk


async def open_session(client, sid, **over):
    r = await client.post("/v1/sessions", json=open_body(sid, **over))
    assert r.status_code == 201, r.text


async def post(client, sid, body):
    return await client.post(f"/v1/sessions/{sid}/turns", json=body)


async def stored_nothing(client, sid, num_nodes):
    s = (await client.get(f"/v1/sessions/{sid}")).json()
    assert s["num_nodes"] == num_nodes
    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert len(evs) == 1 + num_nodes


async def addition_session(client, sid, **over):
    await open_session(client, sid, pause_generation_mode="in_place", r3={"num_layers": L},
                       **over)


async def test_first_turn_reply(client, sid):
    await addition_session(client, sid)
    r = await post(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    assert r.status_code == 201, r.text
    body = r.json()
    assert body == {"session_id": sid, "seq": 0, "parent": None, "depth": 0, "num_tokens": 5,
                    "r3": {"start": 0, "end": 4}, "finish_reason": "stop",
                    "position": body["position"]}
    assert isinstance(body["position"], int)


async def test_repeat_event_id_answers_original_reply(client, sid):
    await open_session(client, sid)
    t = turn([1, 2], [3])
    first = await post(client, sid, t)
    again = await post(client, sid, t)
    assert again.status_code == 200
    assert again.json() == first.json()
    await stored_nothing(client, sid, 1)


async def test_same_event_id_other_content_is_409(client, sid):
    await open_session(client, sid)
    t = turn([1, 2], [3], event_id="e1")
    await post(client, sid, t)
    r = await post(client, sid, turn([1, 2], [4], event_id="e1"))
    assert r.status_code == 409
    assert r.json()["type"] == "urn:turnlog:idempotency-conflict"
    await stored_nothing(client, sid, 1)


async def test_derived_parent_extends_deepest_prefix(client, sid):
    await open_session(client, sid)
    await post(client, sid, turn([1, 2], [3]))
    r = await post(client, sid, turn([1, 2, 3, 9], [10]))
    assert r.json()["parent"] == 0 and r.json()["depth"] == 1
    r = await post(client, sid, turn([1, 2, 3, 9, 10, 11], [12]))
    assert r.json()["parent"] == 1 and r.json()["depth"] == 2


async def test_derived_parent_ties_go_to_highest_seq(client, sid):
    await open_session(client, sid)
    await post(client, sid, turn([1, 2], [3]))
    await post(client, sid, turn([1, 2], [3]))  # a re-sent first turn: a second root
    r = await post(client, sid, turn([1, 2, 3, 4], [5]))
    assert r.json()["parent"] == 1


async def test_resent_first_turn_becomes_a_second_root(client, sid):
    await open_session(client, sid)
    await post(client, sid, turn([1, 2], [3]))
    r = await post(client, sid, turn([1, 2], [7]))
    assert r.json()["parent"] is None and r.json()["seq"] == 1


async def test_derived_parent_allows_trim(client, sid):
    await open_session(client, sid, max_trim_tokens=1)
    await post(client, sid, turn([1, 2], [3, 99]))
    r = await post(client, sid, turn([1, 2, 3, 4], [5]))
    assert r.json()["parent"] == 0


async def test_explicit_null_parent_is_new_root(client, sid):
    await open_session(client, sid)
    await post(client, sid, turn([1, 2], [3]))
    r = await post(client, sid, turn([1, 2, 3, 4], [5], parent=None))
    assert r.json()["parent"] is None


async def test_unknown_parent_is_404(client, sid):
    await open_session(client, sid)
    r = await post(client, sid, turn([1, 2], [3], parent=5))
    assert r.status_code == 404
    assert r.json()["type"] == "urn:turnlog:unknown-parent"
    await stored_nothing(client, sid, 0)


async def test_unknown_session_is_404(client, sid):
    r = await post(client, sid, turn([1], [2]))
    assert r.status_code == 404
    assert r.json()["type"] == "urn:turnlog:unknown-session"


async def test_extending_a_length_node_is_409(client, sid):
    await open_session(client, sid)
    await post(client, sid, turn([1, 2], [3], finish_reason="length"))
    r = await post(client, sid, turn([1, 2, 3, 4], [5], parent=0))
    assert r.status_code == 409
    assert r.json()["type"] == "urn:turnlog:parent-truncated"
    r = await post(client, sid, turn([1, 2, 3, 4], [5]))
    assert r.status_code == 409
    await stored_nothing(client, sid, 1)


async def test_node_cap_is_409(client, sid, settings):

    from app.main import create_app

    settings.limits.max_nodes = 2
    app = create_app(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as capped:
        await open_session(capped, sid)
        for _ in range(2):
            assert (await post(capped, sid, turn([1], [2]))).status_code == 201
        r = await post(capped, sid, turn([1], [2]))
        assert r.status_code == 409
        assert r.json()["type"] == "urn:turnlog:node-cap"
    await app.state.services.db.dispose()


async def test_addition_patch_must_start_where_path_ends(client, sid):
    await addition_session(client, sid)
    await post(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    r = await post(client, sid, turn([1, 2, 3, 4, 5, 6], [7], r3=r3_b64(3, L, K), start=3))
    assert r.status_code == 409
    problem = r.json()
    assert problem["type"] == "urn:turnlog:r3-gap"
    assert problem["expected"] == 4 and problem["actual"] == 3
    await stored_nothing(client, sid, 1)


async def test_addition_unstable_prefix_is_409(client, sid):
    await addition_session(client, sid)
    await post(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    # parent tokens [1,2,3,4,5]; prompt keeps only 3 of the 4 routed rows
    r = await post(client, sid, turn([1, 2, 3, 9, 9, 9], [7], r3=r3_b64(2, L, K), start=4,
                                     parent=0))
    assert r.status_code == 409
    assert r.json()["type"] == "urn:turnlog:unstable-prefix"


async def test_addition_second_turn_and_state(client, sid):
    await addition_session(client, sid)
    await post(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    r = await post(client, sid, turn([1, 2, 3, 4, 5, 6], [7], r3=r3_b64(2, L, K), start=4))
    assert r.status_code == 201, r.text
    assert r.json()["r3"] == {"start": 4, "end": 6}
    state = (await client.get(f"/v1/sessions/{sid}/state")).json()
    assert state == {"status": "open", "active_leaf": 1,
                     "checkpoint_token_ids": [1, 2, 3, 4, 5, 6, 7], "num_nodes": 2,
                     "use_addition_r3": True, "next_routed_experts_start_len": 6,
                     "covered_r3_rows": 6}
    state0 = (await client.get(f"/v1/sessions/{sid}/state?leaf=0")).json()
    assert state0["checkpoint_token_ids"] == [1, 2, 3, 4, 5]
    assert state0["covered_r3_rows"] == 4


async def test_state_before_first_turn(client, sid):
    await addition_session(client, sid)
    state = (await client.get(f"/v1/sessions/{sid}/state")).json()
    assert state["active_leaf"] is None and state["checkpoint_token_ids"] == []
    assert state["next_routed_experts_start_len"] == 0 and state["covered_r3_rows"] == 0


def _bad_payloads():
    good_rows = 4
    ok = r3_b64(good_rows, L, K)
    raw = base64.b64decode(ok)
    return [
        ("not base64", "!!!notbase64"),
        ("truncated base64", ok[:-3]),
        ("not whole int32", base64.b64encode(raw[:-2]).decode()),
        ("not divisible", base64.b64encode(raw[:-4]).decode()),
    ]


@pytest.mark.parametrize(("case", "payload"), _bad_payloads())
async def test_bad_r3_payload_is_422(client, sid, case, payload):
    await addition_session(client, sid)
    r = await post(client, sid, turn([1, 2, 3], [4, 5], r3=payload, start=0))
    assert r.status_code == 422, case
    assert r.json()["type"] == "urn:turnlog:invalid-r3"
    await stored_nothing(client, sid, 0)


async def test_topk_must_match_first_turn(client, sid):
    await addition_session(client, sid)
    await post(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    r = await post(client, sid, turn([1, 2, 3, 4, 5, 6], [7], r3=r3_b64(2, L, K + 1), start=4))
    assert r.status_code == 422
    assert r.json()["type"] == "urn:turnlog:invalid-r3"


async def test_payload_with_zero_rows_is_422(client, sid):
    await addition_session(client, sid)
    await post(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    r = await post(client, sid, turn([1, 2, 3, 4, 5], [], r3=r3_b64(1, L, K), start=4))
    assert r.status_code == 422


@pytest.mark.parametrize("empty", [None, ""])
async def test_zero_rows_accept_empty_payload(client, sid, empty):
    await addition_session(client, sid)
    await post(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    body = turn([1, 2, 3, 4, 5], [], start=4, return_r3=True)
    body["record"]["response"]["choices"][0]["meta_info"]["routed_experts"] = empty
    r = await post(client, sid, body)
    assert r.status_code == 201, r.text
    assert r.json()["r3"] == {"start": 4, "end": 4}


async def test_missing_payload_with_rows_is_422(client, sid):
    await addition_session(client, sid)
    r = await post(client, sid, turn([1, 2, 3], [4, 5], start=0, return_r3=True))
    assert r.status_code == 422
    assert r.json()["type"] == "urn:turnlog:invalid-r3"


async def test_start_len_required_in_addition_mode(client, sid):
    await addition_session(client, sid)
    r = await post(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K)))
    assert r.status_code == 422
    assert r.json()["field"] == "record.request.routed_experts_start_len"


async def test_start_len_nonzero_in_full_mode_is_422(client, sid):
    await open_session(client, sid, r3={"num_layers": L})
    r = await post(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=2))
    assert r.status_code == 422
    ok = await post(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    assert ok.status_code == 201


async def test_r3_on_session_without_r3_is_422(client, sid):
    await open_session(client, sid)
    r = await post(client, sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K)))
    assert r.status_code == 422
    assert r.json()["type"] == "urn:turnlog:invalid-r3"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b.pop("event_id"), "event_id"),
        (lambda b: b.pop("record"), "record"),
        (lambda b: b["record"]["request"].update(input_ids=[]), "record.request.input_ids"),
        (lambda b: b["record"]["request"].update(input_ids=[1, -2]),
         "record.request.input_ids[1]"),
        (lambda b: b["record"]["request"].update(input_ids=[1, True]),
         "record.request.input_ids[1]"),
        (lambda b: b["record"]["request"].update(input_ids=[1, 2**40]),
         "record.request.input_ids[1]"),
        (lambda b: b["record"]["response"]["choices"][0]["meta_info"].update(
            completion_tokens=5), "record.response.choices[0].meta_info.completion_tokens"),
        (lambda b: b["record"]["response"].update(choices=[]), "record.response.choices"),
        (lambda b: b.update(metadata={"tito_session_mismatch": [{"type": "other"}]}),
         "metadata.tito_session_mismatch[0].type"),
        (lambda b: b.update(parent="zero"), "parent"),
        (lambda b: b.update(extra=1), "extra"),
    ],
)
async def test_malformed_turn_is_422_naming_the_field(client, sid, mutate, field):
    await open_session(client, sid)
    body = turn([1, 2, 3], [4, 5])
    mutate(body)
    r = await post(client, sid, body)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field
    await stored_nothing(client, sid, 0)


async def test_body_over_limit_is_413(client, sid, settings):

    from app.main import create_app

    settings.limits.max_body_bytes = 1000
    app = create_app(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as small:
        await open_session(small, sid)
        r = await post(small, sid, turn(list(range(1, 500)), [1]))
        assert r.status_code == 413
        assert r.json()["type"] == "urn:turnlog:too-large"
    await app.state.services.db.dispose()


async def test_r3_values_beyond_uint8_round_trip(client, sid):
    await addition_session(client, sid)
    values = np.array([[[0, 70000]], [[-5, 2**31 - 1]]], dtype="<i4")
    values = np.repeat(values, L, axis=1)
    payload = base64.b64encode(values.tobytes()).decode()
    body = turn([1, 2], [3], r3=payload, start=0)
    assert (await post(client, sid, body)).status_code == 201
    evs = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert evs[1]["record"] == body["record"]
    no_r3 = (await client.get(f"/v1/sessions/{sid}/events?include_r3=false")).json()
    assert "routed_experts" not in no_r3[1]["record"]["response"]["choices"][0]["meta_info"]


# --- more documented rules, one behaviour per test ---------------------


async def test_the_turn_reply_has_exactly_the_documented_fields(client, sid):
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
async def test_each_mismatch_type_documented_is_accepted(client, sid, kind):
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
