"""One error path for every command: one line on stderr, exit 2, no traceback unless
--debug, passwords masked; nothing created by a command that only reads; the port
checked before migrating; `make clean` keeps the event log."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import uuid
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from tests.cli.support import (
    DATA,
    ROOT,
    UNREACHABLE,
    one_error_line,
    run,
    sqlite_file,
)
from tests.serverproc import free_port

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


def test_debug_shows_the_traceback_and_exits_as_every_failure():
    # A tester's finding: with --debug a failure exited 1 (the traceback raised on),
    # without it 2, as the docs say every failure does.
    result = run("--debug", "replay", "abc", "--database-url", UNREACHABLE)
    assert result.exit_code == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert "OSError" in result.stderr or "Error" in result.stderr.splitlines()[-1]


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


def test_a_malformed_sqlite_file_says_what_may_have_done_it(tmp_path):
    """A helper's finding: a file a server's -wal was merged into after a replace said
    only "database disk image is malformed"."""
    url = sqlite_file(tmp_path, "broken.db")
    run("migrate", "--database-url", url)
    size = (tmp_path / "broken.db").stat().st_size
    with open(tmp_path / "broken.db", "r+b") as file:  # every page past the schema's
        file.seek(4096)
        file.write(b"\x07" * (size - 4096))
    line = one_error_line(run("sessions", "--database-url", url))
    assert "malformed" in line and "-wal" in line and "backup" in line


def test_a_full_sqlite_disk_says_to_make_room_first(tmp_path):
    """A helper's finding: `turnlog retention r3` on a full disk said only "database or
    disk is full", though freeing R3 writes too and cannot run until there is room.
    The file cannot grow here (`max_page_count`): SQLite's answer on a full disk."""
    import sqlalchemy as sa

    def no_room(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.cursor().execute("PRAGMA max_page_count = 2")

    sa.event.listen(sa.engine.Engine, "connect", no_room)
    try:
        result = run("migrate", "--database-url", sqlite_file(tmp_path))
    finally:
        sa.event.remove(sa.engine.Engine, "connect", no_room)
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]  # after "creating a new SQLite database"
    assert "disk is full" in line and "free space on it first" in line
    assert "turnlog retention r3" in line


def test_another_applications_file_is_named_as_such_not_sent_to_migrate(tmp_path):
    """A tester's finding: `sessions` said "run `turnlog migrate`", which then refused."""
    with sqlite3.connect(tmp_path / "other.db") as conn:
        conn.execute("CREATE TABLE foo (x)")
    line = one_error_line(run("sessions", "--database-url", sqlite_file(tmp_path, "other.db")))
    assert "not turnlog's (foo)" in line and "turnlog migrate`" not in line


def test_an_unmigrated_postgres_database_says_run_migrate(fresh_database):
    url = fresh_database("postgres")
    line = one_error_line(run("replay", "abc", "--database-url", url))
    assert line.startswith("error: not migrated: run `turnlog migrate`")


def test_postgres_scheme_is_accepted_and_the_password_is_masked(fresh_database, monkeypatch):
    """`postgres://` (Heroku style) works; `serve` prints where it migrated, masked."""
    url = make_url(fresh_database("postgres"))
    password = url.password or "not-needed-with-trust-auth"
    plain = url.set(drivername="postgres", password=password).render_as_string(
        hide_password=False)
    assert plain.startswith("postgres://")
    calls: list[Any] = []
    # What `serve` would hand uvicorn is recorded, not run (`app.cli.main` the module).
    monkeypatch.setattr(sys.modules["app.cli.main"], "run_server", calls.append)
    result = run("serve", "--port", str(free_port()), "--database-url", plain)
    assert result.exit_code == 0, result.output
    assert "schema at head on postgresql+asyncpg://" in result.stderr
    assert ":***@" in result.stderr
    assert password not in result.output
    assert calls and calls[0].log_config is None


def test_a_port_in_use_is_found_before_anything_is_created(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules["app.cli.main"], "run_server",
                        lambda config: pytest.fail("uvicorn started"))
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


def test_a_bad_log_format_is_one_line():
    line = one_error_line(run("--log-format", "xml", "sessions"))
    assert "log format must be one of auto, json, console" in line
    line = one_error_line(run("--log-format", "xml", "serve"))  # via the environment
    assert "TURNLOG_LOG_FORMAT" in line and "'auto', 'json' or 'console'" in line


@pytest.mark.parametrize("args, text", [
    (["sessions", "--stat", "closed"], "No such option: --stat"),
    (["sessions", "--label", "foo"], "'foo' is not KEY=VALUE"),
    (["gate", "check", "--run-id", "x"], "Missing option '--test-path'"),
])
def test_a_usage_error_is_one_line_naming_the_help(args, text):
    command = " ".join(["turnlog", *args[:2 if args[0] == "gate" else 1]])
    line = one_error_line(run(*args))
    assert text in line and f"(see `{command} --help`)" in line


def test_a_server_url_nothing_answers_names_it_and_how_to_start_one():
    url = f"http://127.0.0.1:{free_port()}"
    line = one_error_line(run("consumers", "list", "--url", url))
    assert line.count(url) == 1 and "turnlog serve" in line, line
    assert "None" not in line, line


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`turnlog … | head`: the pipe breaks mid-output. That is not a failure of the
    command (it was once reported as "cannot connect to the database: Broken pipe"),
    so it ends quietly with the status a SIGPIPE gives."""
    import typer
    from typer.testing import CliRunner

    from app.cli.common import TurnlogGroup

    app = typer.Typer(cls=TurnlogGroup)

    @app.command()
    def many() -> None:
        raise BrokenPipeError(32, "Broken pipe")

    @app.command()
    def other() -> None:
        pass

    result = CliRunner().invoke(app, ["many"])
    assert result.exit_code == 141, result.output
    assert "error" not in result.output and "database" not in result.output


def test_a_real_pipe_closed_early_ends_with_141_and_nothing_on_stderr(tmp_path):
    """The same through rich's console, as `turnlog demo | head -2` really runs: rich
    exits 1 itself on a broken pipe (it did, with nothing said)."""
    url = sqlite_file(tmp_path)
    command = [sys.executable, "-m", "app", "demo", "--sessions", "40", "--database-url", url]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.readline()
        proc.stdout.close()  # the reader goes away, as `head -1` does
        stderr = proc.stderr.read().decode()
        code = proc.wait(timeout=120)
    assert code == 141, stderr
    assert "error" not in stderr and "Traceback" not in stderr, stderr


@pytest.fixture(scope="module")
def eighty_sessions(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite store of 80 demo sessions, only read by the tests that use it."""
    url = sqlite_file(tmp_path_factory.mktemp("eighty"))
    demo = run("demo", "--sessions", "80", "--database-url", url)
    assert demo.exit_code == 0, demo.output
    return url


@pytest.mark.parametrize("as_json", [False, True])
def test_a_reader_gone_during_one_large_write_is_141_not_0(eighty_sessions, as_json):
    """A helper's finding: `turnlog sessions | head -1` exited 0 when the output was
    one large write. The kernel took part of it before the reader left; CPython's
    buffered stdout dropped the rest and reported success. (A pipe of 4 KB here, so a
    few sessions' listing is such a write.)"""
    import fcntl

    url = eighty_sessions
    command = [sys.executable, "-m", "app", "sessions", "--limit", "80", "--database-url", url,
               *(["--json"] if as_json else [])]
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, 1031, 4096)  # F_SETPIPE_SZ: the output is more than the pipe
    with subprocess.Popen(command, cwd=ROOT, stdout=write_end,
                          stderr=subprocess.PIPE) as proc:
        os.close(write_end)
        with os.fdopen(read_end, "rb") as reader:
            taken = reader.read(100)  # the reader goes away, as `head -c 100` does
        assert proc.stderr is not None
        stderr = proc.stderr.read().decode()
        code = proc.wait(timeout=120)
    assert len(taken) == 100
    assert code == 141, stderr
    assert "Traceback" not in stderr, stderr


def test_an_export_into_a_missing_folder_names_out_not_the_database(tmp_path):
    """It said "cannot connect to <the database>: … r.npz.partial" (check --database-url)."""
    line = one_error_line(run("export", "--run-id", "r", "--out",
                              str(tmp_path / "nodir" / "r.npz"),
                              "--database-url", sqlite_file(tmp_path, "absent.db")))
    assert f"cannot write {tmp_path / 'nodir' / 'r.npz'}" in line and "--out" in line
    assert "database" not in line and ".partial" not in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["npz", "parquet"])
def test_an_export_the_disk_cannot_take_names_the_file_and_leaves_nothing(tmp_path, monkeypatch,
                                                                         fmt):
    # A helper's finding: on a full disk the export said "cannot connect to <the
    # database>: [Errno 28] No space left on device" and left its .partial file (the
    # writer's close, in the failure path, failed again before the file was removed).
    import errno

    import pyarrow.parquet as pq

    from app.transfer.npz import NpzWriter

    def full(self: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "o.partial"))

    monkeypatch.setattr(NpzWriter if fmt == "npz" else pq.ParquetWriter, "close", full)
    url = sqlite_file(tmp_path)
    assert run("demo", "--sessions", "1", "--database-url", url).exit_code == 0
    line = one_error_line(run("export", "--run-id", "demo", "--format", fmt,
                              "--out", str(tmp_path / f"o.{fmt}"), "--database-url", url))
    assert "No space left on device" in line and "cannot use the file" in line
    assert "database" not in line and "connect" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.db"]


def test_an_export_never_replaces_what_is_not_a_file(tmp_path):
    """A tester's finding: `--out /dev/full` (as root) replaced the device with a zip
    file; a FIFO too. A symlink is written through, and stays a link."""
    url = sqlite_file(tmp_path)
    assert run("demo", "--sessions", "1", "--database-url", url).exit_code == 0
    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)
    line = one_error_line(run("export", "--run-id", "demo", "--out", str(fifo),
                              "--database-url", url))
    assert "not a regular file" in line and "--out" in line
    assert fifo.is_fifo()
    (tmp_path / "real.npz").write_bytes(b"old")
    (tmp_path / "link.npz").symlink_to(tmp_path / "real.npz")
    result = run("export", "--run-id", "demo", "--out", str(tmp_path / "link.npz"),
                 "--database-url", url, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["out"] == str(tmp_path / "link.npz")  # as given
    assert (tmp_path / "link.npz").is_symlink()
    (tmp_path / "loop.npz").symlink_to(tmp_path / "loop.npz")
    line = one_error_line(run("export", "--run-id", "demo", "--out", str(tmp_path / "loop.npz"),
                              "--database-url", url))
    assert "a loop of symlinks" in line
    assert (tmp_path / "real.npz").read_bytes()[:2] == b"PK"  # the export, through the link


def test_an_exports_format_follows_its_suffix_and_a_contradiction_is_refused(tmp_path):
    """A tester's finding: `--out x.parquet` wrote npz into it (the default format), and
    `--label run_id=B` beside `--run-id A` was dropped without a word."""
    import pyarrow.parquet as pq

    url = sqlite_file(tmp_path)
    assert run("demo", "--sessions", "1", "--database-url", url).exit_code == 0
    out = tmp_path / "x.parquet"
    result = run("export", "--run-id", "demo", "--out", str(out), "--database-url", url)
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).num_rows >= 1
    line = one_error_line(run("export", "--run-id", "demo", "--format", "npz", "--out",
                              str(tmp_path / "y.parquet"), "--database-url", url))
    assert "--format" in line and ".parquet" in line
    line = one_error_line(run("export", "--run-id", "demo", "--label", "run_id=other",
                              "--out", str(tmp_path / "z.npz"), "--database-url", url))
    assert "contradicts --run-id" in line
    assert not (tmp_path / "y.parquet").exists() and not (tmp_path / "z.npz").exists()


def test_two_exports_to_one_file_write_apart() -> None:
    # Each process writes its own partial file, renamed onto --out when done: two
    # exports to one name no longer replace each other's half-written file.
    from pathlib import Path

    from app.transfer.npz import partial_path

    assert str(os.getpid()) in partial_path(Path("/x/o.npz")).name
    assert partial_path(Path("/x/o.npz")).parent == Path("/x")


def _interruptible() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_tail_stopped_by_ctrl_c_or_by_its_reader_ends_as_every_command(tmp_path):
    """`turnlog tail` follows until stopped. Ctrl-C: where to resume, `interrupted` and
    130; a reader that goes away (`| head -1`): 141, nothing on stderr but the cursor.
    It ended 0 both ways, unlike every other command (and a pipeline's status lied)."""
    import signal

    url = sqlite_file(tmp_path)
    subprocess.run([sys.executable, "-m", "app", "demo", "--sessions", "2",
                    "--database-url", url], cwd=ROOT, check=True, capture_output=True)
    command = [sys.executable, "-m", "app", "tail", "--from-start", "--wait", "1",
               "--database-url", url]
    # Ctrl-C reaches the command even when the tests run as a shell's background job
    # (which starts them with SIGINT ignored, inherited by every child).
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          preexec_fn=_interruptible) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline()  # following now
        proc.send_signal(signal.SIGINT)
        stderr = proc.stderr.read().decode()
        code = proc.wait(timeout=60)
    assert code == 130, stderr
    assert stderr.splitlines()[-2:][0].startswith("resume with: turnlog tail --after ")
    assert stderr.splitlines()[-1] == "interrupted"
    with subprocess.Popen(command + ["--json"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.readline()
        proc.stdout.close()  # the reader goes away, as `head -1` does
        # New events, so that it writes again (it may have written all the old ones).
        subprocess.run([sys.executable, "-m", "app", "demo", "--sessions", "1",
                        "--database-url", url], cwd=ROOT, check=True, capture_output=True)
        stderr = proc.stderr.read().decode()
        code = proc.wait(timeout=60)
    assert code == 141, stderr
    assert "error" not in stderr and "Traceback" not in stderr, stderr


@pytest.mark.parametrize(("args", "said"), [
    (["serve", "--port", "99999"], "'--port'"),
    (["rebuild", "--metrics-port", "0"], "'--metrics-port'"),
    (["retention", "r3", "--consumer", "g", "--acked-before", "nope"],
     "--acked-before is not an ISO-8601 time"),
])
def test_a_bad_flag_value_is_named_by_its_flag(tmp_path, args, said):
    """It was named by the setting or the field behind it (TURNLOG_PORT, acked_before),
    which a user who typed a flag has never seen."""
    line = one_error_line(run(*args, "--database-url", sqlite_file(tmp_path)))
    assert said in line, line
    assert "TURNLOG_" not in line and "acked_before" not in line, line


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"]], ids=["top", "command"])
def test_help_into_a_reader_that_stops_early_ends_with_141(args):
    """`turnlog --help | head -1`: typer prints help through rich consoles of its own,
    which exit 1 on the broken pipe (every other command's output gave 141)."""
    command = [sys.executable, "-m", "app", *args]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # gone before a byte is read, as `head` is after its line
        stderr = proc.stderr.read().decode()
        code = proc.wait(timeout=60)
    assert code == 141, stderr
    assert "Traceback" not in stderr, stderr


def test_a_database_in_a_read_only_folder_says_why_it_cannot_be_opened(tmp_path, monkeypatch):
    # A helper's finding (a read-only mount): every command said "unable to open database
    # file". SQLite in WAL mode writes -wal and -shm files beside the file, even to read.
    import app.cli.common as common

    url = sqlite_file(tmp_path)
    assert run("migrate", "--database-url", url).exit_code == 0
    real = os.access
    monkeypatch.setattr(common.os, "access",
                        lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    line = one_error_line(run("sessions", "--database-url", url))
    assert f"the folder {tmp_path} is not writable" in line and "-shm" in line


def test_a_database_a_newer_turnlog_migrated_says_upgrade_turnlog_not_migrate(tmp_path):
    # A helper's finding: "this turnlog expects 0012: run `turnlog migrate`", and
    # `turnlog migrate` then failed with alembic's "Can't locate revision '0099'".
    url = sqlite_file(tmp_path)
    assert run("migrate", "--database-url", url).exit_code == 0
    with sqlite3.connect(tmp_path / "t.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0099'")
    for command in (["sessions"], ["migrate"], ["migrate", "downgrade", "0011"]):
        line = one_error_line(run(*command, "--database-url", url))
        assert "revision 0099" in line and "upgrade turnlog" in line, (command, line)
        assert "turnlog migrate`" not in line and "Can't locate" not in line


def test_a_revision_turnlog_does_not_ship_is_refused_by_name(tmp_path):
    url = sqlite_file(tmp_path)
    assert run("migrate", "--database-url", url).exit_code == 0
    for action, revision in (("downgrade", "zzz"), ("upgrade", "0099")):
        line = one_error_line(run("migrate", action, revision, "--database-url", url))
        assert f"no revision '{revision}'" in line and "CommandError" not in line
    assert run("migrate", "downgrade", "0011", "--database-url", url).exit_code == 0


@pytest.mark.parametrize(("command", "named"), [
    (["sessions", "--status", "bogus"], "--status 'bogus': expected open or closed"),
    (["tail", "--after", "garbage"], "--after 'garbage' is not a feed cursor"),
    # Well formed, naming no event of this store (a review's finding: "this server").
    (["tail", "--after", "djE6OTk5OTk5OTk6NQ"], "names no event of this store")])
def test_a_bad_option_value_is_named_as_the_option(tmp_path, command, named):
    """A tester's finding: "status must be open or closed", "cursor is not one this
    server issued" (there is no server) — neither named the option."""
    url = sqlite_file(tmp_path)
    assert run("migrate", "--database-url", url).exit_code == 0
    assert named in one_error_line(run(*command, "--database-url", url))


def test_arguments_that_would_be_ignored_are_refused(tmp_path, monkeypatch):
    """A tester's findings: `migrate current 0003` ignored the revision, and an empty
    `--database-url` (an unset shell variable) fell back to ./turnlog.db."""
    monkeypatch.chdir(tmp_path)
    url = sqlite_file(tmp_path)
    assert run("migrate", "--database-url", url).exit_code == 0
    line = one_error_line(run("migrate", "current", "0003", "--database-url", url))
    assert "takes no revision" in line
    line = one_error_line(run("sessions", "--database-url", ""))
    assert "--database-url is empty" in line
    assert not (tmp_path / "turnlog.db").exists()


def test_stored_text_cannot_drive_the_terminal(tmp_path):
    """A tester's finding: an ANSI escape in a label recoloured `turnlog sessions`, and a
    line break in one forged a line of `turnlog show`."""
    from app.cli.common import printable

    assert printable("a\x1b[31mred\nforged [b]x[/b]") == "a\\x1b[31mred\\x0aforged \\[b]x\\[/b]"
    import asyncio

    from tests.inprocess import served

    url = sqlite_file(tmp_path)
    assert run("migrate", "--database-url", url).exit_code == 0

    async def open_it() -> None:
        async with served(url.replace("sqlite:", "sqlite+aiosqlite:", 1)) as (_app, http):
            r = await http.post("/v1/sessions", json={
                "session_id": "inj1", "version": "v2",
                "labels": {"run_id": "x\x1b[31m\n{\"level\":\"error\"}"}})
            assert r.status_code == 201, r.text

    asyncio.run(open_it())
    for command in (["sessions"], ["show", "inj1"]):
        result = run(*command, "--database-url", url)
        assert "\x1b" not in result.stdout and "\\x1b" in result.stdout, result.stdout
        assert '\n{"level"' not in result.stdout


def test_long_work_off_a_terminal_writes_nothing_to_stderr(tmp_path):
    """A tester's finding: the progress bar, not drawn off a terminal, still left a blank
    line on stderr (rebuild, import, export, retention, demo)."""
    url = sqlite_file(tmp_path)
    assert run("demo", "--sessions", "1", "--database-url", url).exit_code == 0
    for command in (["rebuild", "--json"], ["demo", "--sessions", "1", "--json"],
                    ["export", "--run-id", "demo", "--out", str(tmp_path / "o.npz"), "--json"]):
        result = run(*command, "--database-url", url)
        assert result.exit_code == 0 and result.stderr == "", (command, result.stderr)


def test_a_busy_metrics_port_is_named_as_the_port(tmp_path):
    """A tester's finding: `rebuild --metrics-port` on a port in use said "cannot connect
    to <the database>: Address already in use (check --database-url …)"."""
    url = sqlite_file(tmp_path)
    assert run("migrate", "--database-url", url).exit_code == 0
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_error_line(run("rebuild", "--metrics-port", str(port), "--database-url", url))
    assert f"127.0.0.1:{port}" in line and "--metrics-port" in line
    assert "database" not in line


def test_a_downgrade_that_drops_rows_is_refused_without_drop_data(tmp_path):
    """A tester's finding: `migrate downgrade base` dropped every session without a word."""
    url = sqlite_file(tmp_path)
    assert run("demo", "--sessions", "1", "--database-url", url).exit_code == 0
    line = one_error_line(run("migrate", "downgrade", "base", "--database-url", url))
    assert "events (" in line and "--drop-data" in line and "nothing was changed" in line
    from app.store.engine.migrate import head_revision

    head = head_revision()
    assert f"current: {head}" in run("migrate", "current", "--database-url", url).output
    # A step that drops no rows goes on, and says where it went (it said "to -1").
    result = run("migrate", "downgrade", "--database-url", url)
    assert result.exit_code == 0 and f"to {int(head) - 1:04d}" in result.stderr, result.stderr
    # Relative targets are resolved as the downgrade resolves them, against the current
    # revision (a review's finding: -1 counted from head, and 0011+1 broke the guard).
    line = one_error_line(run("migrate", "downgrade", "head-14", "--database-url", url))
    assert "events (" in line, line
    result = run("migrate", "downgrade", "0011+1", "--database-url", url)
    assert result.exit_code == 0 and "to 0012" in result.stderr, result.output
    assert run("migrate", "downgrade", "0003", "--database-url", url).exit_code == 0
    for reached in ("0002", "0001"):  # one step at a time, from below head
        result = run("migrate", "downgrade", "--database-url", url)
        assert result.exit_code == 0 and f"to {reached}" in result.stderr, result.output
    line = one_error_line(run("migrate", "downgrade", "--database-url", url))
    assert "events (" in line, line
    result = run("migrate", "downgrade", "--drop-data", "--database-url", url)
    assert result.exit_code == 0, result.output
    assert "current: None" in result.output


@pytest.mark.parametrize("backend_name", ["sqlite", "postgres", "citus"])
def test_the_downgrade_guard_counts_rows_on_every_backend(fresh_database, backend_name):
    """A tester's finding: on PostgreSQL the guard's count (`… AS some`: a reserved word
    there) failed every downgrade that drops a table with a syntax error."""
    url = fresh_database(backend_name)
    assert run("demo", "--sessions", "1", "--database-url", url).exit_code == 0
    line = one_error_line(run("migrate", "downgrade", "base", "--database-url", url))
    assert "events (" in line and "--drop-data" in line and "nothing was changed" in line
    from app.store.engine.migrate import head_revision

    assert f"current: {head_revision()}" in run("migrate", "current", "--database-url",
                                                url).output
    # Below 0004 the consumer tables go: counted (empty: the demo defines no group).
    result = run("migrate", "downgrade", "0003", "--database-url", url)
    assert result.exit_code == 0 and "current: 0003" in result.output, result.output
    assert run("migrate", "--database-url", url).exit_code == 0
    # Below 0005, which sessions' R3 retention freed (an older version would read it).
    import asyncio

    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine

    from app.store.engine.migrate import normalize_url

    async def execute(statement: str) -> None:
        engine = create_async_engine(normalize_url(url))
        async with engine.begin() as conn:
            await conn.execute(sa.text(statement))
        await engine.dispose()

    asyncio.run(execute("UPDATE sessions SET r3_pruned_bytes = 8"))
    line = one_error_line(run("migrate", "downgrade", "0004", "--database-url", url))
    assert "sessions.r3_pruned_bytes (1 row)" in line and "nothing was changed" in line, line
    # Below 0007, which groups wait for rewarded sessions (one does; one does not).
    asyncio.run(execute("UPDATE sessions SET r3_pruned_bytes = NULL"))

    async def define_groups() -> None:
        import httpx

        from app.main import create_app
        from app.settings import Settings

        app = create_app(Settings.load(database_url=url, migrate_on_start=False,
                                       api_tokens=""))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://turnlog") as http:
            for name, wait in (("waits", True), ("plain", False)):
                assert (await http.put(f"/v1/consumers/{name}", json={
                    "labels": {}, "require_reward": wait})).status_code == 201
        await app.state.services.db.dispose()

    asyncio.run(define_groups())
    line = one_error_line(run("migrate", "downgrade", "0006", "--database-url", url))
    assert "consumer_groups.require_reward (1 row)" in line, line


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_an_in_memory_sqlite_database_is_refused_naming_a_file(url):
    # Each connection of one is a database of its own: `migrate` said "upgraded" and then
    # "current: None"; `demo` failed with a 503.
    for command in (["migrate"], ["demo", "--sessions", "1"], ["sessions"]):
        line = one_error_line(run(*command, "--database-url", url))
        assert "in-memory" in line and "sqlite:///FILE" in line


def test_demo_says_what_the_store_answered_not_an_httpx_error():
    import httpx

    from app.cli.common import CliError
    from app.cli.demo import _answered

    request = httpx.Request("POST", "http://localhost/v1/sessions/s/turns")
    reply = httpx.Response(503, request=request, json={
        "type": "urn:turnlog:unavailable", "title": "store unavailable",
        "detail": "the database's disk is full: nothing of this request was stored"})
    with pytest.raises(CliError) as exc:
        _answered(reply)
    assert str(exc.value) == ("the store answered 503 to POST /v1/sessions/s/turns: store "
                              "unavailable: the database's disk is full: nothing of this "
                              "request was stored")
    _answered(httpx.Response(201, request=request))


def test_import_of_a_file_that_is_not_json_is_one_failure_and_empty_is_a_warning(tmp_path):
    # A helper's finding: an .npz (or gzip) gave a failure per "line" of its bytes, each
    # naming session "None"; an empty file exited 0 without a word.
    url = sqlite_file(tmp_path)
    junk = tmp_path / "samples.npz"
    junk.write_bytes(bytes(range(256)) * 40 + b"\n" + bytes(range(256)) * 40)
    result = run("import", str(junk), "--database-url", url)
    assert result.exit_code == 1, result.output
    failures = [line for line in result.stdout.splitlines() if "invalid-dump" in line]
    assert len(failures) == 1 and "not JSON, nor JSON Lines" in failures[0]
    assert "None" not in failures[0]
    # Lines of dumps whose first is damaged: that line fails, the others are imported.
    from tests.test_import_export import linear_dump

    lines = tmp_path / "dumps.txt"
    lines.write_text('{"records": [\n' + json.dumps(linear_dump(turns=2, seed=3)) + "\n")
    result = run("import", str(lines), "--database-url", url)
    assert result.exit_code == 1 and "1 (1 new" in result.stdout, result.output
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    result = run("import", str(empty), "--database-url", url)
    assert result.exit_code == 0 and "no session dump in" in result.stderr
