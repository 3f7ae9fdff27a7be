"""`turnlog rebuild --metrics-port`: the progress gauges of the running rebuild, for Prometheus."""

import asyncio
import uuid

import prometheus_client
from typer.testing import CliRunner

from app.cli import cli
from app.settings import Settings
from app.store.append.writes import Writer
from app.store.engine.db import Database


def open_sessions(url: str, count: int) -> list[str]:
    async def go() -> list[str]:
        from app.store.fold.loader import StateCache

        db = Database(url, Settings.load(database_url=url))
        writer = Writer(db, StateCache(4), 1024)
        try:
            sids = [f"rb-{uuid.uuid4().hex}" for _ in range(count)]
            for sid in sids:
                await writer.open_session({"session_id": sid, "version": "v2"})
            return sids
        finally:
            await db.dispose()

    return asyncio.run(go())


def test_rebuild_exposes_progress_gauges(db_url, monkeypatch):
    (sid,) = open_sessions(db_url, 1)
    served = []
    monkeypatch.setattr(prometheus_client, "start_http_server",
                        lambda port, addr, registry: served.append((port, addr, registry)))
    result = CliRunner().invoke(cli, ["rebuild", "--session", sid, "--database-url", db_url,
                                      "--metrics-port", "9101"])
    assert result.exit_code == 0, result.output
    ((port, addr, registry),) = served
    assert (port, addr) == (9101, "127.0.0.1")
    assert registry.get_sample_value("turnlog_rebuild_sessions_done") == 1
    assert registry.get_sample_value("turnlog_rebuild_sessions_total") == 1


def test_rebuild_without_a_port_serves_nothing(db_url, monkeypatch):
    (sid,) = open_sessions(db_url, 1)
    monkeypatch.setattr(prometheus_client, "start_http_server",
                        lambda *a, **kw: (_ for _ in ()).throw(AssertionError("served")))
    result = CliRunner().invoke(cli, ["rebuild", "--session", sid, "--database-url", db_url])
    assert result.exit_code == 0, result.output
