"""`turnlog demo`, `rebuild` and `replay` end to end, on both backends."""

import pytest
from typer.testing import CliRunner

from app.cli import cli


@pytest.fixture(params=["sqlite", "postgres"])
def demo_url(request, fresh_database):
    url = fresh_database(request.param)
    result = CliRunner().invoke(cli, ["demo", "--sessions", "2", "--database-url", url])
    assert result.exit_code == 0, result.output
    assert "=fwd" in result.output and "DIFF" not in result.output
    return url


def test_rebuild_shows_equal_checksums(demo_url):
    result = CliRunner().invoke(cli, ["rebuild", "--database-url", demo_url])
    assert result.exit_code == 0, result.output
    assert result.output.count("equal") == 4
    assert "DIFFERENT" not in result.output


def test_replay_prints_tree_state_and_samples(demo_url):
    import asyncio

    from app.settings import Settings
    from app.store.engine.db import Database
    from app.store.ops.rebuild import all_session_ids

    async def first():
        db = Database(demo_url, Settings.load(database_url=demo_url))
        try:
            return (await all_session_ids(db))[0]
        finally:
            await db.dispose()

    sid = asyncio.run(first())
    result = CliRunner().invoke(cli, ["replay", sid, "--database-url", demo_url])
    assert result.exit_code == 0, result.output
    assert "tree" in result.output and "samples" in result.output
    assert "active_leaf" in result.output


def test_rebuild_of_unknown_session_fails(demo_url):
    result = CliRunner().invoke(cli, ["rebuild", "--session", "nope", "--database-url",
                                      demo_url])
    assert result.exit_code == 2
    assert "no session 'nope'" in result.output


def test_the_demo_records_now_spread_over_hours(demo_url):
    import json
    from datetime import UTC, datetime, timedelta

    result = CliRunner().invoke(cli, ["analytics", "spec", "--group-by", "hour", "--json",
                                      "--database-url", demo_url])
    assert result.exit_code == 0, result.output
    hours = [datetime.fromisoformat(g["key"].replace("Z", "+00:00"))
             for g in json.loads(result.stdout)["groups"]]
    now = datetime.now(UTC)
    # Two sessions over the last four hours: two hourly points, none in the future.
    assert len(hours) >= 2, hours
    assert all(now - timedelta(hours=5) <= h <= now for h in hours), hours
