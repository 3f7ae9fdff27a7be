"""Discoverable: --version, help that names the real defaults, serve first, and
`sessions`, `show`, `replay`, `tail` that read like text (or --json), with id prefixes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from app.cli import cli
from tests.cli.support import (
    one_error_line,
    open_body,
    run,
    two_turns,
)


def test_version():
    from app import __version__

    result = run("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"turnlog {__version__}"


def _commands(group: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def test_serve_comes_first_and_every_database_url_names_env_and_default():
    group = get_command(cli)
    assert next(iter(group.list_commands(None))) == "serve"
    checked = 0
    for name, command in _commands(group):
        for param in command.params:
            if "--database-url" in getattr(param, "opts", ()):
                assert "TURNLOG_DATABASE_URL" in param.help, name
                assert "sqlite:///./turnlog.db" in param.help, name
                checked += 1
    assert checked >= 13


@pytest.mark.parametrize("command", [["serve"], ["import"], ["gate", "check"], ["tail"]])
def test_boolean_flags_have_no_bool_metavar(command):
    result = CliRunner().invoke(cli, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "<bool>" not in result.stdout


async def test_sessions_show_and_replay_read_like_text(client, db_url):
    import asyncio

    run_id = f"look-{uuid.uuid4().hex[:8]}"
    sid = f"look-{uuid.uuid4().hex}"
    await two_turns(client, sid, run_id, close=True)
    await two_turns(client, f"other-{uuid.uuid4().hex}", run_id)

    result = await asyncio.to_thread(run, "sessions", "--label", f"run_id={run_id}",
                                     "--status", "closed", "--database-url", db_url)
    assert result.exit_code == 0, result.output
    assert sid in result.stdout and "other-" not in result.stdout
    listed = await asyncio.to_thread(run, "sessions", "--label", f"run_id={run_id}", "--json",
                                     "--database-url", db_url)
    assert len(json.loads(listed.stdout)["sessions"]) == 2

    prefix = sid[:14]  # a unique prefix is enough where a person types an id
    result = await asyncio.to_thread(run, "show", prefix, "--database-url", db_url)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"{sid} (closed)"
    assert "  opened by: -" in lines  # opened through the API, naming no opener
    assert any(line.strip().startswith("#0  tokens") for line in lines)
    assert any(line.startswith("    #1  tokens") for line in lines)  # child indented
    shown = json.loads((await asyncio.to_thread(run, "show", prefix, "--json",
                                                "--database-url", db_url)).stdout)
    assert shown["session_id"] == sid and len(shown["tree"]) == 2

    result = await asyncio.to_thread(run, "replay", prefix, "--database-url", db_url)
    assert result.exit_code == 0, result.output
    assert "{'" not in result.stdout and "checkpoint_token_ids: " in result.stdout
    assert "samples" in result.stdout


async def test_show_names_the_gateway_that_opened_a_session(client, db_url):
    import asyncio

    sid = f"gw-{uuid.uuid4().hex}"
    body = {**open_body(sid, f"gw-{uuid.uuid4().hex[:8]}"), "opened_by": "gateway"}
    assert (await client.post("/v1/sessions", json=body)).status_code == 201
    result = await asyncio.to_thread(run, "show", sid, "--database-url", db_url)
    assert result.exit_code == 0, result.output
    assert "  opened by: gateway" in result.stdout.splitlines()


@pytest.mark.parametrize("page", [1, 2, 1000])
async def test_sessions_newest_lists_the_last_ones_in_order(client, db_url, monkeypatch, page):
    import asyncio

    from app.store.read import reader

    monkeypatch.setattr(reader, "NEWEST_PAGE", page)  # read a page at a time, newest first

    run_id = f"new-{uuid.uuid4().hex[:8]}"
    sids = [f"new-{i}-{uuid.uuid4().hex}" for i in range(4)]
    for sid in sids:
        await two_turns(client, sid, run_id, close=sid != sids[2])

    def listed(*options: str) -> tuple[list[str], bool, str]:
        result = run("sessions", "--label", f"run_id={run_id}", *options,
                     "--database-url", db_url)
        assert result.exit_code == 0, result.output
        as_json = run("sessions", "--label", f"run_id={run_id}", *options, "--json",
                      "--database-url", db_url)
        body = json.loads(as_json.stdout)
        return [s["session_id"] for s in body["sessions"]], body["more"], result.stderr

    oldest, more, said = await asyncio.to_thread(listed, "--limit", "2")
    assert oldest == sids[:2] and more and "--newest" in said
    newest, more, said = await asyncio.to_thread(listed, "--limit", "2", "--newest")
    assert newest == sids[2:] and more and "older ones" in said
    every, more, _ = await asyncio.to_thread(listed, "--limit", "9", "--newest")
    assert every == sids and not more
    closed, more, _ = await asyncio.to_thread(listed, "--limit", "2", "--newest", "--status",
                                              "closed")
    assert closed == [sids[1], sids[3]] and more


async def test_an_ambiguous_prefix_is_refused_naming_the_candidates(client, db_url):
    import asyncio

    stem = f"amb-{uuid.uuid4().hex[:8]}"
    for tail in ("a", "b"):
        await two_turns(client, f"{stem}-{tail}", "amb")
    result = await asyncio.to_thread(run, "show", stem, "--database-url", db_url)
    line = one_error_line(result)
    assert "ambiguous" in line and f"{stem}-a" in line and f"{stem}-b" in line


async def test_tail_follows_the_feed(client, db_url):
    import asyncio

    sid = f"tail-{uuid.uuid4().hex}"
    await two_turns(client, sid, "tail")
    result = await asyncio.to_thread(run, "tail", "--from-start", "--until-idle", "--wait",
                                     "0", "--json", "--database-url", db_url)
    assert result.exit_code == 0, result.output
    mine = [json.loads(line) for line in result.stdout.splitlines()
            if json.loads(line)["session_id"] == sid]
    assert [(e["type"], e["seq"]) for e in mine] == [
        ("session_opened", None), ("turn_recorded", 0), ("turn_recorded", 1)]
    # Without --from-start, tail starts at the end: nothing old is printed.
    result = await asyncio.to_thread(run, "tail", "--until-idle", "--wait", "0",
                                     "--database-url", db_url)
    assert result.exit_code == 0 and result.stdout == ""
    # ... and says so on stderr, with the way to see the older ones.
    assert result.stderr.splitlines()[0] == (
        "waiting for new events (older ones: turnlog tail --from-start)")
    cursor = result.stderr.split("--after ")[1].split()[0]
    # From the cursor on, only what came after it.
    await client.post(f"/v1/sessions/{sid}/close", json={"metadata": {}})
    result = await asyncio.to_thread(run, "tail", "--after", cursor, "--until-idle", "--wait",
                                     "0", "--database-url", db_url)
    assert result.exit_code == 0, result.output
    assert result.stdout.split()[1:3] == [sid, "session_closed"]
