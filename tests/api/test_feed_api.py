"""`GET /v1/events` over HTTP: the default page and the start of the feed (docs/api.md
"Feed"). Commit order, cursors, long-poll and the fence: tests/store/test_feed.py.
"""

from __future__ import annotations

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
