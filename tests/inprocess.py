"""The REST API in process on a database URL: the app and an httpx client of it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from app.main import create_app
from app.settings import Settings


@contextlib.asynccontextmanager
async def served(url: str) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """The app on `url` (not migrated at start, no tokens) and a client of it; its
    connections disposed after."""
    app = create_app(Settings.load(database_url=url, migrate_on_start=False, api_tokens=""))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        try:
            yield app, http
        finally:
            await app.state.services.db.dispose()
