"""`GET /v1/events` over HTTP: the default page and the start of the feed (docs/api.md
"Feed"). Commit order, cursors, long-poll and the fence: tests/store/test_feed.py.
"""

from __future__ import annotations

import pytest

from tests.api.helpers import feed_tail, opened


async def test_the_feed_default_limit_is_100(client, sid):
    cursor = await feed_tail(client)
    for i in range(101):
        await opened(client, f"{sid}-{i}")
    page = (await client.get("/v1/events", params={"after": cursor})).json()
    assert len(page["events"]) == 100
    assert set(page["events"][0]) == {"position", "session_id", "seq", "type", "recorded_at"}


async def test_the_feed_from_the_beginning_starts_at_the_first_event(client, sid):
    await opened(client, sid)
    first = (await client.get("/v1/events", params={"limit": 1})).json()
    again = (await client.get("/v1/events", params={"limit": 1, "after": ""})).json()
    assert first["events"] == again["events"] and len(first["events"]) == 1


@pytest.mark.parametrize("path", ["/v1/events", "/ui/feed"])
@pytest.mark.parametrize("wait", ["nan", "NaN", "-1", "-inf", "-0.5"])
async def test_a_bad_wait_is_the_same_422_on_every_feed_route(client, path, wait):
    # One parser of `wait` (issue 21): /ui/feed?wait=nan used to answer 500.
    r = await client.get(path, params={"wait": wait})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "wait"


@pytest.mark.parametrize("path", ["/v1/events", "/ui/feed"])
@pytest.mark.parametrize("wait", ["inf", "1e400", "0"])
async def test_a_huge_wait_is_clamped_on_every_feed_route(client, path, wait, sid):
    # "at most": an infinite wait is the route's maximum, and the feed answers at once
    # when an event is already there.
    await opened(client, sid)
    r = await client.get(path, params={"wait": wait})
    assert r.status_code == 200, r.text
    assert r.json()["events"]


async def test_a_well_formed_cursor_naming_no_event_is_422(client, sid):
    # A helper's finding: `v1:0:99999999` (well formed, made up) answered an empty page
    # and itself as `next`, so a reader that saved it waited for ever.
    from app.store.read import cursor

    await opened(client, sid)
    real = await feed_tail(client)  # the end of the feed (more than a page on a busy store)
    xid, position = cursor.decode(real, 2)
    for made_up in (cursor.encode(xid, position + 10**9),  # ahead of the log
                    cursor.encode(xid + 10**6, position)):  # a transaction it never had
        for path in ("/v1/events", "/ui/feed"):
            r = await client.get(path, params={"after": made_up})
            assert r.status_code == 422, (path, made_up, r.text)
            assert r.json()["field"] == "after"
    # What the server gave is taken, here and on the page's long-poll route.
    for path in ("/v1/events", "/ui/feed"):
        r = await client.get(path, params={"after": real})
        assert r.status_code == 200 and r.json()["next"] == real, r.text
    assert (await client.get("/v1/events", params={"after": ""})).status_code == 200
