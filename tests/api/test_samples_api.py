"""Close, samples and R3 tensors over HTTP (CONTRACT §1 close, §2)."""

import io
import json
from pathlib import Path

import numpy as np

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
