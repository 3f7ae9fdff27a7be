"""POST /v1/sessions: defaults, idempotent repeats and every rejection of docs/api.md §1.1."""

import uuid

import pytest

from tests.api.helpers import SUMMARY_KEYS, append, assert_problem, close, opened
from tests.factory import open_body, turn


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
    assert (r.json()["field"], r.json()["expected"], r.json()["actual"]) == \
        ("spec", "false", "true")


@pytest.mark.parametrize(("first", "second", "field", "expected", "actual"), [
    ({"labels": {"run_id": "a", "k": 1}}, {"labels": {"run_id": "b", "k": 1}},
     "labels.run_id", '"a"', '"b"'),
    ({"labels": {"run_id": "a"}}, {"labels": {"run_id": "a", "extra": "absent"}},
     "labels.extra", "absent", '"absent"'),
    ({"r3": {"num_layers": 4}}, {}, "r3", '{"num_layers": 4}', "null"),
    ({"labels": {"n": 1}}, {"labels": {"n": 1.0}}, "labels.n", "1", "1.0"),
    ({"labels": {"a.b": True}}, {"labels": {"a.b": False}}, 'labels["a.b"]', "true", "false"),
    ({"labels": {"a": {"sp ace": 1}}}, {"labels": {"a": {"sp ace": 2}}},
     'labels.a["sp ace"]', "1", "2"),
    ({"labels": {"a": [1, 2, 3]}}, {"labels": {"a": [1, 2, 3.0]}}, "labels.a[2]", "3", "3.0"),
    ({"labels": {"a": [{"b": 1}]}}, {"labels": {"a": [{"b": True}]}}, "labels.a[0].b", "1",
     "true"),
    ({"labels": {"a": [1]}}, {"labels": {"a": [1, 2]}}, "labels.a", "[1]", "[1, 2]"),
    ({"labels": {"long": "x" * 500}}, {"labels": {"long": "y"}}, "labels.long",
     '"' + "x" * 198 + "…", '"y"'),
])
async def test_a_conflicting_open_names_the_first_field_that_differs(
        client, sid, first, second, field, expected, actual):
    assert (await client.post("/v1/sessions", json=open_body(sid, **first))).status_code == 201
    r = await client.post("/v1/sessions", json=open_body(sid, **second))
    assert r.status_code == 409, r.text
    problem = r.json()
    assert (problem["field"], problem["expected"], problem["actual"]) == \
        (field, expected, actual)
    assert f"{field} is {expected} there, {actual} in this open" in problem["detail"]


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


async def test_abort_is_refused_with_what_to_use_instead(client, sid):
    r = await client.post("/v1/sessions", json=open_body(sid, pause_generation_mode="abort"))
    assert r.status_code == 422
    assert 'use "in_place"' in r.json()["detail"]


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


# --- more documented rules, one behaviour per test ---------------------


async def test_open_repeat_with_version_true_is_the_same_as_v1(client, sid):
    await opened(client, sid, version="v1", labels={"a": 1, "b": "x"})
    r = await client.post("/v1/sessions", json={"session_id": sid, "version": True,
                                                "labels": {"b": "x", "a": 1}, "r3": None})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == "v1"


async def test_a_generated_session_id_is_uuid4_hex(client):
    r = await client.post("/v1/sessions", json={"version": "v2"})
    assert r.status_code == 201
    generated = r.json()["session_id"]
    parsed = uuid.UUID(hex=generated)
    assert parsed.hex == generated and parsed.version == 4


async def test_two_opens_without_session_id_are_two_sessions(client):
    a = (await client.post("/v1/sessions", json={"version": "v2"})).json()["session_id"]
    b = (await client.post("/v1/sessions", json={"version": "v2"})).json()["session_id"]
    assert a != b


async def test_the_open_reply_is_the_session_summary_without_tree(client, sid):
    reply = await opened(client, sid, labels={"run_id": "r"})
    assert set(reply) == SUMMARY_KEYS
    full = (await client.get(f"/v1/sessions/{sid}")).json()
    assert {k: v for k, v in full.items() if k != "tree"} == reply


async def test_an_open_repeat_after_close_answers_200_with_the_current_summary(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3]))
    await close(client, sid)
    r = await client.post("/v1/sessions", json=open_body(sid))
    assert r.status_code == 200
    assert r.json()["status"] == "closed" and r.json()["num_nodes"] == 1
    assert r.json()["closed_at"] is not None


async def test_use_addition_r3_cannot_be_sent(client, sid):
    r = await client.post("/v1/sessions", json=open_body(sid, use_addition_r3=True))
    assert assert_problem(r, 422, "invalid-request")["field"] == "use_addition_r3"
