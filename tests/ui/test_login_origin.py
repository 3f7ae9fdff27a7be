"""The login and logout forms' Origin check compares the scheme too (issue 21), in process."""

from __future__ import annotations

import httpx
import pytest

from app.main import create_app

TOKEN = "a-login-origin-token-0123456789"


@pytest.mark.parametrize("origin, status", [
    (None, 303), ("http://turnlog", 303),
    ("https://turnlog", 403), ("http://turnlog:80", 403), ("http://evil", 403),
    ("null", 403)])
async def test_login_accepts_only_its_own_origin(settings, origin, status):
    app = create_app(settings.replace(api_tokens=f"{TOKEN}:read"))
    headers = {"content-type": "application/x-www-form-urlencoded"}
    if origin is not None:
        headers["origin"] = origin
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://turnlog") as http:
        r = await http.post("/ui/login", content=f"token={TOKEN}&next=/ui", headers=headers)
    assert r.status_code == status, r.text[:200]
    assert ("set-cookie" in r.headers) == (status == 303)
    await app.state.services.db.dispose()


@pytest.mark.parametrize("origin, status", [
    (None, 303), ("http://turnlog", 303), ("https://turnlog", 403), ("http://evil", 403),
    ("null", 403)])
async def test_logout_accepts_only_its_own_origin(settings, origin, status):
    """Another site may not sign the user out either (it could, by posting the form)."""
    app = create_app(settings.replace(api_tokens=f"{TOKEN}:read"))
    headers = {} if origin is None else {"origin": origin}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://turnlog",
                                 cookies={"turnlog_ui_token": TOKEN}) as http:
        r = await http.post("/ui/logout", headers=headers)
    assert r.status_code == status, r.text[:200]
    assert ("set-cookie" in r.headers) == (status == 303)
    await app.state.services.db.dispose()
