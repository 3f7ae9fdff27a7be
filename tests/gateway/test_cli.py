"""`turnlog gateway`'s own errors: one line on stderr, exit code 2, before anything starts."""

from __future__ import annotations

import socket

import pytest

from tests.cli.support import one_error_line, run, sqlite_file
from tests.serverproc import free_port


@pytest.mark.parametrize(("flags", "expected"), [
    (["--upstream", "127.0.0.1:30000"], "must be an http:// or https:// URL"),
    (["--upstream", "http://127.0.0.1:1", "--label", "novalue"], "is not KEY=VALUE"),
    (["--upstream", "http://127.0.0.1:1", "--label", "bad key=1"], "label names"),
])
def test_bad_flags_are_one_line(flags, expected, tmp_path):
    line = one_error_line(run("gateway", *flags, "--database-url", sqlite_file(tmp_path),
                              "--spool-dir", str(tmp_path / "spool")))
    assert expected in line


def test_a_taken_port_is_one_line_before_anything_is_created(tmp_path):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        line = one_error_line(run("gateway", "--upstream", "http://127.0.0.1:1", "--port",
                                  str(port), "--database-url", sqlite_file(tmp_path),
                                  "--spool-dir", str(tmp_path / "spool")))
    assert f"port {port} on 127.0.0.1 is already in use" in line
    assert not (tmp_path / "t.db").exists() and not (tmp_path / "spool").exists()
