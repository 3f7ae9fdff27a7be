"""Query filters of the list, feed and analytics routes, and the text fields of metric
history and gates: names and values the store cannot hold answer 422 problem+json."""


import pytest

from tests.api.helpers import opened
from tests.factory import open_body

LABEL_ROUTES = [("/v1/sessions", {}), ("/v1/analytics/spec", {"group_by": "run_id"}),
                ("/v1/metrics/rollout", {})]
ROUTE_IDS = ["list", "spec", "rollout"]
COORD = {"test_path": "tests/e2e/test_x.py", "backend": "cuda", "suite": "stage-c"}


def assert_422(r, field=None):
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == "urn:turnlog:invalid-request"
    if field is not None:
        assert r.json()["field"] == field


@pytest.mark.parametrize(("route", "base"), LABEL_ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("name", ["bad name", "x" * 65, "run/id", "é"])
async def test_bad_label_filter_names_are_422(client, route, base, name):
    assert_422(await client.get(route, params={**base, name: "1"}))


@pytest.mark.parametrize(("route", "base"), LABEL_ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("value", ["x" * 1025, "a\x00b"], ids=["long", "nul"])
async def test_unstorable_label_filter_values_are_422(client, route, base, value):
    assert_422(await client.get(route, params={**base, "run_id": value}), "run_id")


@pytest.mark.parametrize(("route", "base"), LABEL_ROUTES, ids=ROUTE_IDS)
async def test_label_filter_values_up_to_1024_characters_are_accepted(client, route, base,
                                                                      sid):
    value = "v" * 1024
    r = await client.post("/v1/sessions", json=open_body(sid, labels={"run_id": value}))
    assert r.status_code == 201
    r = await client.get(route, params={**base, "run_id": value})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("params", [{"limit": 0}, {"limit": "x"},
                                    {"wait": -1}, {"wait": "nan"},
                                    {"after": "not-a-cursor"}, {"after": "x" * 5000}])
async def test_bad_feed_parameters_are_422(client, params):
    assert_422(await client.get("/v1/events", params=params))


@pytest.mark.parametrize("params", [{"limit": 0}, {"status": "paused"},
                                    {"after": "%%%"}])
async def test_bad_list_parameters_are_422(client, params):
    assert_422(await client.get("/v1/sessions", params=params))


async def test_rollout_history_labels_are_validated(client):
    body = {"coordinate": COORD, "run_id": "r1", "attempt": 0, "step": 0,
            "labels": {"bad name": "x"}}
    assert_422(await client.post("/v1/metric-history/rollout", json=body))


@pytest.mark.parametrize("where", ["test_path", "run_id", "metric"])
async def test_metric_history_text_with_nul_is_422(client, where):
    coordinate = {**COORD, "test_path": "a\x00b"} if where == "test_path" else COORD
    body = {"coordinate": coordinate, "run_id": "r\x00" if where == "run_id" else "r1",
            "attempt": 0, "trusted": True,
            "points": [{"metric": "train/\x00kl" if where == "metric" else "train/ppo_kl",
                        "step": 0, "value": 1.0}]}
    assert_422(await client.post("/v1/metric-history", json=body))


async def test_metric_history_query_with_nul_is_422(client):
    r = await client.get("/v1/metric-history", params={**COORD, "test_path": "a\x00",
                                                       "run_id": "r1"})
    assert_422(r, "coordinate.test_path")


@pytest.mark.parametrize("body", [
    {"coordinate": COORD, "run_id": "r\x00"},
    {"coordinate": {**COORD, "suite": "\x00"}, "run_id": "r1"},
    {"coordinate": COORD, "run_id": "r1", "specs": [{"metric": "m\x00"}]},
])
async def test_gate_text_with_nul_is_422(client, body):
    assert_422(await client.post("/v1/gates/evaluate", json=body))


@pytest.mark.parametrize("session_id", ["a%00b", "x" * 129, "bad%20id", "%ED%A0%80"])
@pytest.mark.parametrize("suffix", ["", "/state", "/events", "/samples"])
async def test_malformed_session_ids_in_paths_are_unknown_sessions(client, session_id, suffix):
    r = await client.get(f"/v1/sessions/{session_id}{suffix}")
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["type"] == "urn:turnlog:unknown-session"


async def test_limit_and_wait_above_their_maxima_are_clamped(client):
    r = await client.get("/v1/events", params={"limit": 5000, "wait": 0})
    assert r.status_code == 200 and len(r.json()["events"]) <= 1000
    r = await client.get("/v1/sessions", params={"limit": 5000})
    assert r.status_code == 200 and len(r.json()["sessions"]) <= 1000


async def test_blank_query_values_mean_not_given(client):
    r = await client.get("/v1/sessions", params={"status": "", "after": "", "limit": ""})
    assert r.status_code == 200
    r = await client.get("/v1/events", params={"after": "", "limit": "", "wait": ""})
    assert r.status_code == 200


# --- more documented rules, one behaviour per test ---------------------


@pytest.mark.parametrize(("value", "query", "matches"), [
    (True, "true", True), (False, "false", True), (12, "12", True), (12, "12.0", False),
    (1.5, "1.5", True), (None, "null", True), ("12", "12", True), ("x", '"x"', False),
])
async def test_label_filters_compare_json_text_without_quotes_for_strings(
        client, sid, value, query, matches):
    await opened(client, sid, labels={"run_id": sid, "flag": value})
    page = (await client.get("/v1/sessions", params={"run_id": sid, "flag": query})).json()
    assert [s["session_id"] for s in page["sessions"]] == ([sid] if matches else [])
