"""What the command-line tests share: running `turnlog`, the one-line error check,
example sessions (tests/data) and a free port."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from app.cli import cli

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
UNREACHABLE = "postgresql://turnlog:hunter2-secret@127.0.0.1:1/turnlog"
TOKEN = "w-0123456789abcdef-token"


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


