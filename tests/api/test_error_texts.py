"""Error texts a newcomer met and could not act on: each now says what to send.

Unknown parent on an empty session, a non-integer sample index (pydantic's
code leaked), a bare record posted as a turn, a trailing slash on a POST (a
bodiless 307) and a mistyped path (a bare "Not Found")."""

import base64

from tests.factory import open_body, turn

PROBLEM = "application/problem+json"


async def test_unknown_parent_on_an_empty_session_says_there_are_no_nodes(client, sid):
    assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 201
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2], [3], parent=0))
    assert r.status_code == 404, r.text
    problem = r.json()
    assert problem["field"] == "parent"
    assert "below 0" not in problem["expected"]
    assert problem["expected"] == "null (a new root): the session has no nodes yet"
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2], [3], parent=None))
    assert r.status_code == 201, r.text
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2, 3], [4], parent=7))
    assert r.json()["expected"] == "a seq in [0, 0] or null (a new root)"


async def test_a_non_integer_sample_index_expects_an_integer(client, sid):
    r = await client.get(f"/v1/sessions/{sid}/samples/abc/r3")
    assert r.status_code == 422
    assert r.json()["field"] == "index"
    assert r.json()["expected"] == "integer"
    r = await client.get(f"/v1/sessions/{sid}/samples/-1/r3")
    assert r.json()["expected"] == "integer >= 0"


async def test_a_bare_record_is_told_to_wrap_it(client, sid):
    assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 201
    record = turn([1, 2], [3])["record"]
    r = await client.post(f"/v1/sessions/{sid}/turns", json=record)
    assert r.status_code == 422
    problem = r.json()
    assert "unknown field" not in problem["detail"]
    assert "bare record" in problem["detail"] and '"record"' in problem["detail"]
    assert problem["field"] == "record"


async def test_a_trailing_slash_is_a_problem_naming_the_route(client):
    r = await client.post("/v1/sessions/", json={})
    assert r.status_code == 404
    assert r.headers["content-type"] == PROBLEM
    assert r.json()["detail"] == ("no route POST /v1/sessions/: drop the trailing slash "
                                  "(POST /v1/sessions)")


async def test_a_mistyped_path_is_a_problem_naming_it(client):
    r = await client.get("/v1/sesions")
    assert r.status_code == 404
    assert r.headers["content-type"] == PROBLEM
    assert "/v1/sesions" in r.json()["detail"]
    r = await client.delete("/v1/sessions")
    assert r.status_code == 405
    assert r.json()["detail"] == "DELETE is not allowed on /v1/sessions"


async def test_a_missing_record_is_reported_absent_not_null(client, sid):
    assert (await client.post("/v1/sessions", json=open_body(sid))).status_code == 201
    r = await client.post(f"/v1/sessions/{sid}/turns", json={"event_id": "e1"})
    assert r.status_code == 422, r.text
    problem = r.json()
    assert (problem["field"], problem["expected"], problem["actual"]) == (
        "record", "object", "absent")
    assert "missing" in problem["detail"]
    body = turn([1, 2], [3])
    del body["record"]["response"]
    r = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    assert (r.json()["field"], r.json()["actual"]) == ("record.response", "absent")
    # An explicit null is still reported as what was sent.
    body["record"]["response"] = None
    r = await client.post(f"/v1/sessions/{sid}/turns", json=body)
    assert (r.json()["field"], r.json()["actual"]) == ("record.response", "null")


async def test_an_r3_payload_of_a_partial_int32_names_its_unit(client, sid):
    assert (await client.post("/v1/sessions",
                              json=open_body(sid, r3={"num_layers": 1}))).status_code == 201
    six_bytes = base64.b64encode(b"\0" * 6).decode("ascii")
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2], [3], r3=six_bytes))
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["expected"] == "a byte length divisible by 4 (whole int32 values)"
    assert problem["actual"] == "6 bytes"


async def test_the_root_sends_a_browser_to_the_ui(client):
    r = await client.get("/", follow_redirects=False)
    assert r.status_code == 307
    assert r.headers["location"] == "/ui"
