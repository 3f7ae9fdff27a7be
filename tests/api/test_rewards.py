"""Rewards recorded after the close (docs/api.md "Rewards"): statuses, which reward each
sample shows, the samples wire, events and the feed, rebuild, and consumer groups that
wait for rewarded sessions (every backend)."""

from __future__ import annotations

import asyncio
import json
import struct
import uuid
from typing import Any

import httpx
import msgspec
import pytest
from safetensors.numpy import load
from typer.testing import CliRunner

from app.cli import cli
from app.main import create_app
from app.store.engine.db import Database
from app.store.ops.rebuild import rebuild
from tests.api.helpers import append, assert_problem, close, opened
from tests.factory import turn

REPLY_KEYS = ["position", "type", "seq", "event_id", "recorded_at", "reward"]


def with_response_id(body: dict[str, Any], response_id: str) -> dict[str, Any]:
    body["record"]["response"]["id"] = response_id
    return body


async def two_leaves(client: httpx.AsyncClient, sid: str, ids: tuple[str, str] = ("r-a", "r-b"),
                     **close_body: Any) -> None:
    """A v2 session with two samples: index 0 ends at seq 1 (response id `ids[0]`),
    index 1 is the second root, seq 2 (response id `ids[1]`)."""
    await opened(client, sid)
    await append(client, sid, with_response_id(turn([1, 2], [3, 4]), "r-root"))
    await append(client, sid, with_response_id(turn([1, 2, 3, 4, 5], [6], parent=0), ids[0]))
    await append(client, sid, with_response_id(turn([9, 9], [8], parent=None), ids[1]))
    done = await close(client, sid, **close_body)
    assert [s["leaf"] for s in done["samples"]] == [1, 2]


async def reward(client: httpx.AsyncClient, sid: str, status: int = 201,
                 **body: Any) -> dict[str, Any]:
    body.setdefault("event_id", uuid.uuid4().hex)
    r = await client.post(f"/v1/sessions/{sid}/rewards", json=body)
    assert r.status_code == status, r.text
    reply: dict[str, Any] = r.json()
    return reply


async def shown(client: httpx.AsyncClient, sid: str) -> list[tuple[Any, Any]]:
    r = await client.get(f"/v1/sessions/{sid}/samples", params={"arrays": "false"})
    assert r.status_code == 200, r.text
    return [(s["reward"], s["reward_source"]) for s in r.json()["samples"]]


async def event_count(client: httpx.AsyncClient, sid: str) -> int:
    return len((await client.get(f"/v1/sessions/{sid}/events")).json())


# --- statuses ------------------------------------------------------------------------------


async def test_a_reward_is_201_and_replies_with_its_event(client, sid):
    await two_leaves(client, sid, metadata={"reward": 0.0})
    assert await shown(client, sid) == [(0.0, None), (0.0, None)]
    reply = await reward(client, sid, event_id="rm-1", reward=0.75, source="rm:v2")
    assert list(reply) == REPLY_KEYS
    assert reply["type"] == "reward_recorded" and reply["seq"] is None
    assert reply["event_id"] == "rm-1" and reply["recorded_at"].endswith("Z")
    assert reply["reward"] == {"event_id": "rm-1", "reward": 0.75, "sample": None,
                               "response_id": None, "source": "rm:v2"}
    assert await shown(client, sid) == [(0.75, "rm:v2"), (0.75, "rm:v2")]
    events = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert events[-1] == reply


async def test_an_identical_repeat_is_200_and_another_body_409(client, sid):
    await two_leaves(client, sid)
    first = await reward(client, sid, event_id="rm-1", reward=1, sample=0)
    again = await reward(client, sid, 200, event_id="rm-1", reward=1, sample=0)
    assert again == first
    # Defaults filled in: an explicit null is the same body.
    assert await reward(client, sid, 200, event_id="rm-1", reward=1, sample=0,
                        response_id=None, source=None) == first
    for other in ({"reward": 2}, {"reward": 1.0}, {"reward": 1, "sample": 1},
                  {"reward": 1, "sample": 0, "source": "x"}):
        r = await client.post(f"/v1/sessions/{sid}/rewards", json={"event_id": "rm-1", **other})
        assert assert_problem(r, 409, "idempotency-conflict")["field"] == "event_id"
    # A turn's event_id is taken too.
    turn_id = (await client.get(f"/v1/sessions/{sid}/events")).json()[1]["event_id"]
    r = await client.post(f"/v1/sessions/{sid}/rewards", json={"event_id": turn_id, "reward": 1})
    assert_problem(r, 409, "idempotency-conflict")
    assert await event_count(client, sid) == 6
    assert await shown(client, sid) == [(1, None), (None, None)]


async def test_an_open_session_is_409_and_unknown_targets_404(client, sid):
    await opened(client, sid)
    await append(client, sid, with_response_id(turn([1, 2], [3]), "r-a"))
    r = await client.post(f"/v1/sessions/{sid}/rewards", json={"event_id": "e", "reward": 1})
    assert_problem(r, 409, "session-open")
    await close(client, sid)
    for body, field in (({"sample": 1}, "sample"), ({"response_id": "r-zz"}, "response_id")):
        r = await client.post(f"/v1/sessions/{sid}/rewards",
                              json={"event_id": "e", "reward": 1, **body})
        assert assert_problem(r, 404, "unknown-sample")["field"] == field
    r = await client.post(f"/v1/sessions/{sid}-nope/rewards", json={"event_id": "e", "reward": 1})
    assert_problem(r, 404, "unknown-session")
    assert await event_count(client, sid) == 3
    assert await shown(client, sid) == [(None, None)]


@pytest.mark.parametrize(("body", "field"), [
    ({"reward": 1, "sample": 0, "response_id": "r-a"}, "response_id"),
    ({"reward": "1"}, "reward"),
    ({"reward": True}, "reward"),
    ({"reward": None}, "reward"),
    ({}, "reward"),
    ({"reward": 1, "sample": -1}, "sample"),
    ({"reward": 1, "sample": "0"}, "sample"),
    ({"reward": 1, "sample": 0.0}, "sample"),
    ({"reward": 1, "response_id": 7}, "response_id"),
    ({"reward": 1, "source": "s" * 129}, "source"),
    ({"reward": 1, "source": 3}, "source"),
    ({"reward": 1, "session": "x"}, "session"),
    ({"reward": 1, "event_id": ""}, "event_id"),
    ({"reward": 1, "event_id": None}, "event_id"),
])
async def test_ill_typed_bodies_are_422_naming_the_field(client, sid, body, field):
    await opened(client, sid)
    await append(client, sid, with_response_id(turn([1, 2], [3]), "r-a"))
    await close(client, sid)
    body = {"event_id": "e", **body}
    problem = assert_problem(await client.post(f"/v1/sessions/{sid}/rewards", json=body), 422,
                             "invalid-request")
    assert problem["field"] == field and "expected" in problem
    if field not in body:  # a missing field is reported absent, never as a null sent
        assert problem["actual"] == "absent"
    assert await event_count(client, sid) == 3


@pytest.mark.parametrize("text", [b'{"event_id": "e", "reward": 1e400}',
                                  b'{"event_id": "e", "reward": NaN}',
                                  b'{"event_id": "e", "reward": -Infinity}',
                                  b'{"event_id": "e", "reward": ' + b"9" * 400 + b"}"])
async def test_a_non_finite_reward_is_422(client, sid, text):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3]))
    await close(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/rewards", content=text,
                          headers={"content-type": "application/json"})
    assert_problem(r, 422, "invalid-request")
    assert r.json()["field"] == "reward"  # the field, not the body, for every form
    assert await event_count(client, sid) == 3


async def test_a_source_of_128_characters_is_accepted(client, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3]))
    await close(client, sid)
    await reward(client, sid, reward=-3, source="s" * 128)
    assert await shown(client, sid) == [(-3, "s" * 128)]


# --- which reward a sample shows -------------------------------------------------------------


async def test_a_per_sample_reward_wins_over_a_session_wide_one_recorded_before(client, sid):
    await two_leaves(client, sid, metadata={"reward": 0.5})
    await reward(client, sid, reward=1.0, source="wide")
    await reward(client, sid, reward=2.0, sample=1, source="one")
    assert await shown(client, sid) == [(1.0, "wide"), (2.0, "one")]


async def test_a_per_sample_reward_wins_over_a_session_wide_one_recorded_after(client, sid):
    await two_leaves(client, sid, metadata={"reward": 0.5})
    await reward(client, sid, reward=2.0, sample=1, source="one")
    assert await shown(client, sid) == [(0.5, None), (2.0, "one")]
    await reward(client, sid, reward=1.0, source="wide")
    assert await shown(client, sid) == [(1.0, "wide"), (2.0, "one")]
    # The latest of each kind wins.
    await reward(client, sid, reward=3.0, source="wide2")
    await reward(client, sid, reward=4.0, sample=1)
    assert await shown(client, sid) == [(3.0, "wide2"), (4.0, None)]


async def test_a_response_id_rewards_the_sample_whose_leaf_has_it(client, sid):
    await two_leaves(client, sid)
    await reward(client, sid, reward=0.25, response_id="r-b", source="rm")
    assert await shown(client, sid) == [(None, None), (0.25, "rm")]
    # An inner node's response id names no leaf.
    r = await client.post(f"/v1/sessions/{sid}/rewards",
                          json={"event_id": "e", "reward": 1, "response_id": "r-root"})
    assert_problem(r, 404, "unknown-sample")


async def test_any_response_id_a_leaf_holds_is_rewarded_empty_or_long(client, sid):
    # SGLang's response.id is whatever text the engine wrote: the reward names it as is.
    long = "chatcmpl-" + "y" * 1500
    await two_leaves(client, sid, ids=("", long))
    await reward(client, sid, reward=0.5, response_id=long)
    await reward(client, sid, reward=0.25, response_id="")
    assert await shown(client, sid) == [(0.25, None), (0.5, None)]


async def test_a_sample_index_beyond_any_session_is_404_not_422(client, sid):
    await two_leaves(client, sid)
    for index in (2, 2**31, 10**30):
        r = await client.post(f"/v1/sessions/{sid}/rewards",
                              json={"event_id": "e", "reward": 1, "sample": index})
        assert assert_problem(r, 404, "unknown-sample")["field"] == "sample"
    r = await client.post(f"/v1/sessions/{sid}/rewards",
                          json={"event_id": "e", "reward": 1, "response_id": ""})
    assert assert_problem(r, 404, "unknown-sample")["field"] == "response_id"
    assert await event_count(client, sid) == 5  # open, three turns, close: nothing stored


async def test_a_response_id_shared_by_several_leaves_rewards_each(client, sid):
    await two_leaves(client, sid, ids=("same", "same"), metadata={"reward": 0.0})
    await reward(client, sid, reward=0.5, response_id="same", source="rm")
    assert await shown(client, sid) == [(0.5, "rm"), (0.5, "rm")]
    await reward(client, sid, reward=9.0, source="wide")
    assert await shown(client, sid) == [(0.5, "rm"), (0.5, "rm")]


async def test_samples_json_of_every_reader_and_a_single_sample_show_the_reward(
        client, settings, sid):
    await two_leaves(client, sid)
    full = (await client.get(f"/v1/sessions/{sid}/samples")).json()["samples"]
    assert [(s["reward"], s["reward_source"]) for s in full] == [(None, None)] * 2
    # Another process, whose kept samples predate the reward.
    app = create_app(settings)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://turnlog") as other:
            assert await shown(other, sid) == [(None, None)] * 2
            await reward(client, sid, reward=1.5, sample=0, source="rm")
            assert await shown(other, sid) == [(1.5, "rm"), (None, None)]
    finally:
        await app.state.services.db.dispose()
    full = (await client.get(f"/v1/sessions/{sid}/samples")).json()["samples"]
    assert [(s["reward"], s["reward_source"]) for s in full] == [(1.5, "rm"), (None, None)]
    # The rest of a sample is unchanged by its reward.
    assert full[0]["tokens"] == [1, 2, 3, 4, 5, 6]


async def test_the_safetensors_wire_carries_reward_and_source(client, sid):
    await two_leaves(client, sid, metadata={"reward": 0.1})
    await reward(client, sid, reward=0.9, response_id="r-a", source="rm")
    r = await client.get(f"/v1/sessions/{sid}/samples", params={"format": "safetensors"})
    assert r.status_code == 200, r.text
    tensors = load(r.content)
    meta = json.loads(tensors["_samples_meta"].tobytes())
    assert [(s["reward"], s["reward_source"]) for s in meta["samples"]] == \
        [(0.9, "rm"), (0.1, None)]
    (length,) = struct.unpack("<Q", r.content[:8])
    assert json.loads(r.content[8:8 + length])["_samples_meta"]["dtype"] == "U8"
    assert len(r.content) == int(r.headers["content-length"])


# --- events, feed, rebuild -------------------------------------------------------------------


async def test_rewards_are_events_in_json_msgpack_and_the_feed(client, sid):
    await two_leaves(client, sid)
    first = await reward(client, sid, event_id="rm-1", reward=1, sample=0)
    second = await reward(client, sid, event_id="rm-2", reward=0.5, source="wide")
    events = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert [e["type"] for e in events] == ["session_opened"] + ["turn_recorded"] * 3 + [
        "session_closed", "reward_recorded", "reward_recorded"]
    assert events[-2:] == [first, second]
    after = (await client.get(f"/v1/sessions/{sid}/events",
                              params={"after": events[-2]["position"]})).json()
    assert after == [second]
    r = await client.get(f"/v1/sessions/{sid}/events",
                         headers={"accept": "application/msgpack"})
    assert r.headers["content-type"].startswith("application/msgpack")
    assert msgspec.msgpack.decode(r.content)[-2:] == [first, second]
    feed: list[dict[str, Any]] = []
    cursor = None
    while True:
        params = {"limit": 1000} if cursor is None else {"limit": 1000, "after": cursor}
        page = (await client.get("/v1/events", params=params)).json()
        feed += [e for e in page["events"] if e["session_id"] == sid]
        if not page["events"]:
            break
        cursor = page["next"]
    rewarded = [e for e in feed if e["type"] == "reward_recorded"]
    assert [e["position"] for e in rewarded] == [first["position"], second["position"]]
    assert all(e["seq"] is None for e in rewarded)


async def test_a_reward_beyond_64_bits_is_finite_and_read_back_as_json(client, sid):
    """MessagePack has no integer beyond 64 bits: such events are answered as JSON."""
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3]))
    await close(client, sid)
    big = 10**30
    await reward(client, sid, event_id="big", reward=big)
    assert await shown(client, sid) == [(big, None)]
    r = await client.get(f"/v1/sessions/{sid}/events",
                         headers={"accept": "application/msgpack"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json()[-1]["reward"]["reward"] == big


async def test_a_rebuild_reproduces_the_rewarded_projections(client, settings, sid):
    await two_leaves(client, sid, ids=("same", "same"), metadata={"reward": 0.0})
    await reward(client, sid, reward=1.0, sample=1, source="one")
    await reward(client, sid, reward=2.0, source="wide")
    await reward(client, sid, reward=3.0, response_id="same")
    before = await shown(client, sid)
    db = Database(settings.store.database_url, settings)
    try:
        report = await rebuild(db, sid)
        assert report.equal, report.mismatched
    finally:
        await db.dispose()
    assert await shown(client, sid) == before == [(3.0, None), (3.0, None)]


async def test_replay_folds_the_rewards_into_the_samples(client, db_url, sid):
    await two_leaves(client, sid)
    await reward(client, sid, reward=1.0, sample=0, source="one")
    await reward(client, sid, reward=2.0, source="wide")
    result = await asyncio.to_thread(CliRunner().invoke, cli,
                                     ["replay", sid, "--json", "--database-url", db_url])
    assert result.exit_code == 0, result.output
    samples = json.loads(result.stdout)["samples"]["samples"]
    assert [(s["reward"], s["reward_source"]) for s in samples] == await shown(client, sid) \
        == [(1.0, "one"), (2.0, "wide")]


# --- consumer groups -------------------------------------------------------------------------


def run_labels() -> dict[str, str]:
    return {"run_id": f"run-{uuid.uuid4().hex[:10]}"}


async def group(client: httpx.AsyncClient, labels: dict[str, str], **body: Any) -> str:
    name = f"g-{uuid.uuid4().hex[:12]}"
    r = await client.put(f"/v1/consumers/{name}", json={"labels": labels, **body})
    assert r.status_code == 201, r.text
    return name


async def claimed(client: httpx.AsyncClient, name: str, **body: Any) -> list[str]:
    r = await client.post(f"/v1/consumers/{name}/claims",
                          json={"claim_id": uuid.uuid4().hex, "limit": 10, **body})
    assert r.status_code == 201, r.text
    sessions: list[str] = r.json()["sessions"]
    return sessions


async def closed(client: httpx.AsyncClient, labels: dict[str, str], turns: int = 1,
                 **close_body: Any) -> str:
    sid = f"s-{uuid.uuid4().hex}"
    await opened(client, sid, labels=labels)
    for i in range(turns):
        await append(client, sid, turn([1, 2, 100 + i], [3], parent=None))
    await close(client, sid, **close_body)
    return sid


async def test_require_reward_is_part_of_the_group_definition(client):
    labels = run_labels()
    name = await group(client, labels, require_reward=True)
    doc = (await client.get(f"/v1/consumers/{name}")).json()
    assert doc["require_reward"] is True
    again = await client.put(f"/v1/consumers/{name}",
                             json={"labels": labels, "require_reward": True})
    assert again.status_code == 200 and again.json() == doc
    other = await client.put(f"/v1/consumers/{name}", json={"labels": labels})
    assert_problem(other, 409, "consumer-conflict")
    plain = await group(client, labels, require_reward=False)
    assert (await client.get(f"/v1/consumers/{plain}")).json()["require_reward"] is False
    bad = await client.put(f"/v1/consumers/g-{uuid.uuid4().hex[:8]}",
                           json={"require_reward": "yes"})
    assert assert_problem(bad, 422, "invalid-request")["field"] == "require_reward"


async def test_a_group_requiring_rewards_gets_a_session_only_once_rewarded(client):
    labels = run_labels()
    waiting = await group(client, labels, require_reward=True)
    plain = await group(client, labels)
    sid = await closed(client, labels, turns=2)
    assert await claimed(client, plain) == [sid]
    assert await claimed(client, waiting) == []
    assert (await client.get(f"/v1/consumers/{waiting}")).json()["available"] == 0
    # One of two samples rewarded: still waiting.
    await reward(client, sid, reward=1.0, sample=0)
    assert await claimed(client, waiting) == []
    await reward(client, sid, reward=0.0, sample=1)
    assert await claimed(client, waiting) == [sid]
    # Later rewards never hand it out twice.
    await reward(client, sid, reward=5.0)
    assert await claimed(client, waiting) == []


async def test_the_close_reward_or_no_samples_count_as_rewarded(client):
    labels = run_labels()
    waiting = await group(client, labels, require_reward=True)
    with_reward = await closed(client, labels, metadata={"reward": 1.0})
    no_samples = await closed(client, labels, turns=0)
    assert sorted(await claimed(client, waiting)) == sorted([with_reward, no_samples])


async def test_groups_defined_after_the_close_take_rewarded_sessions_by_their_from(client):
    labels = run_labels()
    unrewarded = await closed(client, labels)
    rewarded_early = await closed(client, labels, metadata={"reward": 1.0})
    beginning = await group(client, labels, require_reward=True)
    now = await group(client, labels, require_reward=True, **{"from": "now"})
    assert await claimed(client, beginning) == [rewarded_early]
    await reward(client, unrewarded, reward=1.0)
    assert await claimed(client, beginning) == [unrewarded]
    # Closed before the `now` group existed: never its session.
    assert await claimed(client, now) == []
    later = await closed(client, labels)
    await reward(client, later, reward=1.0)
    assert await claimed(client, now) == [later]


async def test_a_reward_wakes_a_waiting_claim(client):
    labels = run_labels()
    waiting = await group(client, labels, require_reward=True)
    sid = await closed(client, labels)
    pending = asyncio.create_task(claimed(client, waiting, wait=20))
    await asyncio.sleep(0.3)
    await reward(client, sid, reward=1.0)
    assert await asyncio.wait_for(pending, 25) == [sid]


async def test_rewards_at_the_edges_of_float64_leave_every_reader_answering(client, db_url,
                                                                            tmp_path):
    """Rewards §16 accepts (any finite number) and a close reward of free JSON (an
    integer of 400 digits): the UI's list and run pages and the Parquet export still
    answer — the run's reward range, mean and histogram stay finite."""
    labels = run_labels()
    edges = {"hi": 1e308, "hi2": 1e308, "lo": -1e308}
    for name, value in edges.items():
        sid = f"edge-{name}-{uuid.uuid4().hex[:6]}"
        await opened(client, sid, labels=labels)
        await append(client, sid, turn([1, 2], [3]))
        await close(client, sid)
        await reward(client, sid, reward=value)
    huge = f"edge-huge-{uuid.uuid4().hex[:6]}"
    await opened(client, huge, labels=labels)
    await append(client, huge, turn([1, 2], [3]))
    await close(client, huge, metadata={"reward": 10**400})
    for page in ("/ui", f"/ui?run_id={labels['run_id']}"):
        r = await client.get(page)
        assert r.status_code == 200, (page, r.text[:300])
    out = tmp_path / "edges.parquet"
    result = await asyncio.to_thread(
        CliRunner().invoke, cli, ["export", "--run-id", labels["run_id"], "--format", "parquet",
                                  "--out", str(out), "--database-url", db_url])
    assert result.exit_code == 0, result.output
    import pyarrow.parquet as pq

    rewards = sorted(r for r in pq.read_table(out).column("reward").to_pylist()
                     if r is not None)
    assert rewards == [-1e308, 1e308, 1e308]  # the 400-digit one is no float64: null
