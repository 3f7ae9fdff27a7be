"""Fixtures for the browser tests: Chromium (installed if missing), a real `turnlog serve`
per backend, and a fresh page per test that records console errors (a CSP violation
or a script error shows up there)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.ui.chromium import ARGS, ensure_chromium
from tests.ui.server import UiServer, serve_ui

READ_TOKEN = "ui-read-token-0123456789"
WRITE_TOKEN = "ui-write-token-0123456789"


@pytest.fixture(scope="session")
def chromium() -> Path:
    try:
        return ensure_chromium()
    except RuntimeError as exc:
        pytest.fail(f"the UI tests need Chromium: {exc}", pytrace=False)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def browser(chromium: Path) -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=str(chromium), args=ARGS)
        yield launched
        await launched.close()


def _serve(db_url: str, log: Path, env: dict[str, str] | None = None) -> Iterator[UiServer]:
    with serve_ui(db_url, log, env) as server:
        server.wait_ready_sync()
        yield server


@pytest.fixture(scope="session")
def ui_server(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiServer]:
    """`turnlog serve` on this backend's database, without tokens."""
    yield from _serve(db_url, tmp_path_factory.mktemp("ui") / "serve.log")


@pytest.fixture(scope="session")
def auth_server(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiServer]:
    """The same database served with API tokens configured."""
    yield from _serve(db_url, tmp_path_factory.mktemp("ui-auth") / "serve.log",
                      {"TURNLOG_API_TOKENS": f"{READ_TOKEN}:read,{WRITE_TOKEN}:write"})


@pytest.fixture
def api(ui_server: UiServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ui_server.base_url, timeout=30.0) as http:
        yield http


@pytest.fixture
def run_id() -> str:
    return f"ui-{uuid.uuid4().hex[:10]}"


class Page:
    """A playwright page plus the console errors it logged."""

    def __init__(self, page: Any, base_url: str) -> None:
        self.page = page
        self.base_url = base_url
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))

    async def goto(self, path: str) -> Any:
        return await self.page.goto(self.base_url + path)


@pytest_asyncio.fixture(loop_scope="session")
async def page(browser: Any, ui_server: UiServer) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        yield Page(await context.new_page(), ui_server.base_url)
    finally:
        await context.close()
