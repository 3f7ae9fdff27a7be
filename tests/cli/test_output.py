"""Output a CI job can live with: results on stdout (tables that never wrap without a
terminal, or --json), warnings and logs on stderr; import/export say what they skipped;
--token reaches a secured server through the project's client."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from tests.cli.support import (
    ROOT,
    TOKEN,
    one_error_line,
    run,
    sqlite_file,
    two_turns,
)


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


@pytest.fixture
def logging_switches_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """`configure_logging` turns the logging module's process-wide switches off; they
    are put back after the test, so later tests' log reports keep their file and line."""
    import logging

    for name in ("_srcfile", "logThreads", "logProcesses", "logMultiprocessing"):
        monkeypatch.setattr(logging, name, getattr(logging, name))


def test_log_format_auto_is_json_without_a_terminal_and_readable_with_console(
        capsys, logging_switches_kept):
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


def test_help_through_a_pipe_names_every_environment_variable_whole() -> None:
    """Without a terminal (a pipe, a pager, a CI log) help is laid out 120 columns wide:
    at rich's default 80 the option table cut `TURNLOG_GATEWAY_…` names short."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    done = subprocess.run([sys.executable, "-m", "app", "gateway", "--help"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "TURNLOG_GATEWAY_PAUSE_GENERATION_MODE" in done.stdout
    assert "TURNLOG_GATEWAY_…" not in done.stdout


@pytest.mark.parametrize(("args", "option"), [
    (("demo", "--sessions", "0"), "--sessions"),
    (("demo", "--sessions", "-1"), "--sessions"),
    (("consumers", "show", "g", "--acks", "-1"), "--acks"),
])
def test_a_count_below_its_range_is_one_error_line(tmp_path, args, option):
    # A helper's finding: these ran and printed empty tables (exit 0).
    line = one_error_line(run(*args, "--database-url", sqlite_file(tmp_path)))
    assert f"Invalid value for '{option}'" in line


def test_option_help_says_what_the_option_does_for_its_command():
    # A helper's finding: `import --label` was described as a filter, and the read-only
    # `consumers list/show` asked for a write token.
    def help_text(*command: str) -> str:  # the help's words, however rich wrapped them
        return " ".join(run(*command, "--help").stdout.replace("│", " ").split())

    assert "Label every imported session" in help_text("import")
    for command in (("consumers", "list"), ("consumers", "show")):
        text = help_text(*command)
        assert "a read token will do" in text and "write token" not in text, command


async def test_a_fixed_dump_imported_again_is_the_session_a_clean_import_makes(client, db_url,
                                                                              tmp_path):
    # A helper's finding: the records after a rejected one were appended anyway (a v1
    # session's record 2 hung off record 0), and the fixed dump imported again
    # appended record 1 after them: a branched tree and a wrong sample, exit 0.
    import asyncio
    import copy

    from tests.test_import_export import linear_dump, write_json

    good = linear_dump("retract", turns=4, seed=12)
    clean_sid = good["session_id"]
    bad = copy.deepcopy(good)
    bad["session_id"] = fixed_sid = clean_sid + "-fixed"
    bad["records"][1]["request"]["input_ids"] = "abc"
    fixed = {**copy.deepcopy(good), "session_id": fixed_sid}

    result = await asyncio.to_thread(run, "import", str(write_json(tmp_path / "b.json", bad)),
                                     "--close", "--json", "--database-url", db_url)
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["left_open"] == [fixed_sid], result.output
    (failure,) = report["failures"]
    assert failure["index"] == 1 and failure["not_imported"] == 2
    assert report["turns_imported"] == 1  # record 0; none after the rejected one
    for dump, name in ((fixed, "f.json"), (good, "g.json")):
        result = await asyncio.to_thread(run, "import", str(write_json(tmp_path / name, dump)),
                                         "--close", "--json", "--database-url", db_url)
        assert result.exit_code == 0, result.output

    def shape(summary):
        return [(n["seq"], n["parent"]) for n in summary["tree"]]

    fixed_summary = (await client.get(f"/v1/sessions/{fixed_sid}")).json()
    clean_summary = (await client.get(f"/v1/sessions/{clean_sid}")).json()
    assert shape(fixed_summary) == shape(clean_summary) == [(0, None), (1, 0), (2, 1), (3, 2)]
    samples = [(await client.get(f"/v1/sessions/{sid}/samples")).json()["samples"]
               for sid in (fixed_sid, clean_sid)]
    assert [(s["tokens"], s["loss_mask"]) for s in samples[0]] == \
        [(s["tokens"], s["loss_mask"]) for s in samples[1]]


def test_reading_the_schema_revision_logs_nothing(capsys, logging_switches_kept):
    """`/readyz` reads the schema revision on every probe: alembic's two lines about
    its context were logged each time; its migration steps still are."""
    import logging

    import sqlalchemy as sa
    import structlog

    from app.logs import configure_logging
    from app.store.engine.migrate import current_revision

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("info", "auto")
        with sa.create_engine("sqlite://").connect() as connection:
            assert current_revision(connection) is None
        logging.getLogger("alembic.runtime.migration").info("Running upgrade %s -> %s", "a", "b")
        err = capsys.readouterr().err
        assert "Context impl" not in err and "DDL" not in err
        assert "Running upgrade a -> b" in err
    finally:
        root.handlers, root.level = saved
        structlog.reset_defaults()


def test_the_readme_client_script_says_when_turnlog_is_not_there():
    import sys

    from tests.serverproc import free_port

    result = subprocess.run([sys.executable, str(ROOT / "examples" / "client.py"),
                             f"http://127.0.0.1:{free_port()}"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 1
    assert result.stderr.startswith("turnlog: connection-failed: cannot reach turnlog at"), \
        result.stderr


def test_with_json_logs_asked_for_every_stderr_line_is_json(db_url, tmp_path):
    """`--log-format json` by name: the command's own warnings and its failure go out as
    log records too, so a shipper that takes JSON lines reads all of stderr (a new
    user's walkthrough found the gateway's start lines plain among its JSON logs)."""
    body = {"coordinate": {"test_path": f"t/{uuid.uuid4().hex}", "backend": "b", "suite": "s"},
            "run_id": "r1", "attempt": 0, "trusted": True,
            "points": [{"metric": "train/my_new_metric", "step": 0, "value": 1.0}]}
    path = tmp_path / "h.json"
    path.write_text(json.dumps(body))
    result = run("--log-format", "json", "history", "submit", str(path), "--json",
                 "--database-url", db_url)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stderr.strip().splitlines()]
    assert any(r["level"] == "warning" and "dropped 1 metric(s)" in r["event"]
               for r in records), records
    failed = run("--log-format", "json", "show", f"no-{uuid.uuid4().hex}",
                 "--database-url", db_url)
    assert failed.exit_code == 2 and failed.stdout == ""
    (record,) = [json.loads(line) for line in failed.stderr.strip().splitlines()]
    assert record["level"] == "error" and "no session" in record["event"].lower(), record
    usage = run("--log-format", "json", "show", "x", "--no-such-option")
    (record,) = [json.loads(line) for line in usage.stderr.strip().splitlines()]
    assert record["level"] == "error" and "--no-such-option" in record["event"], record
    # Without the name (auto, here no terminal) they stay the text a person reads.
    plain = run("show", f"no-{uuid.uuid4().hex}", "--database-url", db_url)
    assert plain.stderr.startswith("error: ")


def test_a_servers_start_line_is_a_log_record_only_when_json_is_asked_for(
        capsys, logging_switches_kept):
    """`common.say` (the gateway's and serve's start lines): JSON with `json` by name,
    the text itself with `auto`, which is JSON for log records off a terminal too."""
    import logging

    import structlog

    from app.cli import common
    from app.logs import configure_logging

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("info", "json")
        common.say("turnlog gateway on http://127.0.0.1:1 [x]")
        record = json.loads(capsys.readouterr().err.strip())
        assert (record["level"], record["event"]) == ("info",
                                                      "turnlog gateway on http://127.0.0.1:1 [x]")
        configure_logging("info", "auto")  # pytest's stderr is no terminal
        common.say("turnlog gateway on http://127.0.0.1:1 [x]")
        assert capsys.readouterr().err.strip() == "turnlog gateway on http://127.0.0.1:1 [x]"
    finally:
        root.handlers, root.level = saved
        structlog.reset_defaults()
