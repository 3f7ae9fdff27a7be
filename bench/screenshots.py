"""Screenshots of the web UI for the docs: `python -m bench.screenshots [--out DIR]`.

Serves a throwaway SQLite store with `turnlog serve`, fills it with simulated
sessions (tests/ui/showcase.py: random trees plus a hand-built one with a retry,
a branch and a truncated turn), and photographs the pages in headless Chromium
(installed with apt-get if missing, as the UI tests do). Writes PNGs into
docs/screenshots/ by default.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import httpx

from bench.common import ROOT
from tests.ui.chromium import ARGS, ensure_chromium
from tests.ui.server import serve_ui
from tests.ui.showcase import showcase

RUN_ID = "run7"


async def photograph(base_url: str, out: Path, session_id: str) -> list[Path]:
    from playwright.async_api import async_playwright

    out.mkdir(parents=True, exist_ok=True)
    shots: list[Path] = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=str(ensure_chromium()),
                                                   args=ARGS)
        page = await browser.new_page(viewport={"width": 1360, "height": 900})
        await page.goto(f"{base_url}/ui?run_id={RUN_ID}")
        await page.wait_for_selector('[data-testid="spec-plot"]')
        shots.append(out / "sessions.png")
        await page.screenshot(path=shots[-1], full_page=True)

        await page.goto(f"{base_url}/ui/sessions/{session_id}#n3")
        await page.wait_for_selector('[data-testid="lane-output"] .tok')
        shots.append(out / "session-tree.png")
        await page.screenshot(path=shots[-1])

        samples = page.locator("section.samples")
        await samples.scroll_into_view_if_needed()
        await page.wait_for_function("() => Array.from(document.querySelectorAll('img.r3'))"
                                     ".every((img) => img.complete && img.naturalWidth > 0)")
        shots.append(out / "samples.png")
        await samples.screenshot(path=shots[-1])
        await browser.close()
    return shots


def take(out: Path) -> list[Path]:
    from app.store.engine import migrate

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite+aiosqlite:///{tmp}/screens.db"
        migrate.upgrade(url)
        with serve_ui(url, Path(tmp) / "serve.log") as server:
            server.wait_ready_sync()
            with httpx.Client(base_url=server.base_url, timeout=30) as http:
                story = showcase(http, RUN_ID)
            return asyncio.run(photograph(server.base_url, out, story.session_id))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args()
    for path in take(args.out):
        print(path)


if __name__ == "__main__":
    main()
