"""Every relative link in the README, docs/ and the client's README reaches a file of
this checkout, and its `#anchor`, if any, a heading of that file (GitHub's heading
ids). Links are a reader's way through the docs; one that breaks strands them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "client" / "README.md",
                *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a shell block is no
    heading, a `[x](y)` in code no link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def heading_ids(page: Path) -> set[str]:
    """GitHub's ids for a page's headings: lowercased, punctuation but `-` and `_`
    dropped, spaces as `-`; a repeated id gets `-1`, `-2`, …"""
    ids: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose(page.read_text()):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        ids.add(slug if count == 0 else f"{slug}-{count}")
    return ids


def links(page: Path) -> list[str]:
    return [target for line in prose(page.read_text()) for target in LINK.findall(line)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, mailto:, …


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_a_heading(page: Path):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_checker_sees_headings_and_skips_code():
    page = ROOT / "docs" / "miles.md"
    assert "1-start-the-store-and-the-gateway" in heading_ids(page)
    assert "the-store-postgresql-for-a-fleet-the-sqlite-default-is-fine-on-one-machine" \
        not in heading_ids(page)  # a comment in a shell block
    assert "../client/README.md#turnlog_clientmilesagent" in links(page)
