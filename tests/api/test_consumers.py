"""Consumer groups: definition, claims under leases, acks, releases (both backends)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import pytest

from tests.factory import open_body, turn


def run_labels() -> dict[str, str]:
    return {"run_id": f"run-{uuid.uuid4().hex[:10]}"}


async def closed_session(client, labels, sid=None) -> str:
    sid = sid or f"s-{uuid.uuid4().hex}"
    assert (await client.post("/v1/sessions", json=open_body(sid, labels=labels))).status_code \
        == 201
    assert (await client.post(f"/v1/sessions/{sid}/turns",
                              json=turn([1, 2], [3, 4]))).status_code == 201
    assert (await client.post(f"/v1/sessions/{sid}/close", json={})).status_code == 200
    return sid


async def group(client, labels, start="beginning") -> str:
    name = f"g-{uuid.uuid4().hex[:12]}"
    r = await client.put(f"/v1/consumers/{name}", json={"labels": labels, "from": start})
    assert r.status_code == 201, r.text
    return name


async def claim(client, name, claim_id=None, **body):
    body = {"claim_id": claim_id or uuid.uuid4().hex, **body}
    return await client.post(f"/v1/consumers/{name}/claims", json=body)


def problem(r, status, slug):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["type"] == f"urn:turnlog:{slug}"
    return r.json()


async def test_put_answers_201_then_200_for_the_same_body_and_409_for_another(client):
    labels = run_labels()
    name = f"g-{uuid.uuid4().hex[:12]}"
    first = await client.put(f"/v1/consumers/{name}", json={"labels": labels})
    assert first.status_code == 201
    assert first.json() == {"group": name, "labels": labels, "from": "beginning",
                            "require_reward": False, "acked": 0, "leased": 0, "available": 0,
                            "oldest_available_closed_at": None}
    again = await client.put(f"/v1/consumers/{name}", json={"labels": labels,
                                                            "from": "beginning"})
    assert again.status_code == 200 and again.json() == first.json()
    problem(await client.put(f"/v1/consumers/{name}", json={"labels": {}}), 409,
            "consumer-conflict")


@pytest.mark.parametrize("body", [{"from": "yesterday"}, {"labels": []}, {"extra": 1},
                                  {"labels": {"bad key": "x"}}])
async def test_put_refuses_bad_bodies(client, body):
    problem(await client.put("/v1/consumers/g-bad", json=body), 422, "invalid-request")


async def test_a_bad_group_name_is_422_on_put_and_404_elsewhere(client):
    problem(await client.put("/v1/consumers/" + "x" * 65, json={}), 422, "invalid-request")
    problem(await client.get("/v1/consumers/" + "x" * 65), 404, "unknown-consumer")
    problem(await client.get("/v1/consumers/never-made"), 404, "unknown-consumer")
    problem(await claim(client, "never-made"), 404, "unknown-consumer")
    problem(await asyncio.wait_for(claim(client, "never-made", wait=5), 2), 404,
            "unknown-consumer")
    problem(await client.post("/v1/consumers/never-made/claims/c/ack", json={}), 404,
            "unknown-consumer")
    problem(await client.get("/v1/consumers/never-made/acks"), 404, "unknown-consumer")


async def test_from_beginning_takes_earlier_closes_and_from_now_only_later_ones(client):
    labels = run_labels()
    before = await closed_session(client, labels)
    everything = await group(client, labels)
    later = await group(client, labels, start="now")
    after = await closed_session(client, labels)
    other = await closed_session(client, run_labels())
    got = (await claim(client, everything, limit=10)).json()["sessions"]
    assert got == [before, after] and other not in got
    assert (await claim(client, later, limit=10)).json()["sessions"] == [after]


async def test_labels_match_as_label_filters_do(client):
    labels = {**run_labels(), "rollout_id": 12}
    mine = await closed_session(client, labels)
    await closed_session(client, {**labels, "rollout_id": 13})
    name = await group(client, {"run_id": labels["run_id"], "rollout_id": 12})
    assert (await client.get(f"/v1/consumers/{name}")).json()["labels"] == \
        {"run_id": labels["run_id"], "rollout_id": 12}
    later = await closed_session(client, labels)
    assert (await claim(client, name, limit=10)).json()["sessions"] == [mine, later]


async def test_claims_hand_out_oldest_close_first_with_epochs_counting_every_claim(client):
    labels = run_labels()
    sids = [await closed_session(client, labels) for _ in range(3)]
    name = await group(client, labels)
    first = await claim(client, name, limit=2)
    assert first.status_code == 201
    assert first.json()["sessions"] == sids[:2] and first.json()["epoch"] == 1
    second = (await claim(client, name, limit=2)).json()
    assert second["sessions"] == sids[2:] and second["epoch"] == 2
    empty = await claim(client, name, limit=2)
    assert empty.status_code == 201
    assert empty.json()["sessions"] == [] and empty.json()["epoch"] == 3


async def test_a_repeated_claim_id_answers_200_with_the_original_body(client):
    labels = run_labels()
    await closed_session(client, labels)
    name = await group(client, labels)
    first = await claim(client, name, "c-1", limit=5)
    repeat = await claim(client, name, "c-1", limit=1, lease_seconds=5)
    assert repeat.status_code == 200 and repeat.json() == first.json()
    # Even with a long wait and nothing left, the repeat answers at once.
    repeat = await asyncio.wait_for(claim(client, name, "c-1", wait=20), 3)
    assert repeat.status_code == 200 and repeat.json() == first.json()
    # Whatever the new body says: bounds, types and unknown fields are not judged again.
    for body in ({"limit": 0}, {"lease_seconds": 10**9}, {"wait": "soon"}, {"extra": 1}):
        repeat = await claim(client, name, "c-1", **body)
        assert repeat.status_code == 200 and repeat.json() == first.json()
    # A new claim_id with such a body is still refused, and takes no epoch.
    problem(await claim(client, name, "c-2", limit=0), 422, "invalid-request")
    assert (await claim(client, name, "c-3")).json()["epoch"] == first.json()["epoch"] + 1


@pytest.mark.parametrize("body", [{"limit": 0}, {"limit": 1001}, {"lease_seconds": 0},
                                  {"lease_seconds": 86401}, {"wait": 31}, {"wait": -1},
                                  {"limit": True}, {"claim_id": "no spaces"}])
async def test_claim_bounds_are_422(client, body):
    name = await group(client, run_labels())
    problem(await client.post(f"/v1/consumers/{name}/claims",
                              json={"claim_id": "c", **body}), 422, "invalid-request")


async def test_ack_records_the_step_once_and_answers_repeats_the_same(client):
    labels = run_labels()
    sids = [await closed_session(client, labels) for _ in range(2)]
    name = await group(client, labels)
    c = (await claim(client, name, limit=2)).json()
    url = f"/v1/consumers/{name}/claims/{c['claim_id']}/ack"
    r = await client.post(url, json={"sessions": [sids[1]], "step": 7})
    assert r.status_code == 200 and r.json() == {"acked": [sids[1]]}
    r = await client.post(url, json={"step": 8})
    assert r.json() == {"acked": sids}
    assert (await client.post(url, json={"step": 9})).json() == {"acked": sids}
    acks = (await client.get(f"/v1/consumers/{name}/acks")).json()["acks"]
    assert [(a["session_id"], a["step"], a["epoch"]) for a in acks] == \
        [(sids[1], 7, 1), (sids[0], 8, 1)]
    step7 = (await client.get(f"/v1/consumers/{name}/acks", params={"step": 7})).json()
    assert [a["session_id"] for a in step7["acks"]] == [sids[1]]
    doc = (await client.get(f"/v1/consumers/{name}")).json()
    assert (doc["acked"], doc["leased"], doc["available"]) == (2, 0, 0)
    # Acknowledged sessions are never handed out again.
    assert (await claim(client, name, limit=5)).json()["sessions"] == []


async def test_acks_page_with_an_opaque_cursor(client):
    labels = run_labels()
    sids = [await closed_session(client, labels) for _ in range(3)]
    name = await group(client, labels)
    c = (await claim(client, name, limit=3)).json()
    for sid in sids:
        await client.post(f"/v1/consumers/{name}/claims/{c['claim_id']}/ack",
                          json={"sessions": [sid], "step": 1})
    seen, after = [], ""
    for _ in range(5):
        page = (await client.get(f"/v1/consumers/{name}/acks",
                                 params={"limit": 2, "after": after})).json()
        seen += [a["session_id"] for a in page["acks"]]
        after = page["next"]
        if not page["acks"]:
            break
    assert seen == sids


async def test_ack_or_release_of_a_session_outside_the_claim_is_422(client):
    labels = run_labels()
    sid = await closed_session(client, labels)
    name = await group(client, labels)
    c = (await claim(client, name)).json()
    for action in ("ack", "release"):
        problem(await client.post(f"/v1/consumers/{name}/claims/{c['claim_id']}/{action}",
                                  json={"sessions": [sid, "s-stranger"]}), 422,
                "invalid-request")
    problem(await client.post(f"/v1/consumers/{name}/claims/nope/ack", json={}), 404,
            "unknown-claim")
    problem(await client.post(f"/v1/consumers/{name}/claims/{c['claim_id']}/ack",
                              json={"step": -1}), 422, "invalid-request")


async def test_released_sessions_are_available_at_once(client):
    labels = run_labels()
    sid = await closed_session(client, labels)
    name = await group(client, labels)
    c = (await claim(client, name)).json()
    doc = (await client.get(f"/v1/consumers/{name}")).json()
    assert (doc["leased"], doc["available"]) == (1, 0)
    r = await client.post(f"/v1/consumers/{name}/claims/{c['claim_id']}/release", json={})
    assert r.json() == {"released": [sid]}
    doc = (await client.get(f"/v1/consumers/{name}")).json()
    assert (doc["leased"], doc["available"]) == (0, 1)
    assert doc["oldest_available_closed_at"].endswith("Z")
    again = (await claim(client, name)).json()
    assert again["sessions"] == [sid] and again["epoch"] == 2


async def test_an_expired_lease_is_claimable_and_the_late_ack_then_loses(client):
    labels = run_labels()
    sid = await closed_session(client, labels)
    name = await group(client, labels)
    old = (await claim(client, name, lease_seconds=1)).json()
    assert (await claim(client, name)).json()["sessions"] == []
    await asyncio.sleep(1.1)
    new = (await claim(client, name)).json()
    assert new["sessions"] == [sid]
    body = problem(await client.post(f"/v1/consumers/{name}/claims/{old['claim_id']}/ack",
                                     json={"step": 1}), 409, "lease-lost")
    assert body["sessions"] == [sid]
    assert (await client.get(f"/v1/consumers/{name}")).json()["acked"] == 0
    r = await client.post(f"/v1/consumers/{name}/claims/{new['claim_id']}/ack", json={})
    assert r.json() == {"acked": [sid]}


async def test_a_late_ack_wins_when_nobody_reclaimed(client):
    labels = run_labels()
    sid = await closed_session(client, labels)
    name = await group(client, labels)
    old = (await claim(client, name, lease_seconds=1)).json()
    await asyncio.sleep(1.1)
    r = await client.post(f"/v1/consumers/{name}/claims/{old['claim_id']}/ack", json={"step": 3})
    assert r.status_code == 200 and r.json() == {"acked": [sid]}
    assert (await claim(client, name)).json()["sessions"] == []


async def test_a_lost_session_fails_the_whole_ack(client):
    labels = run_labels()
    sids = [await closed_session(client, labels) for _ in range(2)]
    name = await group(client, labels)
    old = (await claim(client, name, limit=2, lease_seconds=1)).json()
    await asyncio.sleep(1.1)
    await claim(client, name, limit=1)  # re-claims sids[0] only
    problem(await client.post(f"/v1/consumers/{name}/claims/{old['claim_id']}/ack", json={}),
            409, "lease-lost")
    doc = (await client.get(f"/v1/consumers/{name}")).json()
    assert doc["acked"] == 0 and doc["leased"] == 1 and doc["available"] == 1
    assert sids[1] in old["sessions"]


async def test_a_waiting_claim_wakes_when_a_matching_session_closes(client):
    labels = run_labels()
    name = await group(client, labels)
    waiting = asyncio.create_task(claim(client, name, wait=10))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    sid = await closed_session(client, labels)
    r = await asyncio.wait_for(waiting, 5)
    assert r.json()["sessions"] == [sid] and r.json()["epoch"] == 1


async def test_eight_concurrent_claimers_hand_every_session_to_exactly_one_ack(client):
    labels = run_labels()
    sids = [await closed_session(client, labels) for _ in range(40)]
    name = await group(client, labels)
    acked: Counter[str] = Counter()
    epochs: list[int] = []

    async def trainer(k: int) -> None:
        n = 0
        while True:
            c = (await claim(client, name, f"t{k}-{n}", limit=3)).json()
            epochs.append(c["epoch"])
            n += 1
            if not c["sessions"]:
                return
            r = await client.post(f"/v1/consumers/{name}/claims/{c['claim_id']}/ack",
                                  json={"step": k})
            assert r.status_code == 200, r.text
            acked.update(r.json()["acked"])

    await asyncio.gather(*(trainer(k) for k in range(8)))
    assert acked == Counter(sids)
    assert sorted(epochs) == list(range(1, len(epochs) + 1))
    doc = (await client.get(f"/v1/consumers/{name}")).json()
    assert (doc["acked"], doc["leased"], doc["available"]) == (40, 0, 0)


async def test_metrics_show_consumer_counts_and_lag(client):
    labels = run_labels()
    await closed_session(client, labels)
    name = await group(client, labels)
    text = (await client.get("/metrics")).text
    assert f'turnlog_consumer_sessions{{group="{name}",state="available"}} 1.0' in text
    assert f'turnlog_consumer_lag_seconds{{group="{name}"}}' in text


@pytest.mark.parametrize("step", ["", "-1", str(2**63), "x"])
async def test_ack_list_step_filter_is_checked(client, step):
    name = await group(client, run_labels())
    r = await client.get(f"/v1/consumers/{name}/acks", params={"step": step})
    if step == "":
        assert r.status_code == 200
    else:
        problem(r, 422, "invalid-request")


async def test_sessions_closing_while_a_group_is_defined_join_it_exactly_once(client):
    labels = run_labels()
    opened = []
    for _ in range(12):
        sid = f"s-{uuid.uuid4().hex}"
        await client.post("/v1/sessions", json=open_body(sid, labels=labels))
        await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2], [3, 4]))
        opened.append(sid)
    name = f"g-{uuid.uuid4().hex[:12]}"

    async def close(sid):
        assert (await client.post(f"/v1/sessions/{sid}/close", json={})).status_code == 200

    define = client.put(f"/v1/consumers/{name}", json={"labels": labels})
    results = await asyncio.gather(define, *(close(sid) for sid in opened))
    assert results[0].status_code == 201
    got = (await claim(client, name, limit=100)).json()["sessions"]
    assert sorted(got) == sorted(opened)


async def test_the_same_claim_id_sent_twice_at_once_takes_one_batch(client):
    labels = run_labels()
    for _ in range(4):
        await closed_session(client, labels)
    name = await group(client, labels)
    replies = await asyncio.gather(*(claim(client, name, "same", limit=2) for _ in range(4)))
    assert sorted(r.status_code for r in replies) == [200, 200, 200, 201]
    assert len({str(r.json()) for r in replies}) == 1
    doc = (await client.get(f"/v1/consumers/{name}")).json()
    assert (doc["leased"], doc["available"]) == (2, 2)
    assert (await claim(client, name)).json()["epoch"] == 2
