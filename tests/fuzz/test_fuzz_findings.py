"""Inputs the fuzzers found answering 500, pinned as plain examples (each was a bug)."""

import pytest

from tests.factory import open_body, turn

COORD = {"test_path": "tests/e2e/test_x.py", "backend": "cuda", "suite": "stage-c"}


def with_output(entries):
    body = turn([1, 2], [3])
    meta = body["record"]["response"]["choices"][0]["meta_info"]
    meta["output_token_logprobs"] = entries
    meta.pop("completion_tokens")
    return body


@pytest.mark.parametrize(("entries", "field"), [
    ([[-0.5, -(2**70)]], "output_token_logprobs[0][1]"),   # numpy int64 overflow
    ([[10**400, 3]], "output_token_logprobs[0][0]"),       # float() overflow
    ([[-0.5, 3], [-(10**400), 4]], "output_token_logprobs[1][0]"),
])
async def test_output_numbers_beyond_int64_or_float64_are_422(client, sid, entries, field):
    await client.post("/v1/sessions", json=open_body(sid))
    r = await client.post(f"/v1/sessions/{sid}/turns", json=with_output(entries))
    assert r.status_code == 422, r.text
    assert r.json()["field"].endswith(field)
    assert (await client.get(f"/v1/sessions/{sid}")).json()["num_nodes"] == 0


async def test_an_integer_log_prob_within_float64_is_accepted(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    r = await client.post(f"/v1/sessions/{sid}/turns", json=with_output([[-(2**60), 3]]))
    assert r.status_code == 201, r.text


async def test_gate_constraint_beyond_float64_is_422(client):
    body = {"coordinate": COORD, "run_id": "r1", "specs": [
        {"metric": "train/ppo_kl", "constraint": {"rel_up": 10**400, "rel_down": 1}}]}
    r = await client.post("/v1/gates/evaluate", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "specs[0].constraint.rel_up"


async def test_metric_history_with_nul_is_422_not_a_database_error(client):
    # PostgreSQL refuses NUL in text columns; this was a 500 there.
    body = {"coordinate": {**COORD, "test_path": "a\x00"}, "run_id": "r1", "attempt": 0,
            "trusted": True, "points": [{"metric": "train/ppo_kl", "step": 0, "value": 1.0}]}
    r = await client.post("/v1/metric-history", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "coordinate.test_path"
