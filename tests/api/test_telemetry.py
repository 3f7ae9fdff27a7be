"""`GET /metrics` (Prometheus text) and the structured log line of every append."""

import asyncio

import httpx
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from app.main import create_app
from app.metrics import RebuildProgress
from app.store.engine.db import Database
from app.store.ops.rebuild import rebuild
from tests.factory import open_body, r3_b64, turn

TURNS = "/v1/sessions/{session_id}/turns"


async def scrape(client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def addition_session_with_turns(client, sid):
    r = await client.post("/v1/sessions", json=open_body(
        sid, pause_generation_mode="in_place", r3={"num_layers": 2}))
    assert r.status_code == 201
    first = turn([1, 2, 3], [4, 5], r3=r3_b64(4, 2, 2), start=0)
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=first)).status_code == 201
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=first)).status_code == 200
    second = turn([1, 2, 3, 4, 5, 6], [7], r3=r3_b64(2, 2, 2, seed=1), start=4)
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=second)).status_code == 201
    return first, second


async def test_metrics_count_appends_and_r3_bytes(client, sid):
    await addition_session_with_turns(client, sid)
    samples = await scrape(client)
    assert value(samples, "turnlog_turns_appended_total", result="created") == 2
    assert value(samples, "turnlog_turns_appended_total", result="repeat") == 1
    # 6 rows x 2 layers x top-2 expert ids below 128, narrowed to one byte each
    assert value(samples, "turnlog_r3_stored_bytes_total") == 24


async def test_requests_are_counted_by_route_template_and_status(client, sid):
    await addition_session_with_turns(client, sid)
    await client.get(f"/v1/sessions/{sid}-missing")
    await client.get("/no/such/path")
    samples = await scrape(client)
    assert value(samples, "turnlog_http_requests_total",
                 method="POST", route=TURNS, status="201") == 2
    assert value(samples, "turnlog_http_requests_total",
                 method="POST", route=TURNS, status="200") == 1
    assert value(samples, "turnlog_http_requests_total",
                 method="GET", route="/v1/sessions/{session_id}", status="404") == 1
    assert value(samples, "turnlog_http_requests_total",
                 method="GET", route="<unmatched>", status="404") == 1
    assert value(samples, "turnlog_http_request_duration_seconds_count",
                 method="POST", route=TURNS) == 3
    assert not any(sid in dict(labels).get("route", "") for _, labels in samples)


async def test_rejected_appends_are_counted_by_problem(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    await client.post(f"/v1/sessions/{sid}/turns", content=b"{not json")
    await client.post(f"/v1/sessions/{sid}/turns", json=turn([], [1]))
    samples = await scrape(client)
    assert value(samples, "turnlog_turns_rejected_total", problem="invalid-request") == 2


async def test_fence_lag_is_zero_on_sqlite_and_the_oldest_transaction_on_postgres(
        client, settings, backend):
    if backend == "sqlite":
        samples = await scrape(client)
        assert value(samples, "turnlog_feed_fence_lag_seconds") == 0.0
        return
    db = Database(settings.store.database_url, settings)
    try:
        async with db.write() as conn:
            await conn.execute(sa.text("SELECT pg_current_xact_id()"))  # takes a transaction id
            await asyncio.sleep(0.3)
            samples = await scrape(client)
        assert value(samples, "turnlog_feed_fence_lag_seconds") >= 0.3
    finally:
        await db.dispose()


async def test_each_app_has_its_own_registry(settings, sid):
    apps = [create_app(settings), create_app(settings)]
    try:
        clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://localhost")
                   for a in apps]
        await clients[0].post("/v1/sessions", json=open_body(sid))
        first, second = await scrape(clients[0]), await scrape(clients[1])
        opened = {"method": "POST", "route": "/v1/sessions", "status": "201"}
        assert value(first, "turnlog_http_requests_total", **opened) == 1
        assert value(second, "turnlog_http_requests_total", **opened) == 0
    finally:
        for a in apps:
            await a.state.services.db.dispose()


async def test_each_append_logs_one_line_with_session_and_event_id(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    body = turn([1, 2], [3], event_id="e-1")
    with capture_logs() as logs:
        await client.post(f"/v1/sessions/{sid}/turns", json=body)
        await client.post(f"/v1/sessions/{sid}/turns", json=body)
    lines = [e for e in logs if e["event"] == "turn appended"]
    assert [(e["session_id"], e["event_id"], e["seq"], e["result"], e["log_level"])
            for e in lines] == [(sid, "e-1", 0, "created", "info"),
                                (sid, "e-1", 0, "repeat", "info")]
    assert all(e["r3_bytes"] == 0 and e["duration_ms"] >= 0 for e in lines)


async def test_a_rejected_append_logs_a_warning_with_the_problem_type(client, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    with capture_logs() as logs:
        r = await client.post(f"/v1/sessions/{sid}/turns",
                              json=turn([1, 2], [3], event_id="e-2", parent=7))
    assert r.status_code == 404
    (line,) = [e for e in logs if e["event"] == "turn rejected"]
    assert line["log_level"] == "warning"
    assert (line["session_id"], line["event_id"]) == (sid, "e-2")
    assert line["problem"] == "urn:turnlog:unknown-parent" and line["status"] == 404


async def test_rebuild_progress_gauges(client, settings, sid):
    await client.post("/v1/sessions", json=open_body(sid))
    progress = RebuildProgress()
    db = Database(settings.store.database_url, settings)
    try:
        await rebuild(db, sid, progress)
    finally:
        await db.dispose()
    assert progress.registry.get_sample_value("turnlog_rebuild_sessions_done") == 1
    assert progress.registry.get_sample_value("turnlog_rebuild_sessions_total") == 1


async def test_metrics_answer_when_the_database_does_not(tmp_path):
    from app.settings import Settings

    url = f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/x.db"
    app = create_app(Settings.load(database_url=url, migrate_on_start=False, api_tokens=""))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://localhost") as http:
            samples = await scrape(http)
        lag = value(samples, "turnlog_feed_fence_lag_seconds")
        assert lag != lag  # NaN: unknown, not a reassuring 0
    finally:
        await app.state.services.db.dispose()
