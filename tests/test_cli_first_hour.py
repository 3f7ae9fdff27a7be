"""The command line a newcomer and a CI job meet first (issue: "the first hour").

Every command: one error path (one line, exit 2, no traceback unless --debug),
passwords masked, no database created by a command that only reads, results
on stdout and everything else on stderr, `--json` where results are printed,
plain wide rows without a terminal. Runs the real `turnlog` app through
typer's CliRunner (stdout and stderr kept apart), on both backends where a
database is involved.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url
from typer.main import get_command
from typer.testing import CliRunner

from app.cli import cli
from app.main import create_app
from app.settings import Settings, get_settings

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
UNREACHABLE = "postgresql://turnlog:hunter2-secret@127.0.0.1:1/turnlog"
TOKEN = "w-0123456789abcdef-token"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("TURNLOG_DATABASE_URL", "TURNLOG_API_TOKENS", "TURNLOG_TOKEN",
                 "TURNLOG_LOG_FORMAT", "TURNLOG_LOG_LEVEL", "TURNLOG_DEBUG",
                 "TURNLOG_METRIC_KEYS", "TURNLOG_PORT"):
        # set first, so the teardown also removes what a command (serve) exported
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), prog_name="turnlog")


def one_error_line(result: Any, in_process_server: bool = False) -> str:
    """The failure was reported as exactly one line on stderr, nothing on stdout."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    if in_process_server:  # the test's own server logs to the same stderr
        lines = [line for line in lines if not line.startswith("{")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    assert result.stdout == ""
    return lines[0]


def sqlite_file(tmp_path: Path, name: str = "t.db") -> str:
    return f"sqlite:///{tmp_path / name}"


def open_body(sid: str, run_id: str) -> dict[str, Any]:
    body = json.loads((DATA / "open_session.json").read_text())
    return {**body, "session_id": sid, "labels": {**body["labels"], "run_id": run_id}}


async def two_turns(client: Any, sid: str, run_id: str, close: bool = False) -> None:
    assert (await client.post("/v1/sessions", json=open_body(sid, run_id))).status_code == 201
    for name in ("turn_0.json", "turn_1.json"):
        r = await client.post(f"/v1/sessions/{sid}/turns",
                              json=json.loads((DATA / name).read_text()))
        assert r.status_code == 201, r.text
    if close:
        r = await client.post(f"/v1/sessions/{sid}/close", json={"metadata": {"reward": 1.0}})
        assert r.status_code == 200, r.text


# -- one error path ------------------------------------------------------------------------

EVERY_DB_COMMAND = [
    ["serve"], ["migrate"], ["migrate", "current"], ["rebuild"], ["replay", "abc"],
    ["export", "--run-id", "r", "--out", "{tmp}/o.npz"], ["import", str(DATA / "turn_0.json")],
    ["sessions"], ["show", "abc"], ["tail", "--until-idle"],
    ["analytics", "spec", "--group-by", "model"],
    ["gate", "check", "--run-id", "r", "--test-path", "t", "--backend", "b", "--suite", "s"],
    ["history", "submit", str(DATA / "turn_0.json")], ["demo", "--sessions", "1"],
]


@pytest.mark.parametrize("command", EVERY_DB_COMMAND, ids=lambda c: " ".join(c[:2]))
def test_an_unreachable_database_is_one_masked_line_and_exit_2(command, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    line = one_error_line(run(*args, "--database-url", UNREACHABLE))
    assert "cannot connect to postgresql+asyncpg://turnlog:***@127.0.0.1:1/turnlog" in line
    assert "hunter2" not in line


def test_debug_shows_the_traceback():
    result = run("--debug", "replay", "abc", "--database-url", UNREACHABLE)
    assert result.exit_code != 0
    assert isinstance(result.exception, OSError)  # re-raised for the traceback


@pytest.mark.parametrize("command", [["replay", "abc"], ["show", "abc"], ["sessions"],
                                     ["rebuild"], ["tail", "--until-idle"],
                                     ["export", "--run-id", "r", "--out", "o.npz"],
                                     ["analytics", "spec", "--group-by", "model"],
                                     ["migrate", "current"]],
                         ids=lambda c: c[0])
def test_reading_from_another_folder_creates_no_database(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(run(*command))
    assert f"no database at {tmp_path / 'turnlog.db'}" in line
    assert "turnlog migrate" in line
    assert list(tmp_path.iterdir()) == []


def test_an_unmigrated_sqlite_file_says_run_migrate(tmp_path):
    sqlite3.connect(tmp_path / "empty.db").close()
    line = one_error_line(run("sessions", "--database-url", sqlite_file(tmp_path, "empty.db")))
    assert line.startswith("error: not migrated: run `turnlog migrate`")


def test_an_unmigrated_postgres_database_says_run_migrate(fresh_database):
    url = fresh_database("postgres")
    line = one_error_line(run("replay", "abc", "--database-url", url))
    assert line.startswith("error: not migrated: run `turnlog migrate`")


def test_postgres_scheme_is_accepted_and_the_password_is_masked(fresh_database, monkeypatch):
    """`postgres://` (Heroku style) works; `serve` prints where it migrated, masked."""
    import uvicorn

    url = make_url(fresh_database("postgres"))
    password = url.password or "not-needed-with-trust-auth"
    plain = url.set(drivername="postgres", password=password).render_as_string(
        hide_password=False)
    assert plain.startswith("postgres://")
    calls: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: calls.append(kw))
    result = run("serve", "--port", str(free_port()), "--database-url", plain)
    assert result.exit_code == 0, result.output
    assert "schema at head on postgresql+asyncpg://" in result.stderr
    assert ":***@" in result.stderr
    assert password not in result.output
    assert calls and calls[0]["log_config"] is None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_port_in_use_is_found_before_anything_is_created(tmp_path, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: pytest.fail("uvicorn started"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_error_line(run("serve", "--port", str(port), "--database-url",
                                  sqlite_file(tmp_path, "new.db")))
    assert f"port {port} on 127.0.0.1 is already in use" in line
    assert not (tmp_path / "new.db").exists()


def test_make_clean_never_deletes_the_event_log():
    commands = subprocess.run(["make", "-n", "clean"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout
    assert ".venv" in commands
    assert "turnlog.db" not in commands


def test_a_mistyped_run_id_is_no_such_run(db_url, tmp_path):
    line = one_error_line(run("gate", "check", "--run-id", "ci-typo", "--test-path",
                              f"t/{uuid.uuid4().hex}.py", "--backend", "cuda", "--suite", "s",
                              "--database-url", db_url))
    assert "no such run 'ci-typo'" in line


# -- import and export --------------------------------------------------------------------


async def test_import_close_leaves_a_session_with_a_rejected_record_open(client, db_url,
                                                                         tmp_path):
    import asyncio

    from tests.test_import_export import linear_dump, write_json

    dump = linear_dump("retract", turns=4, seed=11)
    dump["records"][2]["response"]["choices"][0]["meta_info"]["completion_tokens"] += 1
    path = write_json(tmp_path / "bad.json", dump)
    sid = dump["session_id"]

    result = await asyncio.to_thread(run, "import", str(path), "--close", "--json",
                                     "--database-url", db_url)
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["closed"] == 0 and report["left_open"] == [sid]
    assert f"left {sid} open" in result.stderr
    assert (await client.get(f"/v1/sessions/{sid}")).json()["status"] == "open"

    result = await asyncio.to_thread(run, "import", str(path), "--close", "--close-incomplete",
                                     "--json", "--database-url", db_url)
    assert json.loads(result.stdout)["closed"] == 1
    assert (await client.get(f"/v1/sessions/{sid}")).json()["status"] == "closed"


async def test_export_warns_about_open_sessions_and_fails_on_nothing_matched(client, db_url,
                                                                             tmp_path):
    import asyncio

    run_id = f"run-{uuid.uuid4().hex[:8]}"
    await two_turns(client, f"s-{uuid.uuid4().hex}", run_id)  # open: skipped
    out = tmp_path / "out.npz"
    result = await asyncio.to_thread(run, "export", "--run-id", run_id, "--out", str(out),
                                     "--database-url", db_url)
    assert result.exit_code == 2, result.output
    assert "skipping 1 open session(s)" in result.stderr
    assert "nothing matched" in result.stderr
    assert not out.exists()

    await two_turns(client, f"s-{uuid.uuid4().hex}", run_id, close=True)
    result = await asyncio.to_thread(run, "export", "--run-id", run_id, "--out", str(out),
                                     "--database-url", db_url)
    assert result.exit_code == 0, result.output
    assert "skipping 1 open session(s)" in result.stderr
    assert "1 session(s)" in result.stdout and out.exists()


# -- CI-friendly output ------------------------------------------------------------------


def test_without_a_terminal_a_gate_row_stays_on_one_line(db_url, tmp_path):
    coord = {"test_path": f"tests/e2e/test_{uuid.uuid4().hex}.py", "backend": "cuda",
             "suite": "stage-c"}
    body = {"coordinate": coord, "run_id": "ci-1", "attempt": 0, "trusted": True,
            "points": [{"metric": "train/ppo_kl", "step": 0, "value": 0.01}]}
    path = tmp_path / "h.json"
    path.write_text(json.dumps(body))
    assert run("history", "submit", str(path), "--database-url", db_url).exit_code == 0
    args = ["gate", "check", "--run-id", "ci-1", "--test-path", coord["test_path"],
            "--backend", "cuda", "--suite", "stage-c", "--metric", "train/ppo_kl",
            "--dry-run", "--database-url", db_url]
    report = json.loads(run(*args, "--json").stdout)
    detail = report["results"][0]["detail"]
    text = run(*args).stdout
    header = next(line for line in text.splitlines() if "metric" in line)
    assert header.split() == ["metric", "steps", "step", "status", "value", "baseline", "n",
                              "lo", "hi", "detail"]
    row = next(line for line in text.splitlines() if "train/ppo_kl" in line)
    assert "INACTIVE" in row and detail in row
    assert not set("│┃━─") & set(text)  # plain columns, no box drawing in a CI log


def test_history_submit_says_which_metrics_the_whitelist_dropped(db_url, tmp_path):
    body = {"coordinate": {"test_path": f"t/{uuid.uuid4().hex}", "backend": "b", "suite": "s"},
            "run_id": "r1", "attempt": 0, "trusted": True,
            "points": [{"metric": "train/ppo_kl", "step": 0, "value": 0.1},
                       {"metric": "train/my_new_metric", "step": 0, "value": 1.0}]}
    path = tmp_path / "h.json"
    path.write_text(json.dumps(body))
    result = run("history", "submit", str(path), "--json", "--database-url", db_url)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["dropped"] == ["train/my_new_metric"]
    assert "warning: dropped 1 metric(s) not in the whitelist: train/my_new_metric" in (
        result.stderr)


def test_demo_results_on_stdout_logs_on_stderr(tmp_path):
    url = sqlite_file(tmp_path, "demo.db")
    result = run("--log-level", "info", "--log-format", "json", "demo", "--sessions", "2",
                 "--database-url", url)
    assert result.exit_code == 0, result.output
    assert '"event": "turn appended"' in result.stderr
    assert "turn appended" not in result.stdout
    assert "=fwd" in result.stdout
    result = run("demo", "--sessions", "2", "--json", "--database-url", url)
    assert result.exit_code == 0, result.output
    sessions = json.loads(result.stdout)["sessions"]
    assert len(sessions) == 2 and all(s["samples"] for s in sessions)
    assert all(s["r3"].startswith("=fwd") for x in sessions for s in x["samples"]
               if s["r3"] != "-")


async def test_replay_and_rebuild_print_json(client, db_url):
    import asyncio

    sid = f"s-{uuid.uuid4().hex}"
    await two_turns(client, sid, "json-run", close=True)
    result = await asyncio.to_thread(run, "replay", sid, "--json", "--database-url", db_url)
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["session_id"] == sid and body["status"] == "closed"
    assert [n["seq"] for n in body["tree"]] == [0, 1]
    assert body["samples"]["samples"][0]["index"] == 0
    assert isinstance(body["state"]["checkpoint_token_ids"], list)

    result = await asyncio.to_thread(run, "rebuild", "--session", sid, "--json",
                                     "--database-url", db_url)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["equal"] is True and report["sessions"] == 1


# -- --token through the client --------------------------------------------------------


@pytest.fixture
def secured_server(db_url: str) -> Iterator[str]:
    import uvicorn

    app = create_app(Settings(database_url=db_url, migrate_on_start=False,
                              api_tokens=f"{TOKEN}:write"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                           log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(30)


def test_gate_check_and_history_submit_send_a_token(secured_server, tmp_path, monkeypatch):
    coord = {"test_path": f"t/{uuid.uuid4().hex}.py", "backend": "b", "suite": "s"}
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"coordinate": coord, "run_id": "r1", "attempt": 0,
                                "trusted": True,
                                "points": [{"metric": "train/ppo_kl", "step": 0,
                                            "value": 0.1}]}))
    line = one_error_line(run("history", "submit", str(path), "--url", secured_server),
                          in_process_server=True)
    assert "401" in line and "--token" in line
    result = run("history", "submit", str(path), "--url", secured_server, "--token", TOKEN)
    assert result.exit_code == 0, result.output
    monkeypatch.setenv("TURNLOG_TOKEN", TOKEN)
    gate = ["gate", "check", "--test-path", coord["test_path"], "--backend", "b", "--suite",
            "s", "--metric", "train/ppo_kl", "--url", secured_server]
    result = run(*gate, "--run-id", "r1", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["outcome"] == "trusted"
    assert "no such run 'r2'" in one_error_line(run(*gate, "--run-id", "r2"),
                                                in_process_server=True)


# -- discoverable --------------------------------------------------------------------------


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
    assert any(line.strip().startswith("#0  tokens") for line in lines)
    assert any(line.startswith("    #1  tokens") for line in lines)  # child indented
    shown = json.loads((await asyncio.to_thread(run, "show", prefix, "--json",
                                                "--database-url", db_url)).stdout)
    assert shown["session_id"] == sid and len(shown["tree"]) == 2

    result = await asyncio.to_thread(run, "replay", prefix, "--database-url", db_url)
    assert result.exit_code == 0, result.output
    assert "{'" not in result.stdout and "checkpoint_token_ids: " in result.stdout
    assert "samples" in result.stdout


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
    cursor = result.stderr.split("--after ")[1].split()[0]
    # From the cursor on, only what came after it.
    await client.post(f"/v1/sessions/{sid}/close", json={"metadata": {}})
    result = await asyncio.to_thread(run, "tail", "--after", cursor, "--until-idle", "--wait",
                                     "0", "--database-url", db_url)
    assert result.exit_code == 0, result.output
    assert result.stdout.split()[1:3] == [sid, "session_closed"]


def test_log_format_auto_is_json_without_a_terminal_and_readable_with_console(capsys):
    import logging

    import structlog

    from app.logs import configure_logging

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("info", "auto")  # pytest's stderr is no terminal
        structlog.get_logger("t").info("hello", n=1)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert json.loads(line)["event"] == "hello"
        configure_logging("warning", "console")
        structlog.get_logger("t").info("quiet")
        structlog.get_logger("t").warning("loud", n=2)
        err = capsys.readouterr().err
        assert "quiet" not in err
        assert "loud" in err and "n=2" in err and not err.lstrip().startswith("{")
    finally:
        root.handlers, root.level = saved
        structlog.reset_defaults()


def test_a_bad_log_format_is_one_line():
    line = one_error_line(run("--log-format", "xml", "sessions"))
    assert "log format must be one of auto, json, console" in line
    line = one_error_line(run("--log-format", "xml", "serve"))  # via the environment
    assert "TURNLOG_LOG_FORMAT" in line and "'auto', 'json' or 'console'" in line


def test_the_readme_client_script_runs_without_a_terminal(secured_server):
    import os
    import sys

    result = subprocess.run([sys.executable, str(ROOT / "examples" / "client.py"),
                             secured_server], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TURNLOG_TOKEN": TOKEN}, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out[0].startswith("opened ")
    assert out[1:3] == ["turn seq 0 (parent None)", "turn seq 1 (parent 0)"]
    assert any(line.startswith("R3 tensor (") for line in out)
    assert out[-1] == "feed events of this session: 4"


def test_migrate_current_prints_json(db_url):
    result = run("migrate", "current", "--json", "--database-url", db_url)
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["current"] == body["head"] and body["head"]


@pytest.mark.parametrize("args, text", [
    (["sessions", "--stat", "closed"], "No such option: --stat"),
    (["sessions", "--label", "foo"], "'foo' is not KEY=VALUE"),
    (["gate", "check", "--run-id", "x"], "Missing option '--test-path'"),
])
def test_a_usage_error_is_one_line_naming_the_help(args, text):
    command = " ".join(["turnlog", *args[:2 if args[0] == "gate" else 1]])
    line = one_error_line(run(*args))
    assert text in line and f"(see `{command} --help`)" in line
