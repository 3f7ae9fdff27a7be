"""`…/samples/{i}/r3?rows=a:b&layers=c:d` over HTTP (both backends)."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest

from app.sim.simulator import SessionSimulator, SimConfig, SimRates
from tests.factory import open_body, r3_b64, turn


def npy(content: bytes) -> np.ndarray:
    return np.load(io.BytesIO(content), allow_pickle=False)


async def session(client, sid, mode):
    config = SimConfig(session_id=sid, version="v2", pause_generation_mode=mode,
                       num_layers=5, topk=3, labels={})
    sim = SessionSimulator(config, random.Random(7), SimRates(retry=0.0, new_root=0.0))
    await client.post("/v1/sessions", json=sim.open_body())
    for body in sim.random_session(6):
        assert (await client.post(f"/v1/sessions/{sid}/turns", json=body)).status_code == 201
    await client.post(f"/v1/sessions/{sid}/close", json={})
    full = await client.get(f"/v1/sessions/{sid}/samples/0/r3")
    assert full.status_code == 200
    return npy(full.content)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_slices_equal_slicing_the_full_tensor(client, sid, mode):
    full = await session(client, sid, mode)
    rows = full.shape[0]
    cases = [("", "1:3"), ("1:3", ""), (":", ":"), (f"{rows // 3}:{rows - 1}", "2:"),
             (f"{rows}:", ":0"), ("0:1", "4:5"), (":", f"0:{full.shape[1]}"),
             # no layers but some rows: a header alone, shape (rows, 0, topk)
             ("1:3", "2:2"), (":", "5:")]
    for row_text, layer_text in cases:
        r = await client.get(f"/v1/sessions/{sid}/samples/0/r3",
                             params={"rows": row_text, "layers": layer_text})
        assert r.status_code == 200, (row_text, layer_text, r.text)
        assert int(r.headers["content-length"]) == len(r.content)
        a, b = (int(x) if x else None for x in (row_text or ":").split(":"))
        c, d = (int(x) if x else None for x in (layer_text or ":").split(":"))
        expected = np.ascontiguousarray(full[a:b, c:d, :])
        got = npy(r.content)
        assert got.shape == expected.shape and got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("params", [{"rows": "0:100000"}, {"layers": "0:6"}, {"rows": "3:1"},
                                    {"layers": "x"}, {"rows": "-1:"}, {"rows": "1:2\n"},
                                    {"layers": "0:1\n"}])
async def test_out_of_range_bounds_are_422(client, sid, params):
    await session(client, sid, "in_place")
    r = await client.get(f"/v1/sessions/{sid}/samples/0/r3", params=params)
    assert r.status_code == 422
    assert r.json()["type"] == "urn:turnlog:invalid-request"
    assert r.json()["field"] == next(iter(params))


async def test_no_r3_and_gaps_answer_before_the_bounds(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2], [3]))
    await client.post(f"/v1/sessions/{sid}/close", json={})
    r = await client.get(f"/v1/sessions/{sid}/samples/0/r3", params={"rows": "9:1"})
    assert r.status_code == 404

    gap = sid + "-gap"
    await client.post("/v1/sessions", json=open_body(gap, r3={"num_layers": 2},
                                                     pause_generation_mode="in_place"))
    await client.post(f"/v1/sessions/{gap}/turns",
                      json=turn([1, 2, 3], [1001, 1002], r3=r3_b64(4, 2, 2), start=0))
    await client.post(f"/v1/sessions/{gap}/turns",
                      json=turn([1, 2, 3, 1001, 1002, 7], [1003], start=4, return_r3=False))
    await client.post(f"/v1/sessions/{gap}/close", json={})
    r = await client.get(f"/v1/sessions/{gap}/samples/0/r3", params={"rows": "9:1"})
    assert r.status_code == 422 and r.json()["type"] == "urn:turnlog:r3-gap"
