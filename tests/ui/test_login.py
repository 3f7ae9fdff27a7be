"""With API tokens configured: a UI page without a valid read token is a 401 login
form; a token from the form lives in an HttpOnly, SameSite=Strict cookie that the
UI (and only the UI, only for reading) accepts.

On SQLite only: tokens, cookies and redirects are decided before the store is
read (the pages themselves run on every backend in test_pages.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.ui.conftest import READ_TOKEN, WRITE_TOKEN
from tests.ui.server import UiServer
from tests.ui.showcase import random_session

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@pytest.fixture
def seeded(auth_server: UiServer, run_id: str) -> str:
    headers = {"Authorization": f"Bearer {WRITE_TOKEN}"}
    with httpx.Client(base_url=auth_server.base_url, headers=headers, timeout=30) as http:
        random_session(http, f"{run_id}-auth", {"run_id": run_id}, seed=1, turns=3)
    return f"{run_id}-auth"


@pytest.mark.asyncio(loop_scope="session")
async def test_token_form_sets_an_httponly_strict_cookie(browser: Any, auth_server: UiServer,
                                                         seeded: str) -> None:
    context = await browser.new_context()
    try:
        page = await context.new_page()
        target = f"{auth_server.base_url}/ui/sessions/{seeded}"
        reply = await page.goto(target)
        assert reply.status == 401
        assert await page.locator('[data-testid="login-form"]').count() == 1
        assert await page.locator('[data-testid="tree-node"]').count() == 0

        await page.fill('input[name="token"]', "not-a-token-of-this-server")
        await page.click('button[type="submit"]')
        await page.wait_for_selector('[data-testid="login-error"]')
        assert await context.cookies() == []

        await page.fill('input[name="token"]', READ_TOKEN)
        await page.click('button[type="submit"]')
        await page.wait_for_selector('[data-testid="tree-node"]')
        assert page.url == target  # back where the form was shown
        (cookie,) = await context.cookies()
        assert cookie["httpOnly"] is True
        assert cookie["sameSite"] == "Strict"
        assert cookie["path"] == "/ui"
        assert await page.evaluate("document.cookie") == ""

        await page.click('[data-testid="tree-node"][data-seq="0"] .depth')
        await page.wait_for_selector('[data-testid="lane-output"] .tok, #nv-seq:not(:empty)')
        listed = await page.goto(f"{auth_server.base_url}/ui")
        assert listed.status == 200
        assert await page.locator(f'[data-session-id="{seeded}"]').count() == 1
    finally:
        await context.close()


def test_cookie_is_read_only_and_ui_only(auth_server: UiServer, seeded: str) -> None:
    with httpx.Client(base_url=auth_server.base_url, timeout=30) as http:
        login = http.post("/ui/login", data={"token": READ_TOKEN, "next": "/ui"},
                          follow_redirects=False)
        assert login.status_code == 303 and login.headers["location"] == "/ui"
        # The header as documented (a raw reader need not fold the attribute's case).
        attributes = [a.strip() for a in login.headers["set-cookie"].split(";")]
        assert {"HttpOnly", "SameSite=Strict", "Path=/ui"} <= set(attributes)
        # The client keeps the cookie (path /ui) and sends it where it applies.
        assert http.get(f"/ui/sessions/{seeded}").status_code == 200
        http.cookies.set("turnlog_ui_token", READ_TOKEN, path="/")
        # The API itself still wants a bearer token.
        assert http.get(f"/v1/sessions/{seeded}").status_code == 401
        # A cookie never writes, even through /ui; it reads with GET and HEAD alone.
        assert http.post("/ui/rows").status_code == 401
        assert http.request("OPTIONS", "/ui").status_code == 401
        assert http.head("/ui").status_code == 200


def test_login_redirects_only_inside_the_ui(auth_server: UiServer) -> None:
    with httpx.Client(base_url=auth_server.base_url, timeout=30) as http:
        for target in ("https://evil.example/", "//evil.example/ui", "/v1/sessions",
                       # A helper's finding: followed, as they start with "/ui".
                       "/ui/../v1/sessions", "/ui/%2e%2e/v1/sessions", "/uix"):
            reply = http.post("/ui/login", data={"token": READ_TOKEN, "next": target},
                              follow_redirects=False)
            assert reply.headers["location"] == "/ui", target


def test_a_page_opened_with_the_cookie_offers_sign_out(auth_server: UiServer) -> None:
    # A helper's finding: nothing on the pages posted to /ui/logout.
    with httpx.Client(base_url=auth_server.base_url, timeout=30) as http:
        bearer = http.get("/ui", headers={"Authorization": f"Bearer {READ_TOKEN}"})
        assert 'data-testid="sign-out"' not in bearer.text  # nothing to sign out of
        http.post("/ui/login", data={"token": READ_TOKEN, "next": "/ui"})
        page = http.get("/ui")
        assert page.status_code == 200 and 'data-testid="sign-out"' in page.text
        assert 'action="/ui/logout"' in page.text
        out = http.post("/ui/logout", headers={"Origin": auth_server.base_url},
                        follow_redirects=False)
        assert out.status_code == 303 and out.headers["location"] == "/ui/login"
        assert http.get("/ui").status_code == 401


def test_bearer_token_also_opens_pages(auth_server: UiServer) -> None:
    with httpx.Client(base_url=auth_server.base_url, timeout=30) as http:
        assert http.get("/ui").status_code == 401
        assert "text/html" in http.get("/ui").headers["content-type"]
        # The form's 401 names the scheme too (the auth helper's finding).
        assert http.get("/ui").headers["www-authenticate"].startswith("Bearer")
        assert http.get("/ui", headers={"Authorization": f"Bearer {READ_TOKEN}"}
                        ).status_code == 200
        assert http.get("/ui/static/ui.css").status_code == 200
