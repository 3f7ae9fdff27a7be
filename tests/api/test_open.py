"""POST /v1/sessions: defaults, idempotent repeats and every rejection of CONTRACT §1."""

import pytest

from tests.factory import open_body


async def test_open_returns_summary_with_defaults(client, sid):
    r = await client.post("/v1/sessions", json=open_body(sid))
    assert r.status_code == 201
    body = r.json()
    assert body["session_id"] == sid
    assert body["pause_generation_mode"] == "retract"
    assert body["use_addition_r3"] is False
    assert body["spec"] is False and body["max_trim_tokens"] == 0
    assert body["status"] == "open" and body["num_nodes"] == 0
    assert "tree" not in body


async def test_identical_repeat_after_defaults_answers_200(client, sid):
    assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 201
    explicit = open_body(sid, pause_generation_mode="retract", spec=False, max_trim_tokens=0,
                         labels={})
    r = await client.post("/v1/sessions", json=explicit)
    assert r.status_code == 200


async def test_repeat_with_other_body_is_409(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    r = await client.post("/v1/sessions", json=open_body(sid, spec=True))
    assert r.status_code == 409
    assert r.json()["type"] == "urn:turnlog:session-conflict"
    assert r.headers["content-type"].startswith("application/problem+json")


async def test_version_true_is_v1_and_id_is_generated(client):
    r = await client.post("/v1/sessions", json={"version": True})
    assert r.status_code == 201
    assert r.json()["version"] == "v1"
    assert len(r.json()["session_id"]) == 32


async def test_in_place_derives_addition_r3(client, sid):
    r = await client.post("/v1/sessions", json=open_body(sid, pause_generation_mode="in_place",
                                                         r3={"num_layers": 4}))
    assert r.json()["use_addition_r3"] is True
    assert r.json()["r3"] == {"num_layers": 4}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "version"),
        ({"version": "v3"}, "version"),
        ({"version": False}, "version"),
        ({"version": "v2", "pause_generation_mode": "abort"}, "pause_generation_mode"),
        ({"version": "v2", "session_id": "has space"}, "session_id"),
        ({"version": "v2", "session_id": "x" * 129}, "session_id"),
        ({"version": "v2", "r3": {"num_layers": 0}}, "r3.num_layers"),
        ({"version": "v2", "r3": {"layers": 2}}, "r3.layers"),
        ({"version": "v2", "spec": "yes"}, "spec"),
        ({"version": "v2", "max_trim_tokens": -1}, "max_trim_tokens"),
        ({"version": "v2", "labels": []}, "labels"),
        ({"version": "v2", "colour": "blue"}, "colour"),
        ([], "body"),
    ],
)
async def test_bad_open_is_422_naming_the_field(client, body, field):
    r = await client.post("/v1/sessions", json=body)
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["type"] == "urn:turnlog:invalid-request"
    assert problem["field"] == field
    assert "expected" in problem


async def test_malformed_json_is_422(client):
    r = await client.post("/v1/sessions", content=b'{"version": "v2",',
                          headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["field"] == "body"


async def test_nan_is_rejected(client, sid):
    r = await client.post("/v1/sessions", content=b'{"version": "v2", "labels": {"x": NaN}}',
                          headers={"content-type": "application/json"})
    assert r.status_code == 422


async def test_unknown_session_is_404(client, sid):
    r = await client.get(f"/v1/sessions/{sid}")
    assert r.status_code == 404
    assert r.json()["type"] == "urn:turnlog:unknown-session"
