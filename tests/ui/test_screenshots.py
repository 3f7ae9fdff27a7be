"""`python -m bench.screenshots` keeps working: it photographs every page (it serves
its own throwaway SQLite store, so it runs once, not per backend)."""

from __future__ import annotations

from pathlib import Path

from bench.screenshots import take

PNG = b"\x89PNG\r\n\x1a\n"


def test_screenshot_script_writes_pngs(chromium: Path, tmp_path: Path) -> None:
    shots = take(tmp_path)
    assert [p.name for p in shots] == ["sessions.png", "session-tree.png", "samples.png"]
    for shot in shots:
        data = shot.read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, shot.name

