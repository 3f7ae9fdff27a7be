"""The body limit answers 413 before anything is parsed, with or without Content-Length."""

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from app.main import create_app
from tests.factory import open_body, turn

LIMIT = 2000


@pytest.fixture
async def small(settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings.model_copy(update={"max_body_bytes": LIMIT}))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        yield http
    await app.state.services.db.dispose()


def chunked(raw: bytes, size: int = 256):
    async def stream():
        for i in range(0, len(raw), size):
            yield raw[i:i + size]
    return stream()


async def test_chunked_body_over_limit_is_413_and_stores_nothing(small, sid):
    assert (await small.post("/v1/sessions", json=open_body(sid))).status_code == 201
    raw = json.dumps(turn(list(range(1, 1000)), [1])).encode()
    assert len(raw) > LIMIT
    r = await small.post(f"/v1/sessions/{sid}/turns", content=chunked(raw),
                         headers={"content-type": "application/json"})
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in r.request.headers
    assert r.status_code == 413
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == "urn:turnlog:too-large"
    assert (await small.get(f"/v1/sessions/{sid}")).json()["num_nodes"] == 0


async def test_chunked_body_under_limit_is_read_whole(small, sid):
    assert (await small.post("/v1/sessions", json=open_body(sid))).status_code == 201
    raw = json.dumps(turn([1, 2, 3], [4])).encode()
    r = await small.post(f"/v1/sessions/{sid}/turns", content=chunked(raw, 7),
                         headers={"content-type": "application/json"})
    assert r.status_code == 201, r.text


async def test_declared_length_over_limit_is_413_without_reading(small, sid):
    r = await small.post("/v1/sessions", content=b"{" + b" " * LIMIT + b"}",
                         headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["type"] == "urn:turnlog:too-large"


@pytest.mark.parametrize("route", ["/v1/sessions", "/v1/metric-history", "/v1/gates/evaluate"])
async def test_every_body_route_is_limited(small, route):
    raw = json.dumps({"padding": "x" * LIMIT}).encode()
    r = await small.post(route, content=chunked(raw), headers={"content-type": "application/json"})
    assert r.status_code == 413
