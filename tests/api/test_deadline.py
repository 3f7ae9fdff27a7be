"""`X-Turnlog-Timeout`: an open, a close or a reward is committed within its client's
timeout or not at all (docs/api.md §0.4), on every backend; other routes ignore it.

The oracle is the store afterwards: a write that waited on a lock another
connection held (SQLite's file lock, PostgreSQL's table lock) past its
deadline left nothing behind, even though the lock went and the write could
have gone on; without the header the same write waits and commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from app.store.engine.dialect import normalize_url
from tests.api.helpers import append, assert_problem, close, opened
from tests.factory import open_body, turn

HEADER = "X-Turnlog-Timeout"
# Lock held this long: past the 0.3 s deadline, well inside the store's lock waits.
HELD_S = 1.2


@contextlib.asynccontextmanager
async def writes_held(db_url: str) -> AsyncIterator[None]:
    """Another connection holds the lock every session write needs, as a backup or a
    long transaction elsewhere would; released on exit."""
    url = normalize_url(db_url)
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.split(":///", 1)[1], isolation_level=None, timeout=30)
        conn.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn, conn.begin():
            await conn.execute(text("LOCK TABLE sessions IN EXCLUSIVE MODE"))
            yield
    finally:
        await engine.dispose()


async def held_then_sent(db_url: str, send: Any) -> httpx.Response:
    """`send()` started while the lock is held; the lock released after HELD_S."""
    async with writes_held(db_url):
        pending = asyncio.ensure_future(send())
        await asyncio.sleep(HELD_S)
        assert not pending.done(), "the write did not wait for the lock"
    return await pending


async def status_of(client: httpx.AsyncClient, sid: str) -> str:
    r = await client.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    return str(r.json()["status"])


async def test_a_close_past_its_deadline_is_rolled_back_not_carried_out_late(client, db_url,
                                                                             sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3, 4]))
    r = await held_then_sent(db_url, lambda: client.post(
        f"/v1/sessions/{sid}/close", json={"metadata": {"reward": 1.0}},
        headers={HEADER: "0.3"}))
    body = assert_problem(r, 503, "deadline-exceeded")
    assert body["field"] == HEADER
    assert await status_of(client, sid) == "open"
    # The session takes turns still (the writes its client's close would have overtaken).
    await append(client, sid, turn([1, 2, 3, 4, 5], [6], parent=0))
    await close(client, sid)
    assert await status_of(client, sid) == "closed"


async def test_the_same_close_without_a_deadline_waits_for_the_lock_and_commits(client,
                                                                                db_url, sid):
    await opened(client, sid)
    r = await held_then_sent(db_url, lambda: client.post(f"/v1/sessions/{sid}/close",
                                                         json={}))
    assert r.status_code == 200, r.text
    assert await status_of(client, sid) == "closed"


async def test_a_reward_past_its_deadline_is_not_recorded(client, db_url, sid):
    await opened(client, sid)
    await append(client, sid, turn([1, 2], [3, 4]))
    await close(client, sid)
    r = await held_then_sent(db_url, lambda: client.post(
        f"/v1/sessions/{sid}/rewards", json={"event_id": "rw-1", "reward": 0.5},
        headers={HEADER: "0.3"}))
    assert_problem(r, 503, "deadline-exceeded")
    events = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert [e["type"] for e in events if e["type"] == "reward_recorded"] == []


async def test_an_open_past_its_deadline_leaves_no_session(client, db_url, sid):
    r = await held_then_sent(db_url, lambda: client.post(
        "/v1/sessions", json=open_body(sid), headers={HEADER: "0.3"}))
    assert_problem(r, 503, "deadline-exceeded")
    assert (await client.get(f"/v1/sessions/{sid}")).status_code == 404
    await opened(client, sid)  # and the id is free


async def test_a_write_within_its_deadline_commits(client, sid):
    r = await client.post("/v1/sessions", json=open_body(sid), headers={HEADER: "30"})
    assert r.status_code == 201, r.text
    r = await client.post(f"/v1/sessions/{sid}/close", json={}, headers={HEADER: "30"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "1e3", "", "soon", "86401",
                                   "5 s", "1, 2", "\x1c1"])
async def test_a_malformed_timeout_is_a_400_naming_the_header_and_stores_nothing(
        client, sid, value):
    r = await client.post("/v1/sessions", json=open_body(sid), headers={HEADER: value})
    body = assert_problem(r, 400, "invalid-request")
    assert body["field"] == HEADER
    assert "seconds" in body["expected"]
    assert (await client.get(f"/v1/sessions/{sid}")).status_code == 404


async def test_a_turns_append_ignores_the_header(client, db_url, sid):
    """Appends keep no deadline (docs/api.md §0.4): a turn that waited out a lock is
    stored when the lock goes, and its repeat is answered as one, header or not."""
    await opened(client, sid)
    body = turn([1, 2], [3, 4])
    r = await held_then_sent(db_url, lambda: client.post(
        f"/v1/sessions/{sid}/turns", json=body, headers={HEADER: "0.3"}))
    assert r.status_code == 201, r.text
    again = await client.post(f"/v1/sessions/{sid}/turns", json=body,
                              headers={HEADER: "0.000001"})
    assert again.status_code == 200 and again.json() == r.json(), again.text
    r = await client.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2, 3, 4, 5], [6], parent=0),
                          headers={HEADER: "not a number"})
    assert r.status_code == 201, r.text
    events = (await client.get(f"/v1/sessions/{sid}/events")).json()
    assert len([e for e in events if e["type"] == "turn_recorded"]) == 2


async def test_the_header_given_twice_is_a_400_whichever_value_comes_first(client, sid):
    for values in (("1", "abc"), ("abc", "1"), ("1", "1")):
        r = await client.post("/v1/sessions", json=open_body(sid),
                              headers=[(HEADER, v) for v in values])
        assert assert_problem(r, 400, "invalid-request")["field"] == HEADER
    assert (await client.get(f"/v1/sessions/{sid}")).status_code == 404


# A deadline no write can meet: every write under it is past it before its commit.
MISSED = "0.000001"


async def test_a_repeat_of_a_committed_write_is_answered_as_a_repeat_past_its_deadline(
        client, sid):
    """A client resending a close whose reply it lost (say) is answered 200 as always:
    the repeat writes nothing, so no deadline applies to it; a first write is refused."""
    assert_problem(await client.post("/v1/sessions", json=open_body(sid),
                                     headers={HEADER: MISSED}), 503, "deadline-exceeded")
    await opened(client, sid)
    r = await client.post("/v1/sessions", json=open_body(sid), headers={HEADER: MISSED})
    assert r.status_code == 200, r.text
    await append(client, sid, turn([1, 2], [3, 4]))
    first = await client.post(f"/v1/sessions/{sid}/close", json={})
    assert first.status_code == 200, first.text
    again = await client.post(f"/v1/sessions/{sid}/close", json={}, headers={HEADER: MISSED})
    assert again.status_code == 200 and again.json() == first.json(), again.text
    reward = {"event_id": "rw", "reward": 1.0}
    assert_problem(await client.post(f"/v1/sessions/{sid}/rewards", json=reward,
                                      headers={HEADER: MISSED}), 503, "deadline-exceeded")
    first = await client.post(f"/v1/sessions/{sid}/rewards", json=reward)
    assert first.status_code == 201, first.text
    again = await client.post(f"/v1/sessions/{sid}/rewards", json=reward,
                              headers={HEADER: MISSED})
    assert again.status_code == 200 and again.json() == first.json(), again.text


async def test_routes_other_than_the_sessions_ignore_the_header(client):
    """Only session writes keep a deadline: a long-poll claim that waits longer than the
    header's value is not refused for it, and no other route reads the header."""
    r = await client.get("/healthz", headers={HEADER: "not a number"})
    assert r.status_code == 200, r.text
    group = f"g-{uuid.uuid4().hex[:8]}"
    # Its labels match no other test's sessions: a group matching every session would
    # hold them back from other tests' retention runs on the same database.
    r = await client.put(f"/v1/consumers/{group}",
                         json={"labels": {"run_id": group}, "from": "now"},
                         headers={HEADER: "0.1"})
    assert r.status_code in (200, 201), r.text
    r = await client.post(f"/v1/consumers/{group}/claims",
                          json={"claim_id": "c1", "wait": 0.5}, headers={HEADER: "0.1"})
    assert r.status_code in (200, 201) and r.json()["sessions"] == [], r.text
