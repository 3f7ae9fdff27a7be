"""`/v1/metric-history` and `/v1/gates/evaluate` on both backends.

Each test uses its own run coordinate (a fresh test path), so baselines of
other tests never reach it.
"""

import asyncio
import uuid

import httpx
import pytest

from app.main import create_app
from tests.factory import open_body, turn

KL = "train/ppo_kl"
V1_TEXT = "rollout/tito_session_mismatch_rate/v1/assistant_text"
V2_TEXT = "rollout/tito_session_mismatch_rate/v2/assistant_text"
WIDE = {"rel_up": 1000, "rel_down": 1000}


def coordinate(suite="stage-c"):
    return {"test_path": f"tests/e2e/test_{uuid.uuid4().hex}.py", "backend": "cuda",
            "suite": suite}


def submission(coord, run_id, points, attempt=0, trusted=True):
    return {"coordinate": coord, "run_id": run_id, "attempt": attempt, "trusted": trusted,
            "points": [{"metric": m, "step": s, "value": v} for m, s, v in points]}


async def submit(client, *args, **kw):
    r = await client.post("/v1/metric-history", json=submission(*args, **kw))
    assert r.status_code in (200, 201), r.text
    return r.json()


async def history(client, coord, run_id):
    r = await client.get("/v1/metric-history", params={**coord, "run_id": run_id})
    assert r.status_code == 200, r.text
    return r.json()


async def evaluate(client, coord, run_id, specs=None, **extra):
    body = {"coordinate": coord, "run_id": run_id, **extra}
    if specs is not None:
        body["specs"] = specs
    r = await client.post("/v1/gates/evaluate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def judged_run(client, coord, run_id, value, specs, trusted=True):
    await submit(client, coord, run_id, [(KL, 0, value)], trusted=trusted)
    return await evaluate(client, coord, run_id, specs)


# --- metric history --------------------------------------------------------------------


async def test_a_submission_answers_the_runs_merged_series(client):
    coord = coordinate()
    r = await client.post("/v1/metric-history", json=submission(
        coord, "run-1", [(KL, 1, 0.5), (KL, 0, 0.25), ("perf/tokens_per_s", 0, 9.0)]))
    assert r.status_code == 201
    body = r.json()
    assert body["series"] == {KL: [[0, 0.25], [1, 0.5]]}
    assert (body["kept"], body["dropped"], body["attempts"]) == (2, ["perf/tokens_per_s"], [0])
    assert body["coordinate"] == coord and body["run_id"] == "run-1" and body["trusted"]


async def test_a_repeated_submission_is_stored_once(client):
    coord = coordinate()
    body = submission(coord, "run-1", [(KL, 0, 0.25)])
    first = await client.post("/v1/metric-history", json=body)
    again = await client.post("/v1/metric-history", json=body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()
    assert (await history(client, coord, "run-1"))["series"] == {KL: [[0, 0.25]]}


async def test_concurrent_repeats_store_the_submission_once(client):
    coord = coordinate()
    body = submission(coord, "run-1", [(KL, 0, 0.25)])
    replies = await asyncio.gather(*(client.post("/v1/metric-history", json=body)
                                     for _ in range(6)))
    assert sorted(r.status_code for r in replies) == [200] * 5 + [201]
    assert (await history(client, coord, "run-1"))["submissions"] == 1


async def test_non_finite_values_round_trip_as_marker_strings(client):
    coord = coordinate()
    await submit(client, coord, "r", [(KL, 0, "NaN"), (KL, 1, "Infinity"), (KL, 2, "-Infinity"),
                                      (KL, 3, 1e-300)])
    series = (await history(client, coord, "r"))["series"][KL]
    assert series == [[0, "NaN"], [1, "Infinity"], [2, "-Infinity"], [3, 1e-300]]


@pytest.mark.parametrize("value", ["nan", "1.0", None, True, [1.0], {"v": 1}])
async def test_a_non_numeric_value_is_422_naming_the_point_and_stores_nothing(client, value):
    coord = coordinate()
    body = submission(coord, "r", [(KL, 0, 1.0), (KL, 1, value)])
    r = await client.post("/v1/metric-history", json=body)
    assert r.status_code == 422
    assert r.json()["field"] == "points[1].value"
    assert (await history(client, coord, "r"))["series"] == {}


async def test_an_unknown_run_has_an_empty_history(client):
    body = await history(client, coordinate(), "never")
    assert (body["series"], body["attempts"], body["trusted"]) == ({}, [], False)


async def test_reading_history_needs_the_whole_coordinate(client):
    r = await client.get("/v1/metric-history", params={"test_path": "t", "run_id": "r"})
    assert r.status_code == 422 and r.json()["field"] in ("backend", "suite")


async def test_attempts_merge_by_concatenating_then_sorting_by_step(client):
    coord = coordinate()
    await submit(client, coord, "r", [(KL, 2, 0.2), (KL, 0, 0.0), (KL, None, 9.0)], attempt=0)
    await submit(client, coord, "r", [(KL, 1, 0.1), (KL, 2, 0.3)], attempt=1)
    body = await history(client, coord, "r")
    assert body["attempts"] == [0, 1] and body["submissions"] == 2
    assert body["series"][KL] == [[0, 0.0], [1, 0.1], [2, 0.2], [2, 0.3], [None, 9.0]]


async def test_v1_and_v2_series_never_merge(client):
    coord = coordinate()
    await submit(client, coord, "r", [(V1_TEXT, 0, 0.1), (V2_TEXT, 0, 0.2)])
    series = (await history(client, coord, "r"))["series"]
    assert series == {V1_TEXT: [[0, 0.1]], V2_TEXT: [[0, 0.2]]}


async def test_a_run_is_trusted_only_if_every_submission_says_so(client):
    coord = coordinate()
    await submit(client, coord, "r", [(KL, 0, 0.1)], attempt=0, trusted=True)
    assert (await history(client, coord, "r"))["trusted"] is True
    await submit(client, coord, "r", [(KL, 1, 0.1)], attempt=1, trusted=False)
    assert (await history(client, coord, "r"))["trusted"] is False


async def test_the_whitelist_is_configurable(settings):
    app = create_app(settings.replace(metric_keys="perf/tokens_per_s, train/x"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://turnlog") as http:
        body = await submit(http, coordinate(), "r", [(KL, 0, 1.0), ("perf/tokens_per_s", 0, 2.0)])
    await app.state.services.db.dispose()
    assert body["series"] == {"perf/tokens_per_s": [[0, 2.0]]} and body["dropped"] == [KL]


async def test_a_rollouts_metrics_are_recorded_as_one_step(client):
    label = f"run-{uuid.uuid4().hex}"
    mismatch = {"tito_session_mismatch": [{"type": "assistant_text"}]}
    for i, metadata in enumerate((mismatch, {"tito_session_mismatch": []})):
        sid = f"s-{uuid.uuid4().hex}"
        await client.post("/v1/sessions", json=open_body(
            sid, labels={"run_id": label, "rollout_id": 3}))
        await client.post(f"/v1/sessions/{sid}/turns", json=turn([1 + i], [2],
                                                                  metadata=metadata))
        await client.post(f"/v1/sessions/{sid}/close", json={})
    coord = coordinate()
    body = {"coordinate": coord, "run_id": "ci-1", "attempt": 0, "trusted": True, "step": 3,
            "labels": {"run_id": label, "rollout_id": 3}}
    r = await client.post("/v1/metric-history/rollout", json=body)
    assert r.status_code == 201, r.text
    reply = r.json()
    assert reply["metrics"] == (await client.get("/v1/metrics/rollout", params={
        "run_id": label, "rollout_id": "3"})).json()
    assert reply["series"] == {V2_TEXT: [[3, 0.5]]}
    # The computed metrics not whitelisted are named (a helper's finding: `[]`).
    assert reply["kept"] == 1 and reply["dropped"] == sorted(
        k for k, v in reply["metrics"].items()
        if k != V2_TEXT and isinstance(v, int | float) and not isinstance(v, bool))
    assert "sessions" in reply["dropped"]
    assert (await client.post("/v1/metric-history/rollout", json=body)).status_code == 200
    r = await client.post("/v1/metric-history/rollout", json={**body, "step": -1})
    assert r.status_code == 422 and r.json()["field"] == "step"


# --- gates -----------------------------------------------------------------------------


async def test_a_cold_start_is_inactive_trusted_and_becomes_the_baseline(client):
    coord = coordinate()
    verdict = await judged_run(client, coord, "r1", 1.0, [{"metric": KL, "steps": "all",
                                                           "constraint": WIDE}])
    (result,) = verdict["results"]
    assert (result["status"], result["value"], result["baseline"]) == ("INACTIVE", 1.0, None)
    assert (verdict["outcome"], verdict["exit_code"], verdict["trusted"]) == ("trusted", 0, True)
    assert verdict["recorded"] == {"rows": 1, "baseline": True}


async def test_a_value_inside_the_corridor_passes_with_baseline_lo_and_hi(client):
    coord = coordinate()
    specs = [{"metric": KL, "steps": [0], "constraint": {"rel_up": 0.5, "rel_down": 0.5}}]
    await judged_run(client, coord, "r1", 1.0, specs)
    await judged_run(client, coord, "r2", 3.0, [{**specs[0], "constraint": WIDE}])
    verdict = await judged_run(client, coord, "r3", 1.0, specs)
    (result,) = verdict["results"]
    assert (result["status"], result["step"], result["baseline"], result["baseline_n"]) == (
        "PASS", 0, 1.0, 1)
    assert (result["lo"], result["hi"]) == (0.5, 1.5)
    assert (result["steps_key"], result["constraint_key"]) == (
        "[0]", '{"rel_down":0.5,"rel_up":0.5}')


async def test_a_value_outside_the_corridor_fails_and_never_becomes_a_baseline(client):
    coord = coordinate()
    specs = [{"metric": KL, "steps": "last", "constraint": {"rel_up": 0.1, "rel_down": 0.1}}]
    await judged_run(client, coord, "r1", 1.0, specs)
    failed = await judged_run(client, coord, "r2", 5.0, specs)
    assert (failed["outcome"], failed["exit_code"]) == ("failed", 1)
    assert failed["results"][0]["status"] == "FAIL"
    assert failed["recorded"] == {"rows": 1, "baseline": False}
    later = await judged_run(client, coord, "r3", 1.05, specs)
    assert later["results"][0]["baseline"] == 1.0 and later["results"][0]["baseline_n"] == 1


async def test_an_untrusted_run_is_judged_but_never_a_baseline(client):
    coord = coordinate()
    specs = [{"metric": KL, "steps": "all", "constraint": WIDE}]
    pr = await judged_run(client, coord, "pr", 1.0, specs, trusted=False)
    assert pr["outcome"] == "trusted" and pr["recorded"]["baseline"] is False
    main = await judged_run(client, coord, "main", 1.0, specs)
    assert main["results"][0]["status"] == "INACTIVE"


async def test_the_baseline_is_the_mean_of_the_twenty_most_recent_trusted_values(client):
    coord = coordinate()
    specs = [{"metric": KL, "steps": "all", "constraint": WIDE}]
    for i in range(22):
        await judged_run(client, coord, f"r{i}", 1000.0 if i < 2 else float(i), specs)
    verdict = await judged_run(client, coord, "now", 1.0, specs)
    (result,) = verdict["results"]
    assert (result["baseline"], result["baseline_n"]) == (sum(range(2, 22)) / 20, 20)


async def test_baselines_are_kept_at_exactly_the_same_coordinate(client):
    coord = coordinate()
    specs = [{"metric": KL, "steps": "all", "constraint": {"rel_up": 1, "rel_down": 1}}]
    await judged_run(client, coord, "r1", 1.0, specs)
    other_suite = {**coord, "suite": "stage-b"}
    assert (await judged_run(client, other_suite, "r2", 1.0, specs))["results"][0][
        "status"] == "INACTIVE"
    float_literal = [{**specs[0], "constraint": {"rel_up": 1.0, "rel_down": 1.0}}]
    assert (await judged_run(client, coord, "r3", 1.0, float_literal))["results"][0][
        "status"] == "INACTIVE"
    assert (await judged_run(client, coord, "r4", 1.0, specs))["results"][0][
        "status"] == "PASS"


async def test_a_run_is_never_its_own_baseline(client):
    coord = coordinate()
    specs = [{"metric": KL, "steps": "all", "constraint": WIDE}]
    await judged_run(client, coord, "r1", 1.0, specs)
    again = await evaluate(client, coord, "r1", specs)
    assert again["results"][0]["status"] == "INACTIVE"


async def test_a_dry_run_records_nothing(client):
    coord = coordinate()
    specs = [{"metric": KL, "steps": "all", "constraint": WIDE}]
    await submit(client, coord, "r1", [(KL, 0, 1.0)])
    assert (await evaluate(client, coord, "r1", specs, record=False))["recorded"] is None
    assert (await judged_run(client, coord, "r2", 1.0, specs))["results"][0][
        "status"] == "INACTIVE"


async def test_default_specs_judge_every_default_gate(client):
    coord = coordinate()
    await submit(client, coord, "r1", [(KL, 0, 0.01), (V2_TEXT, 4, 0.0)])
    verdict = await evaluate(client, coord, "r1")
    by_metric = {}
    for r in verdict["results"]:
        by_metric.setdefault(r["metric"], []).append(r["status"])
    assert by_metric[KL] == ["INACTIVE"] and by_metric[V2_TEXT] == ["INACTIVE"]
    assert by_metric["train/grad_norm"] == ["ERROR"]
    assert (verdict["outcome"], verdict["exit_code"]) == ("error", 2)
    assert len(by_metric) == 7


async def test_duplicate_steps_across_attempts_are_an_error(client):
    coord = coordinate()
    await submit(client, coord, "r", [(KL, 0, 1.0)], attempt=0)
    await submit(client, coord, "r", [(KL, 0, 1.1)], attempt=1)
    verdict = await evaluate(client, coord, "r", [{"metric": KL}])
    (result,) = verdict["results"]
    assert result["status"] == "ERROR" and "appears 2 times" in result["detail"]
    assert verdict["recorded"] == {"rows": 0, "baseline": False}


async def test_a_non_finite_value_is_an_error_naming_it(client):
    coord = coordinate()
    await submit(client, coord, "r", [(KL, 0, "NaN")])
    (result,) = (await evaluate(client, coord, "r", [{"metric": KL}]))["results"]
    assert (result["status"], result["value"], result["step"]) == ("ERROR", "NaN", 0)


@pytest.mark.parametrize(("body", "field"), [
    ({"specs": [{"metric": KL, "steps": "first"}]}, "specs[0].steps"),
    ({"specs": [{"metric": "perf/x", "steps": "all"}]}, "specs[0].constraint"),
    ({"specs": {}}, "specs"),
    ({"record": "yes"}, "record"),
    ({"run_id": ""}, "run_id"),
    ({"extra": 1}, "extra"),
])
async def test_an_invalid_evaluation_request_is_422_naming_the_field(client, body, field):
    full = {"coordinate": coordinate(), "run_id": "r", **body}
    r = await client.post("/v1/gates/evaluate", json=full)
    assert r.status_code == 422 and r.json()["field"] == field
