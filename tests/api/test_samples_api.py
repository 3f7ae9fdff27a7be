"""Close, samples and R3 tensors over HTTP (docs/api.md §1.6, §2)."""

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.api.helpers import SAMPLE_KEYS, append, assert_problem, close, opened
from tests.factory import open_body, r3_b64, turn

DATA = Path(__file__).resolve().parents[1] / "data"
L, K = 2, 2


async def example_session(client, sid):
    body = json.loads((DATA / "open_session.json").read_text())
    body["session_id"] = sid
    await client.post("/v1/sessions", json=body)
    turns = [json.loads((DATA / f"turn_{i}.json").read_text()) for i in range(2)]
    for t in turns:
        assert (await client.post(f"/v1/sessions/{sid}/turns", json=t)).status_code == 201
    return turns


def npy(content: bytes) -> np.ndarray:
    return np.load(io.BytesIO(content), allow_pickle=False)


async def test_samples_of_open_session_are_409(client, sid):
    await example_session(client, sid)
    r = await client.get(f"/v1/sessions/{sid}/samples")
    assert r.status_code == 409
    assert r.json()["type"] == "urn:turnlog:session-open"


async def test_close_returns_samples_without_arrays(client, sid):
    await example_session(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/close", json={"metadata": {"reward": 1.0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["session_id"] == sid and body["empty_reason"] is None
    (sample,) = body["samples"]
    assert "tokens" not in sample and sample["leaf"] == 1 and sample["path"] == [0, 1]
    assert sample["reward"] == 1.0 and sample["status"] == "completed"
    assert sample["weight_versions"] == ["1", "2"]
    assert sample["r3"] == {"shape": [17, 2, 2], "dtype": "int32"}
    assert body["session_metrics"]["metrics"]["spec_info"] == {
        "spec_num_correct_drafts": 7, "spec_num_proposed_drafts": 11,
        "spec_verify_ct": 7, "completion_tokens": 6}


async def test_close_is_idempotent_and_conflicts_on_other_body(client, sid):
    await example_session(client, sid)
    first = await client.post(f"/v1/sessions/{sid}/close", json={})
    again = await client.post(f"/v1/sessions/{sid}/close", json={})
    assert again.status_code == 200 and again.json() == first.json()
    other = await client.post(f"/v1/sessions/{sid}/close", json={"max_seq_len": 5})
    assert other.status_code == 409


async def test_turn_after_close_is_409_but_repeat_is_200(client, sid):
    turns = await example_session(client, sid)
    await client.post(f"/v1/sessions/{sid}/close", json={})
    again = await client.post(f"/v1/sessions/{sid}/turns", json=turns[1])
    assert again.status_code == 200
    new = dict(turns[1], event_id="fresh")
    r = await client.post(f"/v1/sessions/{sid}/turns", json=new)
    assert r.status_code == 409
    assert r.json()["type"] == "urn:turnlog:session-closed"


async def test_r3_tensor_equals_concatenated_patches(client, sid):
    turns = await example_session(client, sid)
    await client.post(f"/v1/sessions/{sid}/close", json={})
    r = await client.get(f"/v1/sessions/{sid}/samples/0/r3")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/x-npy"
    got = npy(r.content)
    import base64
    parts = [np.frombuffer(base64.b64decode(
        t["record"]["response"]["choices"][0]["meta_info"]["routed_experts"]), "<i4")
        for t in turns]
    expected = np.concatenate(parts).reshape(-1, L, K)
    assert got.dtype == np.dtype("<i4") and got.shape == (17, L, K)
    assert np.array_equal(got, expected)
    samples = (await client.get(f"/v1/sessions/{sid}/samples")).json()
    assert len(samples["samples"][0]["tokens"]) == 18


async def test_r3_of_unknown_sample_is_404(client, sid):
    await example_session(client, sid)
    await client.post(f"/v1/sessions/{sid}/close", json={})
    r = await client.get(f"/v1/sessions/{sid}/samples/3/r3")
    assert r.status_code == 404
    assert r.json()["type"] == "urn:turnlog:unknown-sample"


async def test_r3_gap_on_read_is_422_naming_the_turn(client, sid):
    await client.post("/v1/sessions", json=open_body(
        sid, pause_generation_mode="in_place", r3={"num_layers": L}))
    await client.post(f"/v1/sessions/{sid}/turns",
                      json=turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0))
    # second turn without R3: the path's rows stop at 4
    await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2, 3, 4, 5, 6], [7]))
    await client.post(f"/v1/sessions/{sid}/close", json={})
    samples = (await client.get(f"/v1/sessions/{sid}/samples")).json()
    assert samples["samples"][0]["r3"]["shape"] == [6, L, K]
    r = await client.get(f"/v1/sessions/{sid}/samples/0/r3")
    assert r.status_code == 422
    assert r.json()["type"] == "urn:turnlog:r3-gap"


@pytest.mark.parametrize("cut", ["abort", "max_seq_len"])
async def test_r3_left_out_with_its_turn_is_a_gap_not_a_sample_without_r3(client, sid, cut):
    # Addition mode: the path [0, 1] carries R3 (turn 1's patch), but the sample keeps
    # only turn 0, which has none — merging stops at its abort, or max_seq_len drops
    # turn 1. r3 is null only when no turn of the path carries R3: this is a gap.
    await client.post("/v1/sessions", json=open_body(
        sid, pause_generation_mode="in_place", r3={"num_layers": L}))
    finish = "abort" if cut == "abort" else "stop"
    await append(client, sid, turn([1, 2, 3, 4], [5, 6], finish_reason=finish))
    await append(client, sid, turn([1, 2, 3, 4, 5, 6, 7], [8], parent=0,
                                   r3=r3_b64(2, L, K), start=5))
    await close(client, sid, **({"max_seq_len": 6} if cut == "max_seq_len" else {}))
    (sample,) = (await client.get(f"/v1/sessions/{sid}/samples")).json()["samples"]
    assert sample["path"] == [0, 1] and sample["tokens"] == [1, 2, 3, 4, 5, 6]
    assert sample["r3"] == {"shape": [5, L, K], "dtype": "int32"}
    problem = assert_problem(await client.get(f"/v1/sessions/{sid}/samples/0/r3"), 422,
                             "r3-gap")
    assert problem["field"] == "path[0]"


async def test_close_with_no_turns(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    r = await client.post(f"/v1/sessions/{sid}/close", json={})
    assert r.json()["empty_reason"] == "no_turns" and r.json()["samples"] == []


async def test_bad_close_body_is_422(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    r = await client.post(f"/v1/sessions/{sid}/close", json={"max_seq_len": 0})
    assert r.status_code == 422 and r.json()["field"] == "max_seq_len"
    s = (await client.get(f"/v1/sessions/{sid}")).json()
    assert s["status"] == "open"


# --- more documented rules, one behaviour per test ---------------------


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
