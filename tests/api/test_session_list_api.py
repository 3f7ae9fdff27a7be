"""`GET /v1/sessions`: summaries, the status filter, cursors kept on empty pages and
never skipping a late open (docs/api.md "Session list").
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from tests.api.helpers import close, list_tail, opened


async def test_the_session_list_keeps_its_cursor_on_an_empty_page(client, sid):
    await opened(client, sid, labels={"run_id": sid})
    seen, cursor = await list_tail(client, run_id=sid)
    assert seen == [sid]
    page = (await client.get("/v1/sessions", params={"after": cursor, "run_id": sid})).json()
    assert page == {"sessions": [], "next": cursor}


async def test_the_session_list_entries_are_summaries(client, sid):
    summary = await opened(client, sid, labels={"run_id": sid})
    page = (await client.get("/v1/sessions", params={"run_id": sid})).json()
    assert page["sessions"] == [summary] and isinstance(page["next"], str)


async def test_the_status_filter_of_the_session_list(client, sid):
    await opened(client, f"{sid}-a", labels={"run_id": sid})
    await opened(client, f"{sid}-b", labels={"run_id": sid})
    await close(client, f"{sid}-b")
    closed = (await client.get("/v1/sessions", params={"run_id": sid, "status": "closed"}))
    still = (await client.get("/v1/sessions", params={"run_id": sid, "status": "open"}))
    assert [s["session_id"] for s in closed.json()["sessions"]] == [f"{sid}-b"]
    assert [s["session_id"] for s in still.json()["sessions"]] == [f"{sid}-a"]


@pytest.mark.postgres_only  # SQLite has one writer: id order is commit order
async def test_the_session_list_never_skips_an_open_that_commits_late(client, sid, db_url):
    """docs/api.md "Session list": it pages like the feed, which never skips."""
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as slow:
            await slow.begin()
            await slow.execute(sa.text(
                "INSERT INTO sessions (session_id, version, pause_generation_mode, spec, "
                "max_trim_tokens, labels, open_fingerprint, created_us, status, num_nodes, "
                "spec_correct, spec_proposed, spec_verify, spec_completion) VALUES "
                "(:s, 'v2', 'retract', false, 0, '{}', 'x', 0, 'open', 0, 0, 0, 0, 0)"),
                {"s": f"{sid}-slow"})
            await opened(client, f"{sid}-fast")
            _, cursor = await list_tail(client)
            await slow.commit()
    finally:
        await engine.dispose()
    later = (await client.get("/v1/sessions", params={"after": cursor})).json()
    assert f"{sid}-slow" in [s["session_id"] for s in later["sessions"]]
