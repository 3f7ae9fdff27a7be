"""Samples as the miles samples wire (safetensors): the same numbers as the JSON
samples and the `.npy` R3 tensors, for every kind of session (both backends)."""

from __future__ import annotations

import io
import json
import random
import struct

import httpx
import numpy as np
import pytest
from safetensors.numpy import load, save

from app.main import create_app
from app.sim.simulator import SessionSimulator, SimConfig, SimRates
from tests.factory import open_body, r3_b64, turn

ST = "application/x-safetensors"


def npy(content: bytes) -> np.ndarray:
    return np.load(io.BytesIO(content), allow_pickle=False)


async def play(client, sid, *, version="v2", mode="retract", layers=2, seed=0, turns=12,
               no_r3=0.0, close=None):
    config = SimConfig(session_id=sid, version=version, pause_generation_mode=mode,
                       num_layers=layers, speculative=True, max_trim_tokens=seed % 2,
                       labels={"run_id": "wire", "rollout_id": seed})
    sim = SessionSimulator(config, random.Random(seed), SimRates(no_r3=no_r3))
    assert (await client.post("/v1/sessions", json=sim.open_body())).status_code == 201
    for body in sim.random_session(turns):
        r = await client.post(f"/v1/sessions/{sid}/turns", json=body)
        assert r.status_code == 201, r.text
    r = await client.post(f"/v1/sessions/{sid}/close",
                          json=close if close is not None else {"metadata": {"reward": 0.5}})
    assert r.status_code == 200, r.text


async def wire(client, sid, **params):
    r = await client.get(f"/v1/sessions/{sid}/samples", params={"format": "safetensors",
                                                                 **params})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == ST
    assert int(r.headers["content-length"]) == len(r.content)
    return r.content


async def assert_wire_equals_json(client, sid):
    raw = await wire(client, sid)
    tensors = load(raw)
    doc = (await client.get(f"/v1/sessions/{sid}/samples")).json()
    meta = json.loads(tensors["_samples_meta"].tobytes().decode("utf-8"))
    assert tensors["_samples_meta"].dtype == np.uint8 and tensors["_samples_meta"].ndim == 1
    expected_names = {"_samples_meta"}
    assert meta["empty_reason"] == doc["empty_reason"]
    assert meta["session_metadata"]["session_id"] == sid
    assert meta["session_metadata"]["errors"] == doc["errors"]
    assert meta["session_metadata"]["session_metrics"] == doc["session_metrics"]
    assert len(meta["samples"]) == len(doc["samples"])
    for i, (sample, entry) in enumerate(zip(doc["samples"], meta["samples"], strict=True)):
        assert tensors[f"tokens.{i}"].dtype == np.int64
        assert tensors[f"tokens.{i}"].tolist() == sample["tokens"]
        assert tensors[f"loss_mask.{i}"].dtype == np.uint8
        assert tensors[f"loss_mask.{i}"].tolist() == sample["loss_mask"]
        assert tensors[f"rollout_log_probs.{i}"].dtype == np.float64
        assert tensors[f"rollout_log_probs.{i}"].tolist() == sample["rollout_log_probs"]
        expected_names |= {f"tokens.{i}", f"loss_mask.{i}", f"rollout_log_probs.{i}"}
        for key in ("response_length", "status", "weight_versions", "reward", "reward_source",
                    "spec_info"):
            assert entry[key] == sample[key], key
        assert entry["metadata"]["turnlog"] == {"session_id": sid, "index": i,
                                                "leaf": sample["leaf"], "path": sample["path"]}
        assert {k: v for k, v in entry["metadata"].items() if k != "turnlog"} == \
            sample["metadata"]
        if sample["r3"] is None:
            assert sorted(entry["nulls"]) == ["rollout_indexer_topk", "rollout_routed_experts"]
        else:
            assert entry["nulls"] == ["rollout_indexer_topk"]
            tensor = tensors[f"rollout_routed_experts.{i}"]
            r = await client.get(f"/v1/sessions/{sid}/samples/{i}/r3")
            assert tensor.dtype == np.int32 and tensor.tobytes() == npy(r.content).tobytes()
            assert list(tensor.shape) == sample["r3"]["shape"]
            expected_names.add(f"rollout_routed_experts.{i}")
    # Nothing unreferenced (the driver's decoder refuses it), nothing missing.
    assert set(tensors) == expected_names
    # The very bytes the safetensors library writes for the same tensors.
    assert raw == save(tensors)
    return doc, meta


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("mode", ["retract", "in_place"])
@pytest.mark.parametrize("seed", [1, 2])
async def test_wire_equals_json_samples_for_trees_retries_and_both_r3_modes(
        client, sid, version, mode, seed):
    await play(client, sid, version=version, mode=mode, seed=seed)
    doc, _ = await assert_wire_equals_json(client, sid)
    assert any(s["r3"] is not None for s in doc["samples"])
    if version == "v2":
        assert len(doc["samples"]) > 1


async def test_wire_equals_json_samples_under_truncation(client, sid):
    await play(client, sid, mode="in_place", seed=3, close={"max_seq_len": 40})
    doc, _ = await assert_wire_equals_json(client, sid)
    assert any(s["status"] == "truncated" for s in doc["samples"]) or \
        doc["empty_reason"] == "all_truncated"


async def test_wire_without_r3_names_the_null_tensor(client, sid):
    await play(client, sid, layers=None, seed=4)
    doc, meta = await assert_wire_equals_json(client, sid)
    assert all(s["r3"] is None for s in doc["samples"])
    assert not any(name.startswith("rollout_routed_experts") for name in load(
        await wire(client, sid)))


async def test_wire_of_a_session_without_turns_carries_only_the_meta(client, sid):
    await client.post("/v1/sessions", json=open_body(sid, labels={"model": "m"}))
    await client.post(f"/v1/sessions/{sid}/close", json={})
    raw = await wire(client, sid)
    tensors = load(raw)
    assert set(tensors) == {"_samples_meta"}
    meta = json.loads(tensors["_samples_meta"].tobytes())
    assert meta == {"samples": [], "empty_reason": "no_turns", "session_metadata": {
        "session_id": sid, "version": "v2", "labels": {"model": "m"},
        "session_metrics": None, "errors": []}}


async def test_response_and_prefix_cache_info_sum_the_kept_turns(client, sid, settings):
    await client.post("/v1/sessions", json=open_body(sid, r3={"num_layers": 2},
                                                     pause_generation_mode="in_place"))
    first = turn([1, 2, 3], [1001, 1002], r3=r3_b64(4, 2, 2), start=0)
    meta = first["record"]["response"]["choices"][0]["meta_info"]
    meta.update(cached_tokens=2, prompt_tokens=3)
    first["record"]["response"]["choices"][0]["message"]["content"] = "Hello"
    second = turn([1, 2, 3, 1001, 1002, 7], [1003], r3=r3_b64(2, 2, 2, seed=1), start=4)
    meta = second["record"]["response"]["choices"][0]["meta_info"]
    meta.update(cached_tokens=5, prompt_tokens="six")
    second["record"]["response"]["choices"][0]["message"]["content"] = None
    for body in (first, second):
        assert (await client.post(f"/v1/sessions/{sid}/turns", json=body)).status_code == 201
    await client.post(f"/v1/sessions/{sid}/close", json={})
    _, meta = await assert_wire_equals_json(client, sid)
    (entry,) = meta["samples"]
    assert entry["response"] == "Hello"
    assert entry["prefix_cache_info"] == {"cached_tokens": 7, "total_prompt_tokens": 3}
    # A fresh process folds the same facts back from the stored log.
    app = create_app(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://turnlog") as fresh:
        again = await fresh.get(f"/v1/sessions/{sid}/samples", params={"format": "safetensors"})
    await app.state.services.db.dispose()
    assert again.content == await wire(client, sid)


@pytest.mark.parametrize("bad", [-1, "7", 2.5, True, {"n": 1}, -(2**70)])
async def test_a_cached_or_prompt_count_that_is_not_one_is_stored_and_counts_0(
        client, sid, bad):
    """The wire counts such a value 0, so the turn carrying it is stored, not refused."""
    await client.post("/v1/sessions", json=open_body(sid))
    first = turn([1, 2, 3], [1001, 1002])
    first["record"]["response"]["choices"][0]["meta_info"].update(cached_tokens=bad,
                                                                   prompt_tokens=3)
    second = turn([1, 2, 3, 1001, 1002, 7], [1003])
    second["record"]["response"]["choices"][0]["meta_info"].update(cached_tokens=4,
                                                                    prompt_tokens=bad)
    for body in (first, second):
        r = await client.post(f"/v1/sessions/{sid}/turns", json=body)
        assert r.status_code == 201, r.text
    await client.post(f"/v1/sessions/{sid}/close", json={})
    _, meta = await assert_wire_equals_json(client, sid)
    (entry,) = meta["samples"]
    assert entry["prefix_cache_info"] == {"cached_tokens": 4, "total_prompt_tokens": 3}


async def test_a_sample_whose_r3_has_a_gap_makes_the_whole_reply_422(client, sid):
    await client.post("/v1/sessions", json=open_body(sid, r3={"num_layers": 2},
                                                     pause_generation_mode="in_place"))
    await client.post(f"/v1/sessions/{sid}/turns",
                      json=turn([1, 2, 3], [1001, 1002], r3=r3_b64(4, 2, 2), start=0))
    # The second turn returns no routed experts: its rows are missing.
    await client.post(f"/v1/sessions/{sid}/turns",
                      json=turn([1, 2, 3, 1001, 1002, 7], [1003], start=4, return_r3=False))
    await client.post(f"/v1/sessions/{sid}/close", json={})
    assert (await client.get(f"/v1/sessions/{sid}/samples")).status_code == 200
    r = await client.get(f"/v1/sessions/{sid}/samples", params={"format": "safetensors"})
    assert r.status_code == 422
    assert r.json()["type"] == "urn:turnlog:r3-gap"


async def test_accept_header_selects_safetensors_and_explicit_format_wins(client, sid):
    await play(client, sid, seed=5, turns=4)
    by_accept = await client.get(f"/v1/sessions/{sid}/samples", headers={"Accept": ST})
    assert by_accept.headers["content-type"] == ST
    assert by_accept.content == await wire(client, sid)
    as_json = await client.get(f"/v1/sessions/{sid}/samples", params={"format": "json"},
                               headers={"Accept": ST})
    assert as_json.headers["content-type"].startswith("application/json")
    listed = await client.get(f"/v1/sessions/{sid}/samples",
                              headers={"Accept": f"application/json;q=0.5, {ST.upper()}"})
    assert listed.headers["content-type"] == ST
    refused = await client.get(f"/v1/sessions/{sid}/samples",
                               headers={"Accept": f"{ST};q=0, application/json"})
    assert refused.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize("params", [{"format": "npz"}, {"format": "safetensors",
                                                        "arrays": "false"}])
async def test_bad_format_requests_are_422(client, sid, params):
    await play(client, sid, seed=6, turns=3)
    r = await client.get(f"/v1/sessions/{sid}/samples", params=params)
    assert r.status_code == 422 and r.json()["type"] == "urn:turnlog:invalid-request"


async def test_wire_of_an_open_session_is_409(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    r = await client.get(f"/v1/sessions/{sid}/samples", params={"format": "safetensors"})
    assert r.status_code == 409 and r.json()["type"] == "urn:turnlog:session-open"


def test_header_is_padded_to_eight_bytes_as_the_library_writes_it():
    from app.domain.projection.samples_wire import WireTensor, header

    tensors = [WireTensor("a", "I64", (3,), data=bytes(24))]
    raw = header(tensors) + bytes(24)
    assert raw == save({"a": np.zeros(3, np.int64)})
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0
