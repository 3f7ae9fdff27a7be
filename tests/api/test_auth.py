"""API tokens (docs/api.md §7): 401 without or with an unknown token, 403 for a read token on a
route that changes something, service routes open, and the `TURNLOG_API_TOKENS` format."""

from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import ValidationError

from app.access import TokenTable, required_scope
from app.main import create_app
from app.settings import Settings, parse_api_tokens
from tests.factory import open_body, turn

WRITE = "w-0123456789abcdef"
READ = "r-0123456789abcdef"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def guarded(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings.replace(api_tokens=f"{WRITE}:write,{READ}:read",
                                      max_body_bytes=4096))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://turnlog") as http:
        yield http
    await app.state.services.db.dispose()


def assert_problem(r: httpx.Response, status: int, slug: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["type"] == f"urn:turnlog:{slug}"
    assert body["status"] == status
    assert body["title"] and body["detail"]


async def test_missing_token_is_401_with_bearer_challenge(guarded):
    r = await guarded.get("/v1/sessions")
    assert_problem(r, 401, "unauthorized")
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.json()["actual"] == "missing"


async def test_unknown_token_is_401_invalid_token(guarded):
    r = await guarded.get("/v1/sessions", headers=bearer("x" * 20))
    assert_problem(r, 401, "unauthorized")
    assert 'error="invalid_token"' in r.headers["www-authenticate"]


@pytest.mark.parametrize("header", [f"Basic {WRITE}", WRITE, "Bearer", "Bearer  ", f"{WRITE}x"])
async def test_malformed_authorization_is_401(guarded, header):
    r = await guarded.get("/v1/sessions", headers={"Authorization": header})
    assert_problem(r, 401, "unauthorized")
    # Sent, in another form: said so, not "missing".
    assert (r.json()["field"], r.json()["actual"]) == ("Authorization", "not a Bearer token")


async def test_two_authorization_headers_are_refused_whatever_their_order(guarded):
    # A tester's finding: the first of two won (a read token, then a write token: 403;
    # the other way round: a write), so a proxy's added header decided.
    for first, second in ((READ, WRITE), (WRITE, READ), (WRITE, WRITE)):
        r = await guarded.post("/v1/sessions", json={}, headers=[
            ("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")])
        assert_problem(r, 401, "unauthorized")


async def test_scheme_is_case_insensitive(guarded):
    r = await guarded.get("/v1/sessions", headers={"Authorization": f"bearer {READ}"})
    assert r.status_code == 200, r.text


async def test_read_token_reads(guarded, sid):
    r = await guarded.post("/v1/sessions", json=open_body(sid), headers=bearer(WRITE))
    assert r.status_code == 201
    for path in ("/v1/sessions", f"/v1/sessions/{sid}", f"/v1/sessions/{sid}/events",
                 f"/v1/sessions/{sid}/state", "/v1/events",
                 "/v1/analytics/spec?group_by=model", "/v1/metrics/rollout"):
        r = await guarded.get(path, headers=bearer(READ))
        assert r.status_code == 200, (path, r.text)


async def test_read_token_on_write_route_is_403_and_stores_nothing(guarded, sid):
    r = await guarded.post("/v1/sessions", json=open_body(sid), headers=bearer(READ))
    assert_problem(r, 403, "forbidden")
    assert 'error="insufficient_scope"' in r.headers["www-authenticate"]
    r = await guarded.get(f"/v1/sessions/{sid}", headers=bearer(READ))
    assert_problem(r, 404, "unknown-session")


@pytest.mark.parametrize("path", ["/v1/sessions/s/turns", "/v1/sessions/s/close",
                                  "/v1/metric-history", "/v1/metric-history/rollout",
                                  "/v1/gates/evaluate"])
async def test_every_post_route_needs_write(guarded, path):
    r = await guarded.post(path, json={}, headers=bearer(READ))
    assert_problem(r, 403, "forbidden")


async def test_write_token_opens_appends_closes_and_reads(guarded, sid):
    auth = bearer(WRITE)
    assert (await guarded.post("/v1/sessions", json=open_body(sid), headers=auth)
            ).status_code == 201
    assert (await guarded.post(f"/v1/sessions/{sid}/turns", json=turn([1, 2], [3]),
                               headers=auth)).status_code == 201
    assert (await guarded.post(f"/v1/sessions/{sid}/close", json={}, headers=auth)
            ).status_code == 200
    assert (await guarded.get(f"/v1/sessions/{sid}/samples", headers=auth)).status_code == 200


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"])
async def test_service_routes_stay_open(guarded, path):
    assert (await guarded.get(path)).status_code == 200


async def test_routes_outside_v1_are_guarded_too(guarded):
    assert_problem(await guarded.get("/not-a-route"), 401, "unauthorized")


async def test_refused_before_the_body_is_read(guarded, sid):
    r = await guarded.post(f"/v1/sessions/{sid}/turns", content=b"x" * 10_000)
    assert_problem(r, 401, "unauthorized")


async def test_without_tokens_nothing_is_asked(client):
    assert (await client.get("/v1/sessions")).status_code == 200


def test_scope_follows_the_method():
    assert [required_scope(m) for m in ("GET", "head", "OPTIONS")] == ["read"] * 3
    assert [required_scope(m) for m in ("POST", "PUT", "PATCH", "DELETE")] == ["write"] * 4


def test_token_table_finds_each_scope():
    table = TokenTable({WRITE: "write", READ: "read"})
    assert table.scope_of(WRITE.encode()) == "write"
    assert table.scope_of(READ.encode()) == "read"
    assert table.scope_of(READ[:-1].encode()) is None
    assert not TokenTable({})


def test_token_format():
    assert parse_api_tokens("") == {}
    assert parse_api_tokens(f" {WRITE}:write , {READ}:read ,") == {WRITE: "write", READ: "read"}
    assert parse_api_tokens("abcdefghijklmnop+/_~.-==:read") == {"abcdefghijklmnop+/_~.-==": "read"}


@pytest.mark.parametrize("value", [
    f"{WRITE}", f"{WRITE}:admin", f"{WRITE}:", ":read", "short:read", f"{WRITE}:write,{WRITE}:read",
    "has space in it ok?:read", "a:b:c:d:e:f:g:h:i:read",
])
def test_bad_token_setting_fails_at_startup_without_echoing_it(value):
    with pytest.raises(ValidationError) as info:
        Settings.load(api_tokens=value)
    message = str(info.value)
    assert "TURNLOG_API_TOKENS entry" in message
    assert WRITE not in message
