"""The bare append route (`app.api.routes.hotpath.AppendRoute`) against FastAPI's own route.

The oracle is the FastAPI route of the same path, which `turnlog serve` no longer
reaches for POSTs: the same requests, sent to an app with the bare route and to
one without it (each on a fresh database), get byte-identical answers — status,
content type, length and body — for created turns, repeats, conflicts, both
wires, and every kind of refusal.
"""

from __future__ import annotations

import json
import re

import httpx
import msgspec

from app.api.routes.hotpath import AppendRoute
from app.main import create_app
from app.settings import Settings
from app.store.engine import migrate
from tests.factory import open_body, r3_b64, turn
from tests.wire import MSGPACK, NARROW, to_msgpack, to_narrow_msgpack, with_bin

L, K = 2, 2
TIMESTAMP = re.compile(rb'"\d{4}-\d\d-\d\dT[\d:.]+Z"')
# PostgreSQL makes positions from transaction ids: two databases give the same
# events different numbers, in the same order.
POSITION = re.compile(rb'"position":(\d+)')


def bad_width(body: dict) -> bytes:
    """`body` on the narrowed wire with a width byte of 3."""
    out = with_bin(body)
    out["record"]["response"]["choices"][0]["meta_info"]["routed_experts"] = b"\x03" * 25
    return msgspec.msgpack.encode(out)


def requests(sid: str) -> list[tuple[str, str, bytes | None, dict[str, str]]]:
    json_h = {"content-type": "application/json"}
    path = f"/v1/sessions/{sid}/turns"
    first = turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K), start=0, event_id="e0")
    second = turn([1, 2, 3, 4, 5, 6], [7], r3=r3_b64(2, L, K, seed=1), start=4, event_id="e1")
    return [
        ("POST", "/v1/sessions", json.dumps(open_body(
            sid, pause_generation_mode="in_place", r3={"num_layers": L})).encode(), json_h),
        ("POST", path, json.dumps(first).encode(), json_h),
        ("POST", path, json.dumps(first).encode(), json_h),                      # repeat
        ("POST", path, to_msgpack(with_bin(first)), {"content-type": MSGPACK}),  # cross-wire
        ("POST", path, json.dumps({**first, "metadata": {"x": 1}}).encode(), json_h),  # 409
        ("POST", path, to_msgpack(with_bin(second)), {"content-type": MSGPACK}),
        ("POST", path, to_narrow_msgpack(second), {"content-type": NARROW}),      # repeat
        ("POST", path, bad_width(second), {"content-type": NARROW}),              # 422 width
        ("POST", path, b"\xc1", {"content-type": MSGPACK}),                       # 422
        ("POST", path, b"{", json_h),                                              # 422
        ("POST", path, b"", json_h),                                               # {} → 422
        ("POST", path, b"", {}),
        ("POST", path, b"{}", {"content-type": "application/msgpack; charset=x"}),
        ("POST", path, b"{}", {"content-type": "text/plain"}),                    # 415
        ("POST", f"/v1/sessions/{sid}-none/turns", json.dumps(first).encode(), json_h),
        ("POST", "/v1/sessions/bad%20id/turns", json.dumps(first).encode(), json_h),
        ("POST", path + "/", json.dumps(first).encode(), json_h),
        ("GET", path, None, {}),                                                   # 405
        ("POST", f"/v1/sessions/{sid}/close", b"{}", json_h),
        ("POST", path, json.dumps(turn([1, 2, 3, 4, 5, 6, 7], [8], event_id="e2")).encode(),
         json_h),                                                                  # closed
    ]


async def answers(url: str, bare: bool) -> list[tuple[int, str | None, str | None, bytes]]:
    app = create_app(Settings.load(database_url=url, migrate_on_start=False, api_tokens=""))
    routes = app.router.routes
    assert isinstance(routes[0], AppendRoute)
    if not bare:
        del routes[0]
    out = []
    ranks: dict[bytes, int] = {}

    def rank(match: re.Match[bytes]) -> bytes:
        return b'"position":<%d>' % ranks.setdefault(match.group(1), len(ranks))

    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://localhost") as http:
            for method, path, content, headers in requests("s-bare"):
                r = await http.request(method, path, content=content, headers=headers)
                length = r.headers.get("content-length")
                assert length is None or int(length) == len(r.content)
                # The two runs differ only in when they ran.
                content = POSITION.sub(rank, TIMESTAMP.sub(b'"<time>"', r.content))
                out.append((r.status_code, r.headers.get("content-type"),
                            None if length is None else "<length>", content))
    finally:
        await app.state.services.db.dispose()
    return out


async def test_the_bare_route_answers_as_the_fastapi_route(fresh_database, backend):
    bare_url, reference_url = fresh_database(backend), fresh_database(backend)
    for url in (bare_url, reference_url):
        await migrate.upgrade_async(url)
    bare = await answers(bare_url, True)
    reference = await answers(reference_url, False)
    assert [a[0] for a in bare][:6] == [201, 201, 200, 200, 409, 201]
    assert bare == reference


async def test_served_apps_route_appends_to_the_bare_route(settings):
    app = create_app(settings)
    try:
        first = app.router.routes[0]
        assert isinstance(first, AppendRoute)
        assert first.path == "/v1/sessions/{session_id}/turns"  # the metrics label
    finally:
        await app.state.services.db.dispose()

