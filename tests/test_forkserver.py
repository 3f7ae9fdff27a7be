"""The tests' fork server (tests/forkserver.py) starts a child as `subprocess.Popen`
would: its argv, working directory, environment, output and exit status, and
turnlog not loaded before the child imports it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forkserver import ROOT, UNKNOWN_EXIT, ForkedProcess, _Zygote, spawn
from tests.serverproc import server_env


def _start(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
           ) -> ForkedProcess | subprocess.Popen[bytes]:
    full_env = server_env({"FORKCHILD_VAR": "seen", **(env or {})})
    return spawn([sys.executable, "-m", "tests.forkchild", *args], cwd=ROOT,
                 env=full_env, log=tmp_path / "child.log")


def test_a_forked_child_sees_its_own_start_and_its_exit_code_is_reported(tmp_path: Path) -> None:
    child = _start(tmp_path, "one", "two", "3")
    assert isinstance(child, ForkedProcess)
    assert child.wait(timeout=30) == 3
    seen = json.loads((tmp_path / "child.log").read_text())
    assert seen["argv"][1:] == ["one", "two", "3"]
    assert seen["argv"][0].endswith("forkchild.py")
    assert seen["cwd"] == str(ROOT) == seen["path0"]
    assert seen["var"] == "seen"
    assert seen["stdin"] == ""
    assert seen["name"] == "__main__"
    assert seen["app_loaded"] is False, "turnlog is imported by the child, not before the fork"


def test_a_signalled_child_reports_the_signal_as_popen_does(tmp_path: Path) -> None:
    child = spawn([sys.executable, "-m", "tests.forksleep"], cwd=ROOT,
                  env=server_env(), log=tmp_path / "sleep.log")
    assert isinstance(child, ForkedProcess)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.kill()  # a reaped child is not signalled again


def test_an_interpreter_setting_of_its_own_starts_a_fresh_interpreter(tmp_path: Path) -> None:
    child = _start(tmp_path, "0", env={"PYTHONHASHSEED": "7"})
    assert isinstance(child, subprocess.Popen)
    assert child.wait(timeout=60) == 0
    assert json.loads((tmp_path / "child.log").read_text())["var"] == "seen"


def test_a_directory_that_is_not_there_is_refused_at_once_as_by_popen(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        spawn([sys.executable, "-m", "tests.forkchild", "0"], cwd=tmp_path / "gone",
              env=server_env(), log=tmp_path / "child.log")


def test_an_answer_left_unread_is_not_taken_for_the_next_one(tmp_path: Path) -> None:
    """A call interrupted between its request and its answer (Ctrl-C) leaves the
    answer in the pipe: the next call skips it by its number."""
    child = _start(tmp_path, "0")
    assert isinstance(child, ForkedProcess)
    assert child.wait(timeout=30) == 0
    zygote = child.zygote
    with zygote.lock:  # a status request whose answer nobody reads
        assert zygote.proc.stdin is not None
        zygote.seq += 1
        zygote.proc.stdin.write(json.dumps({"op": "status", "pid": child.pid,
                                            "seq": zygote.seq}) + "\n")
        zygote.proc.stdin.flush()
    # The next start reads its own answer (a pid), not the status left in the pipe.
    other = _start(tmp_path, "7")
    assert isinstance(other, ForkedProcess) and other.pid != child.pid
    assert other.wait(timeout=30) == 7


def test_a_child_outliving_its_zygote_can_still_be_stopped(tmp_path: Path) -> None:
    """The zygote killed from outside: its children's handles still see them running,
    stop them, and then report them ended."""
    zygote = _Zygote()
    try:
        answer = zygote.ask({"op": "spawn", "module": "tests.forksleep", "args": [],
                             "cwd": str(ROOT), "env": server_env(),
                             "log": str(tmp_path / "sleep.log")})
        child = ForkedProcess(zygote, answer["pid"], ["sleep"])
        assert child.poll() is None
        zygote.proc.kill()
        zygote.proc.wait(timeout=10)
        assert child.poll() is None  # still running: its pid is still this child
        child.terminate()
        assert child.wait(timeout=30) == UNKNOWN_EXIT
    finally:
        zygote.close()
