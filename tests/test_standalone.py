"""The project stands alone: no file points outside the repository for its documentation.

A clone has no sibling folders, so a reference to one (or to an external
contract's section numbers) is a dead link; the project's own docs are
`docs/api.md`, `docs/architecture.md` and `docs/operations.md`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Spelled in pieces so this file does not match itself.
FORBIDDEN = ("../" + "shared", "/work/" + "shared", "CONTRACT" + ".md", "CONTRACT" + " §",
             "DESIGN" + ".md")
DOCS = ("docs/api.md", "docs/architecture.md", "docs/operations.md")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout (e.g. an unpacked sdist)")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_file_refers_outside_the_repository() -> None:
    offenders = []
    for path in tracked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        offenders += [f"{path.relative_to(ROOT)}: {needle}" for needle in FORBIDDEN
                      if needle in text]
    assert not offenders, offenders


@pytest.mark.parametrize("doc", DOCS)
def test_the_readme_links_each_document(doc: str) -> None:
    assert (ROOT / doc).is_file()
    assert f"({doc})" in (ROOT / "README.md").read_text(encoding="utf-8")
