"""The store's own contract, driven through `Writer`, `Reader` and `SampleReader` directly.

Written once and run on every backend (the `db_url` fixture), in the manner of
pyeventsourcing's recorder tests: what the HTTP layer relies on — open, append,
idempotent repeats, conflicts, unknown sessions and parents, events read back
exactly, resume state, close, samples, R3 and the feed's commit order — holds
at the store's interface, whichever database is underneath. The stores are
built as `app.services.build_services` builds them for the API; a second
store with an empty state cache plays "another process" reading the same log.
"""

from __future__ import annotations

import asyncio
import base64
import io
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from app.domain.body.labels import parse_label_filters
from app.domain.body.queries import EVENTS_PAGE, SESSIONS_PAGE
from app.domain.errors import (
    IdempotencyConflict,
    SessionClosed,
    SessionConflict,
    SessionOpen,
    UnknownParent,
    UnknownSample,
    UnknownSession,
)
from app.domain.wire import jsonio
from app.services import Services, build_services
from app.settings import Settings
from tests.factory import open_body, r3_b64, turn

L, K = 2, 2
StoreFactory = Callable[[], Awaitable[Services]]


@pytest.fixture
async def stores(db_url: str) -> AsyncIterator[StoreFactory]:
    """`await make()`: a new store on the test database, with its own state cache."""
    made: list[Services] = []

    async def make() -> Services:
        made.append(build_services(Settings.load(database_url=db_url, migrate_on_start=False,
                                            api_tokens="")))
        return made[-1]

    yield make
    for svc in made:
        await svc.db.dispose()


@pytest.fixture
async def store(stores: StoreFactory) -> Services:
    return await stores()


async def opened(store: Services, sid: str, **over: Any) -> None:
    _, created = await store.writer.open_session(open_body(sid, **over))
    assert created


async def feed_tail(store: Services) -> str:
    cursor: str | None = None
    while True:
        page = await store.reader.feed(cursor, 1000, None)
        cursor = page["next"]
        if not page["events"]:
            return cursor


async def event_count(store: Services, sid: str) -> int:
    return len(await store.reader.session_events(sid, None, EVENTS_PAGE.default, True))


# --- open ---------------------------------------------------------------------------------


async def test_open_creates_once_and_an_identical_repeat_is_not_created(store, sid):
    first, created = await store.writer.open_session(open_body(sid, labels={"run_id": "r"}))
    again, created_again = await store.writer.open_session(
        open_body(sid, labels={"run_id": "r"}, pause_generation_mode="retract"))
    assert (created, created_again) == (True, False)
    assert first == again and first.session_id == sid
    assert await event_count(store, sid) == 1


async def test_open_with_another_definition_is_a_session_conflict(store, sid):
    await opened(store, sid)
    with pytest.raises(SessionConflict):
        await store.writer.open_session(open_body(sid, version="v1"))
    assert (await store.reader.summary(sid))["version"] == "v2"


OPENS = [
    {},
    {"labels": {"run_id": "r", "rollout_id": 7, "temperature": 0.7, "eval": True,
                "note": "ünïcødé \u2028 \"quoted\""}},
    {"labels": {"k": "v"}, "opened_by": "gateway", "r3": {"num_layers": 48},
     "spec": True, "max_trim_tokens": 3, "pause_generation_mode": "in_place"},
    {"version": "v1", "labels": {}},
]


@pytest.mark.parametrize("over", OPENS)
async def test_an_open_answers_the_session_as_a_read_gives_it(store, sid, over):
    """The open's reply is built from the row it wrote (one round trip on PostgreSQL,
    migration 0010), not read back: it must equal what a read of the session gives,
    and the labels and the `session_opened` event must be written as a read finds them."""
    # A label with the session's own id: other tests' sessions share the database (and
    # some of these labels), a filter on it narrows the list to this test's session.
    over = {**over, "labels": {**over.get("labels", {}), "test": sid}}
    opened = await store.writer.open(open_body(sid, **over))
    assert opened.created and opened.summary == await store.reader.summary(sid)
    for key, value in over["labels"].items():
        text = value if isinstance(value, str) else jsonio.dumps(value)
        for probe, found in ((text, [sid]), (text + "-not", [])):
            page = await store.reader.list_sessions(
                None, None, SESSIONS_PAGE.default,
                parse_label_filters({key: probe, "test": sid} if key != "test" else {key: probe}))
            assert [s["session_id"] for s in page["sessions"]] == found, (key, value)
    [event] = await store.reader.session_events(sid, None, EVENTS_PAGE.default, True)
    assert event["type"] == "session_opened"
    assert event["session"] == opened.definition.body()
    repeat = await store.writer.open(open_body(sid, **over))
    assert (repeat.created, repeat.summary) == (False, None)


async def test_concurrent_opens_of_one_id_open_it_once(stores, sid):
    """Two writers (separate pools and caches) open the same id at once, some with
    the same body and some with another: exactly one opens it, the same body is a
    repeat, another body a conflict, and the log holds one `session_opened`."""
    writers = [await stores() for _ in range(2)]
    bodies = [open_body(sid, labels={"run_id": "a"}) if i % 3 else
              open_body(sid, labels={"run_id": "b"}) for i in range(9)]
    answers = await asyncio.gather(
        *(writers[i % 2].writer.open(body) for i, body in enumerate(bodies)),
        return_exceptions=True)
    created = [a for a in answers if not isinstance(a, BaseException) and a.created]
    assert len(created) == 1, answers
    winner = created[0].definition.labels["run_id"]
    for body, answer in zip(bodies, answers, strict=True):
        if body["labels"]["run_id"] == winner:
            assert not isinstance(answer, BaseException), answer
        else:
            assert isinstance(answer, SessionConflict), answer
    assert await event_count(writers[0], sid) == 1
    assert (await writers[1].reader.summary(sid))["labels"] == {"run_id": winner}


# --- append -------------------------------------------------------------------------------


async def test_appends_get_dense_seqs_resolved_parents_and_rising_positions(store, sid):
    await opened(store, sid)
    a = await store.writer.append_turn(sid, turn([1, 2], [3]))
    b = await store.writer.append_turn(sid, turn([1, 2, 3, 4], [5]))
    assert a.created and b.created
    assert (a.body["seq"], a.body["parent"], a.body["depth"]) == (0, None, 0)
    assert (b.body["seq"], b.body["parent"], b.body["depth"]) == (1, 0, 1)
    assert b.body["position"] > a.body["position"]
    assert (b.body["num_tokens"], b.body["finish_reason"]) == (5, "stop")


async def test_a_repeated_event_id_returns_the_original_reply_and_stores_nothing(store, sid):
    await opened(store, sid)
    body = turn([1, 2], [3])
    first = await store.writer.append_turn(sid, body)
    await store.writer.append_turn(sid, turn([1, 2, 3, 4], [5]))
    repeat = await store.writer.append_turn(sid, body)
    assert not repeat.created and repeat.body == first.body and repeat.r3_bytes == 0
    assert await event_count(store, sid) == 3


async def test_a_repeat_seen_by_another_store_is_still_a_repeat(stores, sid):
    one, two = await stores(), await stores()
    await opened(one, sid)
    body = turn([1, 2], [3])
    first = await one.writer.append_turn(sid, body)
    repeat = await two.writer.append_turn(sid, body)
    assert not repeat.created and repeat.body == first.body


async def test_an_event_id_reused_with_other_content_conflicts_and_stores_nothing(store, sid):
    await opened(store, sid)
    await store.writer.append_turn(sid, turn([1, 2], [3], event_id="e1"))
    with pytest.raises(IdempotencyConflict):
        await store.writer.append_turn(sid, turn([1, 2], [4], event_id="e1"))
    assert await event_count(store, sid) == 2


@pytest.mark.parametrize("session_id", ["never-opened", "not a valid id!"])
async def test_an_unknown_session_is_refused_by_every_call(store, session_id):
    calls = [
        store.writer.append_turn(session_id, turn([1], [2])),
        store.writer.close_session(session_id, {}),
        store.reader.session(session_id),
        store.reader.state(session_id, None),
        store.reader.session_events(session_id, None, EVENTS_PAGE.default, True),
        store.samples.samples(session_id, arrays=True),
    ]
    for call in calls:
        with pytest.raises(UnknownSession):
            await call


async def test_an_unknown_parent_is_refused_and_stores_nothing(store, sid):
    await opened(store, sid)
    await store.writer.append_turn(sid, turn([1, 2], [3]))
    with pytest.raises(UnknownParent):
        await store.writer.append_turn(sid, turn([1, 2, 3, 4], [5], parent=7))
    assert await event_count(store, sid) == 2


# --- reads --------------------------------------------------------------------------------


async def test_events_read_back_exactly_as_appended_from_any_store(stores, sid):
    writer, reader = await stores(), await stores()
    await opened(writer, sid, pause_generation_mode="in_place", r3={"num_layers": L})
    bodies = [turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K, seed=1), start=0,
                   metadata={"tito_session_mismatch": []}),
              turn([1, 2, 3, 4, 5, 6], [7], r3=r3_b64(2, L, K, seed=2), start=4)]
    for body in bodies:
        await writer.writer.append_turn(sid, body)
    events = await reader.reader.session_events(sid, None, EVENTS_PAGE.default, True)
    assert [e["type"] for e in events] == ["session_opened", "turn_recorded", "turn_recorded"]
    for event, body in zip(events[1:], bodies, strict=True):
        assert event["event_id"] == body["event_id"]
        assert event["record"] == body["record"]  # R3 base64 byte-identical included
        assert event["metadata"] == body.get("metadata")
    without = await reader.reader.session_events(sid, None, EVENTS_PAGE.default, False)
    assert all("routed_experts" not in e["record"]["response"]["choices"][0]["meta_info"]
               for e in without[1:])
    after_first = await reader.reader.session_events(sid, events[1]["position"], 1, True)
    assert [e["seq"] for e in after_first] == [1]


async def test_the_tree_and_state_follow_the_most_recent_node(store, sid):
    await opened(store, sid, pause_generation_mode="in_place")
    await store.writer.append_turn(sid, turn([1, 2], [3]))
    await store.writer.append_turn(sid, turn([1, 2, 3, 4], [5]))
    await store.writer.append_turn(sid, turn([1, 2, 3, 9], [8], parent=0))
    session = await store.reader.session(sid)
    assert [(n["seq"], n["parent"], n["is_leaf"]) for n in session["tree"]] == [
        (0, None, False), (1, 0, True), (2, 0, True)]
    state = await store.reader.state(sid, None)
    assert (state["active_leaf"], state["checkpoint_token_ids"]) == (2, [1, 2, 3, 9, 8])
    assert state["next_routed_experts_start_len"] == 4 and state["num_nodes"] == 3
    assert (await store.reader.state(sid, 1))["checkpoint_token_ids"] == [1, 2, 3, 4, 5]
    with pytest.raises(UnknownParent):
        await store.reader.state(sid, 3)


# --- close and samples --------------------------------------------------------------------


async def test_samples_are_refused_while_open_and_served_after_close(store, sid):
    await opened(store, sid)
    await store.writer.append_turn(sid, turn([1, 2], [3]))
    with pytest.raises(SessionOpen):
        await store.samples.samples(sid, arrays=True)
    assert await store.writer.close_session(sid, {"metadata": {"reward": 1.0}}) is True
    body = await store.samples.samples(sid, arrays=True)
    (sample,) = body["samples"]
    assert (sample["tokens"], sample["loss_mask"], sample["reward"]) == ([1, 2, 3], [1], 1.0)
    assert body["empty_reason"] is None and body["errors"] == []


async def test_close_repeats_identically_and_refuses_another_body_and_more_turns(store, sid):
    await opened(store, sid)
    await store.writer.append_turn(sid, turn([1, 2], [3]))
    assert await store.writer.close_session(sid, {"max_seq_len": 10}) is True
    assert await store.writer.close_session(sid, {"max_seq_len": 10}) is False
    with pytest.raises(SessionClosed):
        await store.writer.close_session(sid, {"max_seq_len": 11})
    with pytest.raises(SessionClosed):
        await store.writer.append_turn(sid, turn([1, 2, 3, 4], [5]))
    assert await event_count(store, sid) == 3


async def test_a_reward_after_close_reaches_the_samples_of_every_store(stores, sid):
    """A reward recorded by one store is what another store, whose samples were
    already built and kept, serves next; repeats and conflicts as for turns."""
    first, second = await stores(), await stores()
    await opened(first, sid)
    await first.writer.append_turn(sid, turn([1, 2], [3]))
    reward = {"event_id": "rw-1", "reward": 0.5, "source": "rm"}
    with pytest.raises(SessionOpen):
        await first.writer.record_reward(sid, reward)
    await first.writer.close_session(sid, {"metadata": {"reward": 1.0}})
    (kept,) = (await second.samples.samples(sid, arrays=False))["samples"]
    assert (kept["reward"], kept["reward_source"]) == (1.0, None)
    written = await first.writer.record_reward(sid, reward)
    assert written.created and written.body["reward"] == {**reward, "sample": None,
                                                          "response_id": None}
    (sample,) = (await second.samples.samples(sid, arrays=False))["samples"]
    assert (sample["reward"], sample["reward_source"]) == (0.5, "rm")
    again = await second.writer.record_reward(sid, reward)
    assert not again.created and again.body == written.body
    with pytest.raises(IdempotencyConflict):
        await second.writer.record_reward(sid, {**reward, "reward": 0.25})
    with pytest.raises(UnknownSample):
        await second.writer.record_reward(sid, {"event_id": "rw-2", "reward": 1, "sample": 1})
    with pytest.raises(UnknownSession):
        await second.writer.record_reward(f"{sid}-x", {"event_id": "rw-3", "reward": 1})
    assert await event_count(first, sid) == 4


async def test_the_r3_tensor_streams_the_appended_rows(stores, sid):
    writer, reader = await stores(), await stores()
    await opened(writer, sid, pause_generation_mode="in_place", r3={"num_layers": L})
    first, second = r3_b64(4, L, K, seed=5), r3_b64(2, L, K, seed=6)
    await writer.writer.append_turn(sid, turn([1, 2, 3], [4, 5], r3=first, start=0))
    await writer.writer.append_turn(sid, turn([1, 2, 3, 4, 5, 6], [7], r3=second, start=4))
    await writer.writer.close_session(sid, {})
    plan = await reader.samples.r3_plan(sid, 0)
    patches = await reader.samples.read_patches(sid, plan)
    raw = b"".join([bytes(chunk) async for chunk in reader.samples.stream(plan, patches)])
    assert len(raw) == reader.samples.content_length(plan)
    tensor = np.load(io.BytesIO(raw), allow_pickle=False)
    expected = np.concatenate([
        np.frombuffer(base64.b64decode(b), "<i4").reshape(-1, L, K)
        for b in (first, second)])
    assert tensor.dtype == np.dtype("<i4") and np.array_equal(tensor, expected)
    with pytest.raises(UnknownSample):
        await reader.samples.r3_plan(sid, 1)


# --- feed and list ------------------------------------------------------------------------


async def test_the_feed_lists_every_write_in_commit_order(store, sid):
    cursor = await feed_tail(store)
    await opened(store, sid)
    replies = [await store.writer.append_turn(sid, turn([1, 2 + i], [3])) for i in range(2)]
    await store.writer.close_session(sid, {})
    page = await store.reader.feed(cursor, 1000, None)
    mine = [e for e in page["events"] if e["session_id"] == sid]
    assert [(e["type"], e["seq"]) for e in mine] == [
        ("session_opened", None), ("turn_recorded", 0), ("turn_recorded", 1),
        ("session_closed", None)]
    assert [e["position"] for e in mine if e["seq"] is not None] == [
        r.body["position"] for r in replies]
    assert [e["position"] for e in mine] == sorted(e["position"] for e in mine)
    empty = await store.reader.feed(page["next"], 1000, None)
    assert empty == {"events": [], "next": page["next"]}


async def test_the_session_list_pages_by_label_and_status(store):
    run = uuid.uuid4().hex
    for name in ("a", "b", "c"):
        await opened(store, f"{run}-{name}", labels={"run_id": run})
    await store.writer.close_session(f"{run}-b", {})
    labels = parse_label_filters({"run_id": run})
    first = await store.reader.list_sessions(None, None, 2, labels)
    rest = await store.reader.list_sessions(None, first["next"], 2, labels)
    assert [s["session_id"] for s in first["sessions"] + rest["sessions"]] == [
        f"{run}-a", f"{run}-b", f"{run}-c"]
    closed = await store.reader.list_sessions("closed", None, SESSIONS_PAGE.default, labels)
    assert [s["session_id"] for s in closed["sessions"]] == [f"{run}-b"]
