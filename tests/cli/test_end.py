"""How a `turnlog` command's process ends (`app.cli.main.end`): as `sys.exit(code)` would
(the status, the `atexit` handlers, everything written reaching a pipe or a file, a
working thread finished first), without the interpreter's teardown."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = """
import atexit, sys, threading, time
from app.cli.main import end
atexit.register(lambda: print("atexit ran", flush=False))
sys.stdout.write("buffered, not flushed; ")
if {thread}:
    def work():
        time.sleep(0.3)
        sys.stdout.write("the thread finished; ")
    threading.Thread(target=work).start()
end({code!r})
print("not reached")
"""


def python(script: str) -> subprocess.CompletedProcess[str]:
    # Buffered as a command's output to a pipe is (this machine sets PYTHONUNBUFFERED).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=60, check=False,
                          stdin=subprocess.DEVNULL)


def ended(code: object, thread: bool = False) -> subprocess.CompletedProcess[str]:
    return python(SCRIPT.format(code=code, thread=thread))


@pytest.mark.parametrize(("code", "status"), [(0, 0), (None, 0), (3, 3), (141, 141)])
def test_the_status_is_the_codes_and_buffered_output_and_atexit_are_kept(code, status):
    done = ended(code)
    assert done.returncode == status, done.stderr
    assert done.stdout == "buffered, not flushed; atexit ran\n"
    assert done.stderr == ""


def test_a_message_goes_to_stderr_with_status_1_as_sys_exit_does():
    done = ended("error: it broke")
    assert (done.returncode, done.stderr) == (1, "error: it broke\n")
    assert done.stdout == "buffered, not flushed; atexit ran\n"


def test_a_thread_still_working_is_waited_for_as_a_normal_exit_does():
    done = ended(5, thread=True)
    assert done.returncode == 5, done.stderr
    assert done.stdout == "buffered, not flushed; the thread finished; atexit ran\n"


def test_a_reader_gone_before_the_last_flush_ends_with_141():
    done = python("""
        import os, sys
        from app.cli.main import end
        read, write = os.pipe()
        os.close(read)
        os.dup2(write, sys.stdout.fileno())
        sys.stdout.write("x" * 10)  # buffered: met by the final flush
        end(0)
    """)
    assert done.returncode == 141, done.stderr
    assert done.stderr == ""
