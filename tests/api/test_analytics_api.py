"""`GET /v1/analytics/spec` and `GET /v1/metrics/rollout` (docs/api.md §3–§5) on both backends.

Every test labels its sessions with a fresh `run_id` and filters on it, so
the shared database's other sessions never leak into the numbers.
"""

import asyncio
import uuid

import httpx
import pytest

from app.main import create_app
from app.settings import Settings
from app.store.engine import migrate
from tests.api.helpers import close, opened
from tests.conftest import backend_of
from tests.factory import open_body, turn

HOUR = 1764403200.0  # 2025-11-29T08:00:00Z


def run_id() -> str:
    return f"run-{uuid.uuid4().hex}"


async def open_session(client, labels, **over):
    sid = f"s-{uuid.uuid4().hex}"
    r = await client.post("/v1/sessions", json=open_body(sid, labels=labels, **over))
    assert r.status_code == 201, r.text
    return sid


async def append(client, sid, *turns):
    for body in turns:
        r = await client.post(f"/v1/sessions/{sid}/turns", json=body)
        assert r.status_code == 201, r.text


async def spec_groups(client, group_by, **filters):
    r = await client.get("/v1/analytics/spec", params={"group_by": group_by, **filters})
    assert r.status_code == 200, r.text
    return r.json()["groups"]


def root(i, **kw):
    """A turn that starts a new root (its prompt extends no earlier node)."""
    return turn([100 + i], [1, 2], **kw)


# --- analytics: the request ------------------------------------------------------------


@pytest.mark.parametrize("params", [{}, {"group_by": "session"}, {"group_by": ""}])
async def test_an_invalid_group_by_is_422_naming_group_by(client, params):
    r = await client.get("/v1/analytics/spec", params=params)
    assert r.status_code == 422
    body = r.json()
    assert body["type"] == "urn:turnlog:invalid-request" and body["field"] == "group_by"


async def test_a_malformed_label_filter_name_is_422(client):
    r = await client.get("/v1/analytics/spec", params={"group_by": "day", "bad name": "x"})
    assert r.status_code == 422 and r.json()["field"] == "bad name"


async def test_no_matching_turns_is_an_empty_list(client):
    assert await spec_groups(client, "weight_version", run_id=run_id()) == []


# --- analytics: the numbers ------------------------------------------------------------


async def test_turns_count_every_turn_but_sums_only_contributing_ones(client):
    rid = run_id()
    sid = await open_session(client, {"run_id": rid}, spec=True)
    await append(client, sid, root(0, spec=(2, 1, 3)), root(1, spec=(0, 9, 9)), root(2))
    (group,) = await spec_groups(client, "run_id", run_id=rid)
    assert group == {"key": rid, "sessions": 1, "turns": 3, "spec_num_correct_drafts": 1,
                     "spec_num_proposed_drafts": 3, "spec_verify_ct": 2,
                     "completion_tokens": 2, "accept_rate": 1 / 3, "accept_length": 1.0}


async def test_a_group_without_contributing_turns_has_zero_rates(client):
    rid = run_id()
    sid = await open_session(client, {"run_id": rid})
    await append(client, sid, root(0))
    (group,) = await spec_groups(client, "run_id", run_id=rid)
    assert group["turns"] == 1 and group["spec_verify_ct"] == 0
    assert group["accept_rate"] == 0.0 and group["accept_length"] == 0.0


async def test_rates_are_ratios_of_sums_not_means_of_ratios(client):
    rid = run_id()
    a = await open_session(client, {"run_id": rid})
    b = await open_session(client, {"run_id": rid})
    await append(client, a, root(0, spec=(1, 1, 1)))
    await append(client, b, root(0, spec=(9, 1, 9)))
    (group,) = await spec_groups(client, "run_id", run_id=rid)
    assert group["sessions"] == 2
    assert group["accept_rate"] == 2 / 10  # a mean of ratios would say (1 + 1/9) / 2


async def test_rates_are_float64_divisions_of_sums_beyond_2_pow_53(client):
    rid = run_id()
    sid = await open_session(client, {"run_id": rid})
    big = (1 << 52) - 2  # near the largest counter a turn may carry; the sums pass 2**53
    await append(client, sid, root(0, spec=(3, big, 3)), root(1, spec=(3, big + 2, 7)),
                 root(2, spec=(3, big, 5)))
    (group,) = await spec_groups(client, "run_id", run_id=rid)
    assert group["spec_num_correct_drafts"] == 3 * big + 2 > 2**53
    assert group["accept_rate"] == float(3 * big + 2) / float(15)


async def test_open_sessions_are_included(client):
    rid = run_id()
    closed = await open_session(client, {"run_id": rid})
    await append(client, closed, root(0, spec=(1, 1, 2)))
    await client.post(f"/v1/sessions/{closed}/close", json={})
    still_open = await open_session(client, {"run_id": rid})
    await append(client, still_open, root(0, spec=(1, 1, 2)))
    (group,) = await spec_groups(client, "run_id", run_id=rid)
    assert (group["sessions"], group["turns"], group["spec_verify_ct"]) == (2, 2, 2)


async def test_weight_version_groups_by_each_turns_own_version(client):
    rid = run_id()
    sid = await open_session(client, {"run_id": rid})
    await append(client, sid, root(0, spec=(1, 1, 1), weight_version="7"),
                 root(1, spec=(1, 0, 1), weight_version=8),
                 root(2, spec=(1, 1, 1), weight_version=None),
                 root(3, spec=(1, 1, 2), weight_version="7"))
    groups = await spec_groups(client, "weight_version", run_id=rid)
    assert [(g["key"], g["turns"], g["accept_rate"]) for g in groups] == [
        (None, 1, 1.0), ("7", 2, 2 / 3), ("8", 1, 0.0)]
    assert all(g["sessions"] == 1 for g in groups)


async def test_label_groups_use_the_labels_text_form(client):
    rid = run_id()
    numeric = await open_session(client, {"run_id": rid, "rollout_id": 12, "model": "m-a"})
    text = await open_session(client, {"run_id": rid, "rollout_id": "12", "model": "m-b"})
    unlabelled = await open_session(client, {"run_id": rid})
    for sid in (numeric, text, unlabelled):
        await append(client, sid, root(0, spec=(1, 1, 1)))
    by_rollout = await spec_groups(client, "rollout_id", run_id=rid)
    assert [(g["key"], g["sessions"]) for g in by_rollout] == [(None, 1), ("12", 2)]
    by_model = await spec_groups(client, "model", run_id=rid)
    assert [(g["key"], g["sessions"]) for g in by_model] == [(None, 1), ("m-a", 1), ("m-b", 1)]


async def test_groups_are_in_ascending_code_point_order_with_null_first(client):
    rid = run_id()
    versions = ["b", "B", "a", "10", "9", "é", "Z", None]
    sid = await open_session(client, {"run_id": rid})
    await append(client, sid, *(root(i, weight_version=v) for i, v in enumerate(versions)))
    groups = await spec_groups(client, "weight_version", run_id=rid)
    assert [g["key"] for g in groups] == [None, "10", "9", "B", "Z", "a", "b", "é"]


async def test_hour_and_day_group_by_the_records_utc_timestamp(client):
    rid = run_id()
    sid = await open_session(client, {"run_id": rid})
    stamps = [HOUR + 5, HOUR + 3599.9, HOUR + 3600, HOUR + 16 * 3600 + 1]
    await append(client, sid, *(root(i, timestamp=t, spec=(1, 1, 1))
                                for i, t in enumerate(stamps)))
    hours = await spec_groups(client, "hour", run_id=rid)
    assert [(g["key"], g["turns"]) for g in hours] == [
        ("2025-11-29T08:00:00Z", 2), ("2025-11-29T09:00:00Z", 1), ("2025-11-30T00:00:00Z", 1)]
    days = await spec_groups(client, "day", run_id=rid)
    assert [(g["key"], g["turns"]) for g in days] == [("2025-11-29", 3), ("2025-11-30", 1)]


async def test_label_filters_match_the_text_form_and_combine(client):
    rid = run_id()
    twelve = await open_session(client, {"run_id": rid, "rollout_id": 12})
    other = await open_session(client, {"run_id": rid, "rollout_id": 13})
    await append(client, twelve, root(0, spec=(1, 1, 1)))
    await append(client, other, root(0, spec=(1, 1, 1)), root(1, spec=(1, 1, 1)))
    (group,) = await spec_groups(client, "run_id", run_id=rid, rollout_id="12")
    assert (group["sessions"], group["turns"]) == (1, 1)
    assert await spec_groups(client, "run_id", run_id=rid, rollout_id='"12"') == []


# --- rollout metrics -------------------------------------------------------------------

MISMATCH = {"tito_session_mismatch": [{"type": "assistant_text", "segment_index": 1}]}
STRICT_MISMATCH = {"tito_session_mismatch": [{"type": "special_token_count"},
                                             {"type": "non_assistant_text"}]}


async def closed_session(client, labels, turns, version="v2", close=None, **over):
    sid = await open_session(client, labels, version=version, **over)
    await append(client, sid, *turns)
    r = await client.post(f"/v1/sessions/{sid}/close", json=close or {})
    assert r.status_code == 200, r.text
    return sid


async def rollout(client, **params):
    return await client.get("/v1/metrics/rollout", params=params)


async def test_rollout_metrics_cover_only_closed_matching_sessions(client):
    rid = run_id()
    await closed_session(client, {"run_id": rid}, [root(0)])
    still_open = await open_session(client, {"run_id": rid})
    await append(client, still_open, root(0))
    r = await rollout(client, run_id=rid)
    assert r.status_code == 200
    assert r.json() == {"sessions": 1, "samples": 1, "rollout/response_len/mean": 2.0,
                        "rollout/response_len/max": 2.0, "rollout/response_len/min": 2.0,
                        "rollout/truncated_ratio": 0.0}


async def test_no_matching_sessions_gives_zero_counts_and_rates(client):
    assert (await rollout(client, run_id=run_id())).json() == {
        "sessions": 0, "samples": 0, "rollout/response_len/mean": 0.0,
        "rollout/response_len/max": 0.0, "rollout/response_len/min": 0.0,
        "rollout/truncated_ratio": 0.0}


async def test_spec_rates_come_from_carriers_once_per_session(client):
    rid = run_id()
    # Two leaves share the first turn: summing per leaf would count it twice.
    shared = turn([1, 2], [3, 4], spec=(2, 2, 4))
    middle = turn([1, 2, 3, 4, 5], [6], spec=(1, 1, 1), parent=0)
    left = turn([1, 2, 3, 4, 5, 6, 9], [10], spec=(1, 0, 3), parent=1)
    right = turn([1, 2, 3, 4, 7], [8], spec=(0, 5, 5), parent=0)
    await closed_session(client, {"run_id": rid}, [shared, middle, left, right], spec=True)
    await closed_session(client, {"run_id": rid}, [root(0, spec=(5, 5, 5))])  # no `spec`
    body = (await rollout(client, run_id=rid)).json()
    assert body["sessions"] == 2 and body["samples"] == 3
    assert body["rollout/spec_accept_rate"] == 3 / 8
    assert body["rollout/spec_accept_length"] == 4 / 4


async def test_tito_keys_are_per_version_and_skip_samples_without_the_key(client):
    rid = run_id()
    await closed_session(client, {"run_id": rid}, [root(0, metadata=MISMATCH)], version="v1")
    await closed_session(client, {"run_id": rid},
                         [root(0, metadata={"tito_session_mismatch": []})], version="v2")
    await closed_session(client, {"run_id": rid}, [root(0)], version="v2")
    body = (await rollout(client, run_id=rid)).json()
    tito = {k: v for k, v in body.items() if "tito" in k}
    types = ("special_token_count", "special_token_type", "non_assistant_text",
             "assistant_text")
    expected = {}
    for version, rate in (("v1", 1.0), ("v2", 0.0)):
        expected[f"rollout/tito_session_mismatch_rate/{version}"] = rate
        for t in types:
            expected[f"rollout/tito_session_mismatch_rate/{version}/{t}"] = (
                rate if t == "assistant_text" else 0.0)
    assert tito == expected


async def test_response_length_and_truncation_statistics(client):
    rid = run_id()
    await closed_session(client, {"run_id": rid}, [turn([1], [2, 3, 4])])
    await closed_session(client, {"run_id": rid}, [turn([1], [2], finish_reason="length")])
    body = (await rollout(client, run_id=rid)).json()
    assert body["rollout/response_len/mean"] == 2.0
    assert (body["rollout/response_len/max"], body["rollout/response_len/min"]) == (3.0, 1.0)
    assert body["rollout/truncated_ratio"] == 0.5


async def test_strict_answers_409_naming_every_strict_type_with_a_non_zero_rate(client):
    rid = run_id()
    await closed_session(client, {"run_id": rid}, [root(0, metadata=STRICT_MISMATCH)])
    await closed_session(client, {"run_id": rid}, [root(0, metadata=MISMATCH)], version="v1")
    assert (await rollout(client, run_id=rid)).status_code == 200
    r = await rollout(client, run_id=rid, strict="true")
    assert r.status_code == 409
    body = r.json()
    assert body["type"] == "urn:turnlog:strict-tito"
    assert body["violations"] == [
        {"key": "rollout/tito_session_mismatch_rate/v2/non_assistant_text", "rate": 1.0},
        {"key": "rollout/tito_session_mismatch_rate/v2/special_token_count", "rate": 1.0}]
    assert "non_assistant_text" in body["detail"] and "special_token_count" in body["detail"]


async def test_strict_passes_when_only_assistant_text_mismatches(client):
    rid = run_id()
    await closed_session(client, {"run_id": rid}, [root(0, metadata=MISMATCH)])
    r = await rollout(client, run_id=rid, strict="true")
    assert r.status_code == 200
    assert r.json()["rollout/tito_session_mismatch_rate/v2/assistant_text"] == 1.0


async def test_strict_must_be_a_boolean(client):
    r = await rollout(client, run_id=run_id(), strict="maybe")
    assert r.status_code == 422 and r.json()["field"] == "strict"


# --- more documented rules, one behaviour per test ---------------------


async def test_analytics_label_filters_match_booleans(client, sid):
    await opened(client, f"{sid}-t", labels={"run_id": sid, "flag": True})
    await opened(client, f"{sid}-f", labels={"run_id": sid, "flag": False})
    await append(client, f"{sid}-t", turn([1], [2], spec=(1, 1, 2)))
    await append(client, f"{sid}-f", turn([1], [2], spec=(1, 1, 2)))
    r = await client.get("/v1/analytics/spec", params={"group_by": "run_id", "run_id": sid,
                                                       "flag": "true"})
    (group,) = r.json()["groups"]
    assert (group["key"], group["sessions"], group["turns"]) == (sid, 1, 1)
    assert set(group) == {"key", "sessions", "turns", "spec_num_correct_drafts",
                          "spec_num_proposed_drafts", "spec_verify_ct", "completion_tokens",
                          "accept_rate", "accept_length"}


async def test_rollout_metrics_over_v1_and_v2_never_share_a_tito_key(client, sid):
    for version in ("v1", "v2"):
        s = f"{sid}-{version}"
        await opened(client, s, version=version, labels={"run_id": sid})
        await append(client, s, turn([1, 2], [3], metadata={"tito_session_mismatch": (
            [{"type": "assistant_text"}] if version == "v2" else [])}))
        await close(client, s)
    body = (await client.get("/v1/metrics/rollout", params={"run_id": sid})).json()
    assert body["rollout/tito_session_mismatch_rate/v1"] == 0.0
    assert body["rollout/tito_session_mismatch_rate/v2"] == 1.0
    assert body["rollout/tito_session_mismatch_rate/v2/assistant_text"] == 1.0
    assert "rollout/tito_session_mismatch_rate" not in body
    assert (body["sessions"], body["samples"]) == (2, 2)


@pytest.mark.not_citus  # 2,100 appends; Citus sums as PostgreSQL does
async def test_counter_totals_past_64_bits_are_exact_or_a_clear_422(db_url, fresh_database):
    """Each counter may be up to 2^52; 2,100 such turns sum past 2^63. PostgreSQL sums
    exactly; SQLite's SUM stops there: a 422 naming the query, not a 503 'retry'. On a
    database of its own: sums past 2^63 in the shared one would do the same to every
    other test's unfiltered analytics."""
    backend = backend_of(db_url)
    own = fresh_database(backend)  # type: ignore[operator]
    await asyncio.to_thread(migrate.upgrade, own)  # it runs its own event loop
    app = create_app(Settings.load(database_url=own, migrate_on_start=False, api_tokens=""))
    big = 2 ** 52
    run = run_id()
    writer = app.state.services.writer
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://turnlog") as client:
            for _ in range(21):  # 21 x 100 turns (a session holds at most 1,024 nodes)
                sid = await open_session(client, {"run_id": run}, version="v2")
                # Through the store's writer (the route's own call), not HTTP: the
                # 2,100 appends are the set-up; the query is what is tested.
                for i in range(100):
                    written = await writer.append_turn(sid, root(i, spec=(big, big, big)))
                    assert written.created
            r = await client.get("/v1/analytics/spec", params={"group_by": "run_id"})
    finally:
        await app.state.services.db.dispose()
    if backend == "sqlite":
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "query"
    else:
        assert r.status_code == 200, r.text
        (group,) = r.json()["groups"]
        assert group["spec_verify_ct"] == 2100 * big and group["accept_rate"] == 1.0


@pytest.mark.parametrize(("path", "query", "field"), [
    ("/v1/analytics/spec", "group_by=day&run_id=a&run_id=b", "run_id"),
    ("/v1/analytics/spec", "group_by=day&group_by=hour", "group_by"),
    ("/v1/metrics/rollout", "run_id=a&run_id=a", "run_id"),
    ("/v1/sessions", "model=x&status=open&model=y", "model"),
    # Every API route: a tester's doubt (`step=1&step=2` answered for step 2 alone).
    ("/v1/consumers/g/acks", "step=1&step=2", "step"),
    ("/v1/events", "limit=1&after=&limit=2", "limit"),
    ("/v1/sessions/s/samples", "format=json&format=safetensors", "format"),
    ("/v1/sessions/s/events", "include_r3=false&include_r3=true", "include_r3"),
])
async def test_a_parameter_given_twice_is_422_naming_it(client, path, query, field):
    # A helper's finding: the last value won, so `run_id=a&run_id=b` answered for run b
    # alone (no session has two values of one label).
    r = await client.get(f"{path}?{query}")
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field and r.json()["expected"] == "each parameter at most once"
