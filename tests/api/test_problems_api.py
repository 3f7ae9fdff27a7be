"""Every error answers problem+json: unknown routes and methods, bodies that are not
JSON objects, framework validation of parameters, unknown sessions (docs/api.md "Errors").
"""

from __future__ import annotations

import pytest

from tests.api.helpers import assert_problem, opened


async def test_an_unknown_route_is_a_problem_json_404(client):
    assert_problem(await client.get("/v1/no-such-route"), 404)


async def test_a_wrong_method_is_a_problem_json_405_listing_every_method_served(client, sid):
    # `Allow` is every method of the path: it said `POST` for `/v1/sessions`, where
    # GET is served too (a helper's finding), and HEAD is served wherever GET is.
    for r, allow in [(await client.delete("/v1/sessions"), "GET, HEAD, POST"),
                     (await client.put(f"/v1/sessions/{sid}/turns", json={}), "POST"),
                     (await client.post("/healthz"), "GET, HEAD"),
                     (await client.delete(f"/v1/sessions/{sid}"), "GET, HEAD")]:
        assert_problem(r, 405)
        assert r.headers["allow"] == allow, r.request.url


async def test_head_is_routed_as_get(client, sid):
    await opened(client, sid)
    for path in ("/healthz", f"/v1/sessions/{sid}", "/v1/sessions?limit=1"):
        got, head = await client.get(path), await client.head(path)
        assert (head.status_code, head.headers["content-type"]) == \
            (got.status_code, got.headers["content-type"]) == (200, got.headers["content-type"])
    assert (await client.head("/v1/sessions/no-such-session")).status_code == 404


async def test_an_empty_turn_body_is_422_naming_event_id(client, sid):
    await opened(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/turns", content=b"")
    assert assert_problem(r, 422, "invalid-request")["field"] == "event_id"


@pytest.mark.parametrize("raw", [b"[]", b"null", b'"x"', b"1"])
async def test_a_close_body_that_is_not_an_object_is_422(client, sid, raw):
    await opened(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/close", content=raw)
    assert assert_problem(r, 422, "invalid-request")["field"] == "body"
    assert (await client.get(f"/v1/sessions/{sid}")).json()["status"] == "open"


async def test_malformed_json_is_422_naming_the_body(client, sid):
    await opened(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/turns", content=b'{"event_id": "e1",',
                          headers={"content-type": "application/json"})
    problem = assert_problem(r, 422, "invalid-request")
    assert problem["field"] == "body" and "expected" in problem and "actual" in problem


async def test_a_json_body_is_read_without_a_content_type_but_not_as_text_plain(client, sid):
    # No Content-Type is JSON; text/plain (what a cross-site form or fetch sends) is 415.
    body = b'{"session_id": "%s", "version": "v2"}' % sid.encode()
    r = await client.post("/v1/sessions", content=body, headers={"content-type": "text/plain"})
    assert assert_problem(r, 415, "unsupported-media-type")["field"] == "content-type"
    r = await client.post("/v1/sessions", content=body,
                          headers={"content-type": "application/json; v=1"})
    assert r.status_code == 201, r.text
    # The same open again, now without a Content-Type: read as JSON, an identical repeat.
    r = await client.post("/v1/sessions", content=body)
    assert r.status_code == 200, r.text
    other = body.replace(sid.encode(), sid.encode() + b"-2")
    r = await client.post("/v1/sessions", content=other)
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(("url", "field"), [
    ("/v1/events?limit=abc", "limit"),
    ("/v1/events?wait=soon", "wait"),
    ("/v1/metrics/rollout?strict=maybe", "strict"),
    ("/v1/sessions/{sid}/events?include_r3=maybe", "include_r3"),
    ("/v1/sessions/{sid}/events?after=-1", "after"),
    ("/v1/sessions/{sid}/samples?arrays=maybe", "arrays"),
    ("/v1/sessions/{sid}/state?leaf=abc", "leaf"),
    ("/v1/sessions/{sid}/samples/abc/r3", "index"),
])
async def test_framework_validation_errors_are_problem_json_naming_the_parameter(
        client, sid, url, field):
    await opened(client, sid)
    problem = assert_problem(await client.get(url.format(sid=sid)), 422, "invalid-request")
    assert problem["field"] == field
    assert "expected" in problem and "actual" in problem


@pytest.mark.parametrize("path", ["", "/state", "/events", "/samples", "/samples/0/r3"])
async def test_reads_of_an_unknown_session_are_404_unknown_session(client, sid, path):
    problem = assert_problem(await client.get(f"/v1/sessions/{sid}{path}"), 404,
                             "unknown-session")
    assert problem["field"] == "session_id" and problem["actual"] == sid


async def test_closing_an_unknown_session_is_404(client, sid):
    assert_problem(await client.post(f"/v1/sessions/{sid}/close", json={}), 404,
                   "unknown-session")


async def test_a_local_file_error_is_a_500_not_database_unavailable(settings, tmp_path):
    # Issue 21: every OSError read as "database unavailable" (503, retry): only one
    # raised inside the database path is; a local file error is the server's own.
    import httpx

    from app.main import create_app

    app = create_app(settings)

    @app.get("/test-local-file")
    async def local_file() -> None:
        (tmp_path / "no" / "such" / "file").read_text()

    async with httpx.AsyncClient(transport=httpx.ASGITransport(
            app=app, raise_app_exceptions=False), base_url="http://turnlog") as http:
        r = await http.get("/test-local-file")
        assert r.status_code == 500, r.text
        assert r.json()["type"] == "urn:turnlog:internal"
    await app.state.services.db.dispose()


async def test_an_unreachable_database_is_still_503(tmp_path):
    import httpx

    from app.main import create_app
    from app.settings import Settings

    missing = tmp_path / "no" / "such" / "dir" / "db.sqlite"
    app = create_app(Settings.load(database_url=f"sqlite+aiosqlite:///{missing}",
                              migrate_on_start=False, api_tokens=""))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        r = await http.get("/v1/sessions")
    assert r.status_code == 503 and r.json()["type"] == "urn:turnlog:unavailable", r.text
    await app.state.services.db.dispose()


@pytest.mark.parametrize(("message", "status"), [
    # Citus's coordinator when a worker went away at commit (a Citus helper's finding:
    # these were 500s, though the write may have landed and a retry is safe).
    ("could not commit transaction for shard 102008 on at least one active node", 503),
    ("connection to the remote node localhost:19711 failed with the following error", 503),
    # The coordinator's postmaster killed under a statement (a helper's finding: 500).
    ("postmaster was shut down, exiting", 503),
    # Rolled back whole: a write behind the store's clock (migration 0012), a deadlock.
    ("serialization_failure", 503),
    # A lock not granted in time: the store's clock moving at a new connection waited
    # for writers in flight (a review's finding: 500).
    ("lock_not_available", 503),
    # Any other internal error is a bug, not the database gone.
    ("cache lookup failed for relation 12345", 500),
])
async def test_a_citus_node_lost_is_503_unavailable_other_internal_errors_500(
        settings, message, status):
    import asyncpg
    import httpx

    from app.main import create_app

    app = create_app(settings)

    @app.get("/test-internal")
    async def internal() -> None:
        if message == "serialization_failure":
            raise asyncpg.exceptions.SerializationError("transaction id is behind the clock")
        if message == "lock_not_available":
            raise asyncpg.exceptions.LockNotAvailableError("canceling statement due to lock "
                                                           "timeout")
        raise asyncpg.exceptions.InternalServerError(message)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(
            app=app, raise_app_exceptions=False), base_url="http://turnlog") as http:
        r = await http.get("/test-internal")
    assert r.status_code == status, r.text
    if status == 503:
        assert r.json()["type"] == "urn:turnlog:unavailable" and r.headers["retry-after"]
    await app.state.services.db.dispose()


@pytest.mark.parametrize("raised", ["sqlite", "postgres"])
async def test_a_full_disk_is_503_saying_the_disk_is_full(settings, raised):
    # A helper's finding: `turnlog demo` on a full disk ended with a bare 503, whose
    # detail ("the database connection failed") sent the operator the wrong way.
    import sqlite3

    import asyncpg
    import httpx
    from sqlalchemy.exc import OperationalError

    from app.main import create_app

    app = create_app(settings)

    @app.get("/test-full")
    async def full() -> None:
        if raised == "sqlite":
            raise OperationalError("INSERT", {}, sqlite3.OperationalError(
                "database or disk is full"))
        raise asyncpg.exceptions.DiskFullError("could not extend file: No space left")

    async with httpx.AsyncClient(transport=httpx.ASGITransport(
            app=app, raise_app_exceptions=False), base_url="http://turnlog") as http:
        r = await http.get("/test-full")
    assert r.status_code == 503 and r.json()["type"] == "urn:turnlog:unavailable", r.text
    assert "disk is full" in r.json()["detail"] and r.headers["retry-after"]
    await app.state.services.db.dispose()


@pytest.mark.parametrize(("method", "hint", "not_said"), [
    ("GET", "a read changes nothing", "event_id"),
    ("POST", "claims by claim_id", "a read changes nothing"),
])
async def test_a_lost_connection_says_how_to_retry_for_what_was_asked(
        settings, method, hint, not_said):
    # A Citus helper's finding: a feed read and a claim were told "appends are
    # idempotent by event_id", which says nothing about either.
    import httpx
    from sqlalchemy.exc import OperationalError

    from app.main import create_app

    app = create_app(settings)

    @app.api_route("/test-lost", methods=["GET", "POST"])
    async def lost() -> None:
        raise OperationalError("SELECT 1", {}, ConnectionRefusedError(111, "refused"))

    async with httpx.AsyncClient(transport=httpx.ASGITransport(
            app=app, raise_app_exceptions=False), base_url="http://turnlog") as http:
        r = await http.request(method, "/test-lost")
    assert r.status_code == 503 and r.json()["type"] == "urn:turnlog:unavailable", r.text
    detail = r.json()["detail"]
    assert "connection failed" in detail and hint in detail and not_said not in detail, detail
    await app.state.services.db.dispose()


@pytest.mark.parametrize("warm", [False, True], ids=["new-connection", "pooled-connection"])
async def test_writes_behind_a_locked_sqlite_file_wait_one_busy_timeout_not_one_each(
        fresh_database, monkeypatch, warm):
    # Testers' findings: with another process holding the file's write lock, the N-th
    # write in this server's queue waited N busy timeouts (60 s each), and the 503 said
    # "the database connection failed"; then, with the queue bounded, a write that
    # reached the head late still began a full busy timeout of its own (~2 × 60 s).
    # Here the budget is 2 s, and writes arrive 0.5 s apart.
    import asyncio
    import sqlite3
    import time

    import httpx

    from app.main import create_app
    from app.settings import Settings
    from app.store.engine import db, dialect, migrate

    monkeypatch.setattr(dialect, "SQLITE_BUSY_S", 2)
    monkeypatch.setattr(db, "SQLITE_BUSY_S", 2)
    url = fresh_database("sqlite")
    await migrate.upgrade_async(url)
    app = create_app(Settings.load(database_url=url, migrate_on_start=False, api_tokens=""))
    if warm:  # the writer's connection open already (the busy wait is then at BEGIN)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://localhost") as http:
            assert (await http.post("/v1/sessions", json={
                "version": "v2", "session_id": "before"})).status_code == 201
    holder = sqlite3.connect(url.split("///", 1)[1], isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://localhost") as http:

            async def open_one(i: int) -> tuple[httpx.Response, float]:
                await asyncio.sleep(0.5 * i)
                started = time.monotonic()
                reply = await http.post("/v1/sessions", json={
                    "version": "v2", "session_id": f"locked-{i}"})
                return reply, time.monotonic() - started

            answers = await asyncio.gather(*(open_one(i) for i in range(4)))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    for reply, took in answers:
        assert reply.status_code == 503 and reply.json()["type"] == "urn:turnlog:unavailable"
        detail = reply.json()["detail"]
        assert "is locked: its busy timeout" in detail or "in this server's queue of " \
            "writers" in detail, detail
        assert took < 2.8, [round(t, 2) for _, t in answers]  # the budget, not two
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as http:
        stored = [row["session_id"] for row in (await http.get("/v1/sessions")).json()["sessions"]]
        assert stored == (["before"] if warm else [])  # nothing of the refused writes
        # The lock gone, a write gets the full busy timeout again, and goes through.
        assert (await http.post("/v1/sessions", json={"version": "v2"})).status_code == 201
    await app.state.services.db.dispose()
