"""Every example in README.md and docs/ runs as written, so the docs cannot drift.

The convention (docs/development.md, "Examples in the docs run"): a fenced
block whose info string is `sh`, `bash`, `shell` or `python` is an example and
is executed; a block that needs another setup (PostgreSQL, Docker, a GPU, a
long benchmark, the suite itself) carries `<!-- not run: REASON -->` on the
line before its fence. Other blocks (`json`, `text`, `sql`, `nginx`, none)
are shown output, synopses or configuration and are not run.

Per page, the examples run in page order in one bash session (so a variable
set in one block is seen by the next, as when a reader types them in one
terminal; Python blocks run with the venv's `python`), from a scratch folder
laid out like a clone (`tests/data/`, `examples/`, `.venv` linked), with the
venv's `bin` first on PATH, against a fresh `turnlog serve` the test starts
there on the embedded SQLite default (`./turnlog.db`). `http://127.0.0.1:8000`
in an example means that server: the test substitutes its address. A block
fails the test when it exits non-zero (`set -euo pipefail`) or when its output
holds a problem+json body (`"type": "urn:turnlog:…"`), which curl does not
turn into an exit code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.serverproc import turnlog_serve

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
SHELL = frozenset({"sh", "bash", "shell"})
RUN = SHELL | {"python"}
FENCE = re.compile(r"^(```|~~~)\s*([\w+-]*)")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")
PROBLEM = re.compile(r'"type":\s*"urn:turnlog:[a-z-]+"')
DEFAULT_URL = "http://127.0.0.1:8000"
BLOCK_TIMEOUT = 600


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    skip_reason: str | None  # `<!-- not run: … -->`; None = runs

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, lang = match.group(1), match.group(2).lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        before = next((lines[j].strip() for j in range(start - 1, -1, -1)
                       if lines[j].strip()), "")
        reason = NOT_RUN.match(before)
        found.append(Block(page, start + 1, lang, "\n".join(body) + "\n",
                           None if reason is None else reason.group(1)))
    return found


def examples(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in RUN]


def test_every_not_run_marker_gives_a_reason_and_marks_an_example() -> None:
    problems = []
    for page in PAGES:
        for block in blocks(page):
            if block.skip_reason is None:
                continue
            if block.lang not in RUN:
                problems.append(f"{block.where}: marker on a {block.lang or 'plain'} block")
            elif len(block.skip_reason) < 8:
                problems.append(f"{block.where}: give the reason it is not run")
    assert not problems, problems


def test_the_parser_sees_markers_and_languages(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("x\n\n```sh\necho a\n```\n\n<!-- not run: needs PostgreSQL -->\n"
                    "```python\nprint(1)\n```\n```json\n{}\n```\n")
    found = blocks(page)
    assert [(b.lang, b.line, b.skip_reason) for b in found] == [
        ("sh", 3, None), ("python", 8, "needs PostgreSQL"), ("json", 11, None)]
    assert found[0].text == "echo a\n"


def clean_env(venv_bin: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TURNLOG_") and k != "PYTHONPATH"}
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv_bin.parent)
    return env


def scratch_clone(where: Path) -> Path:
    """A folder laid out like a clone for what the examples read, writing nowhere else."""
    (where / "tests").mkdir(parents=True)
    (where / "tests" / "data").symlink_to(ROOT / "tests" / "data")
    (where / "examples").symlink_to(ROOT / "examples")
    (where / ".venv").symlink_to(Path(sys.prefix))
    return where


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path, dict[str, str]]]:
    clone = scratch_clone(tmp_path / "clone")
    venv_bin = Path(sys.executable).parent
    env = clean_env(venv_bin)
    # No --database-url: the pages' examples use the default database, in the clone.
    with turnlog_serve(None, tmp_path / "serve.log", env=env, cwd=clone,
                       command=[venv_bin / "turnlog"], ready_path="/readyz") as proc:
        proc.wait_ready_sync()
        yield proc.base_url, clone, env


def script_of(runnable: list[Block], base: str) -> str:
    parts = ["set -euo pipefail"]
    for n, block in enumerate(runnable):
        text = block.text.replace(DEFAULT_URL, base)
        # A newline first: the previous block's output may not end with one (curl).
        parts.append(f"echo '::block {n}' >&2; echo; echo '::block {n}'")
        if block.lang == "python":
            parts.append(f"python - <<'__TURNLOG_DOC_PY__'\n{text}__TURNLOG_DOC_PY__")
        else:
            parts.append(text)
    parts.append("echo '::done'")
    return "\n".join(parts) + "\n"


def failing_block(stdout: str, runnable: list[Block]) -> Block | None:
    """The block whose output holds a problem body."""
    current = None
    for line in stdout.splitlines():
        if line.startswith("::block "):
            current = runnable[int(line.split()[1])]
        elif PROBLEM.search(line):
            return current
    return None


@pytest.mark.parametrize("page", [p for p in PAGES if any(
    b.skip_reason is None for b in examples(p))], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_examples_of_a_page_run_as_written(page: Path, server) -> None:
    base, clone, env = server
    runnable = [b for b in examples(page) if b.skip_reason is None]
    script = script_of(runnable, base)
    result = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True,
                            text=True, timeout=BLOCK_TIMEOUT, stdin=subprocess.DEVNULL,
                            check=False)
    last = [line for line in result.stderr.splitlines() if line.startswith("::block ")]
    if result.returncode != 0:
        block = runnable[int(last[-1].split()[1])] if last else None
        where = block.where if block else "?"
        pytest.fail(f"the example at {where} failed (exit {result.returncode}):\n"
                    f"{block.text if block else ''}\n--- stdout\n{result.stdout[-3000:]}"
                    f"\n--- stderr\n{result.stderr[-3000:]}")
    bad = failing_block(result.stdout, runnable)
    assert bad is None, (f"the example at {bad.where} answered a problem:\n{bad.text}\n"
                         f"--- stdout\n{result.stdout[-3000:]}")
    assert result.stdout.rstrip().endswith("::done")


def test_operations_md_covers_every_command() -> None:
    from typer.main import get_command

    from app.cli import cli

    def names(group: Any, prefix: str = "") -> Iterator[str]:
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                yield from names(command, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}"

    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    missing = [name for name in names(get_command(cli))
               if f"### `turnlog {name}`" not in text
               and f"### `turnlog {name.split()[0]}`" not in text]
    assert not missing, f"docs/operations.md has no section for: {missing}"


def test_the_readme_is_a_first_screen_with_a_complete_index() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 120, "the README is for a newcomer's first screen"
    assert "## Quickstart" in text and "make run" in text and "make test" in text
    # The glossary: each word in bold where it is defined.
    bold = " ".join(re.findall(r"\*\*(.+?)\*\*", text)).lower()
    for word in ("tito", "r3", "addition", "full", "v1", "v2", "in_place", "retract",
                 "carrier"):
        assert word in bold, word
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", text))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    # Every page of docs/ is in the index, and so are the pages other work adds.
    assert pages | {"docs/miles.md", "docs/gateway.md"} <= linked, sorted(pages - linked)
