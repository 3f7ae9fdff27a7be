"""`turnlog gateway` at start: its own errors (one line on stderr, exit code 2, before anything
starts) and its warnings."""

from __future__ import annotations

import socket

import pytest

from tests.cli.support import one_error_line, run, sqlite_file
from tests.serverproc import free_port


@pytest.mark.parametrize(("flags", "expected"), [
    (["--upstream", "127.0.0.1:30000"], "must be an http:// or https:// URL"),
    (["--upstream", "http://127.0.0.1:1", "--label", "novalue"], "is not KEY=VALUE"),
    (["--upstream", "http://127.0.0.1:1", "--label", "bad key=1"], "label names"),
    # A tester's finding: a path no request can have started a gateway that recorded nothing.
    (["--upstream", "http://127.0.0.1:1", "--record-path", "nopath"],
     "--record-path 'nopath' is no path a request to the gateway can have (expected a path "
     "from /"),
    (["--upstream", "http://127.0.0.1:1", "--record-path", "/generate?x=1"], "no path"),
    (["--upstream", "http://127.0.0.1:1", "--record-path", "/v1/chat completions"], "no path"),
    (["--upstream", "http://127.0.0.1:1", "--record-path", "/turnlog/healthz"], "not under"),
])
def test_bad_flags_are_one_line(flags, expected, tmp_path):
    line = one_error_line(run("gateway", *flags, "--database-url", sqlite_file(tmp_path),
                              "--spool-dir", str(tmp_path / "spool")))
    assert expected in line


@pytest.mark.parametrize(("upstream", "host"), [
    ("http://127.0.0.1:{port}", "127.0.0.1"), ("http://localhost:{port}/", "127.0.0.1"),
    ("http://127.0.0.1:{port}", "0.0.0.0"), ("http://[::1]:{port}", "::1"),
])
def test_its_own_address_as_upstream_is_refused(tmp_path, upstream, host):
    # A newcomer's finding: `--upstream` the gateway's own address (the router's usual
    # port is the gateway's default) started, then forwarded each request to itself
    # until its file descriptors ran out.
    port = free_port()
    line = one_error_line(run("gateway", "--upstream", upstream.format(port=port), "--host",
                              host, "--port", str(port),
                              "--database-url", sqlite_file(tmp_path),
                              "--spool-dir", str(tmp_path / "spool")))
    assert "this gateway's own address" in line and "SGLang router" in line


def test_no_migrate_without_a_store_says_so_at_start(tmp_path, monkeypatch):
    # It started silently and spooled every turn, "no such table: sessions", for ever.
    # Not refused (the store's volume may appear later: tests/gateway/test_faults.py),
    # but said, naming what to run.
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)  # start, not serve
    for url in (sqlite_file(tmp_path, "absent.db"), sqlite_file(tmp_path, "empty.db")):
        if "empty" in url:
            (tmp_path / "empty.db").touch()
        result = run("gateway", "--upstream", "http://127.0.0.1:1", "--no-migrate",
                     "--port", str(free_port()), "--database-url", url,
                     "--spool-dir", str(tmp_path / "spool"))
        assert result.exit_code == 0, result.output
        assert "--no-migrate" in result.stderr and "turnlog migrate" in result.stderr
        assert "every turn is spooled" in result.stderr


def test_a_taken_port_is_one_line_before_anything_is_created(tmp_path):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        line = one_error_line(run("gateway", "--upstream", "http://127.0.0.1:1", "--port",
                                  str(port), "--database-url", sqlite_file(tmp_path),
                                  "--spool-dir", str(tmp_path / "spool")))
    assert f"port {port} on 127.0.0.1 is already in use" in line
    assert "make run" not in line  # `make run` starts `turnlog serve`, not a gateway
    assert not (tmp_path / "t.db").exists() and not (tmp_path / "spool").exists()


async def test_an_idle_close_not_above_the_upstream_timeout_is_warned_about(
        tmp_path, gateway_process):
    """A turn generating through another gateway is not seen by this one's idle close:
    an idle time below the longest generation (the upstream timeout) may close a
    session under it (docs/gateway.md, "Sessions"). Said at start; not said when the
    idle time is above it."""
    url = sqlite_file(tmp_path)
    short = gateway_process(url, "--idle-close-seconds", "5")
    long = gateway_process(url, "--idle-close-seconds", "5", "--upstream-timeout", "2")
    for process in (short, long):
        await process.wait_ready()
    assert "is not above --upstream-timeout 600" in short.log_tail(50)
    assert "--upstream-timeout" not in long.log_tail(50)
