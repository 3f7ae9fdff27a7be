"""R3 retention (`POST /v1/retention/r3`, `turnlog retention r3`) on every backend.

The oracle for "nothing else changed" is the session as read before pruning:
tree, /state, events without R3, samples without the `pruned` mark.
"""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine

from app.domain.log.events import without_r3
from app.store.engine.db import Database
from app.store.fold.loader import StateCache
from app.store.ops.rebuild import rebuild
from app.store.ops.retention import Retention
from tests.api.test_consumers import claim, group, problem
from tests.factory import open_body, r3_b64, turn
from tests.store.test_feed import tail_cursor
from tests.test_import_export import run_cli

LAYERS, TOPK = 4, 2


def iso(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def later() -> str:
    return iso(dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))


async def r3_session(client, labels, rows=6, r3=True) -> str:
    sid = f"s-{uuid.uuid4().hex}"
    body = open_body(sid, labels=labels, pause_generation_mode="in_place",
                     **({"r3": {"num_layers": LAYERS}} if r3 else {}))
    assert (await client.post("/v1/sessions", json=body)).status_code == 201
    first = turn([1, 2, 3], [4, 5], start=0,
                 r3=r3_b64(4, LAYERS, TOPK, seed=1) if r3 else None)
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=first)).status_code == 201
    prompt = [1, 2, 3, 4, 5, 6]
    second = turn(prompt, list(range(7, 7 + rows - 1)), start=4,
                  r3=r3_b64(len(prompt) + rows - 1 - 1 - 4, LAYERS, TOPK, seed=2)
                  if r3 else None)
    assert (await client.post(f"/v1/sessions/{sid}/turns", json=second)).status_code == 201
    assert (await client.post(f"/v1/sessions/{sid}/close", json={})).status_code == 200
    return sid


async def acked(client, labels, count=1, r3=True) -> tuple[str, list[str]]:
    sids = [await r3_session(client, labels, r3=r3) for _ in range(count)]
    name = await group(client, labels)
    c = (await claim(client, name, limit=100)).json()
    assert sorted(c["sessions"]) == sorted(sids)
    r = await client.post(f"/v1/consumers/{name}/claims/{c['claim_id']}/ack", json={"step": 1})
    assert r.status_code == 200
    return name, sids


async def snapshot(client, sid):
    return {
        "tree": (await client.get(f"/v1/sessions/{sid}")).json()["tree"],
        "state": (await client.get(f"/v1/sessions/{sid}/state")).json(),
        "events": (await client.get(f"/v1/sessions/{sid}/events",
                                    params={"include_r3": "false"})).json(),
        "samples": (await client.get(f"/v1/sessions/{sid}/samples")).json(),
    }


async def prune(client, name, before=None, dry_run=False):
    r = await client.post("/v1/retention/r3", json={
        "consumer": name, "acked_before": before or later(), "dry_run": dry_run})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body.pop("acked_before").endswith("Z"), body  # the instant used, in UTC
    return body


async def test_pruning_frees_r3_and_nothing_else(client, sid):
    labels = {"run_id": sid}
    name, (pruned_sid,) = await acked(client, labels)
    kept_sid = await r3_session(client, labels)  # closed after the ack: not acknowledged
    before = await snapshot(client, pruned_sid)
    npy = await client.get(f"/v1/sessions/{pruned_sid}/samples/0/r3")
    assert npy.status_code == 200
    stored = (4 + 6) * LAYERS * TOPK  # narrowed to uint8: one byte per value

    assert await prune(client, name, dry_run=True) == {"sessions": 1, "bytes": stored}
    assert (await client.get(f"/v1/sessions/{pruned_sid}/samples/0/r3")).content \
        == npy.content  # a dry run changes nothing
    cursor = await tail_cursor(client)

    assert await prune(client, name) == {"sessions": 1, "bytes": stored}
    assert await prune(client, name) == {"sessions": 0, "bytes": 0}  # already freed

    problem(await client.get(f"/v1/sessions/{pruned_sid}/samples/0/r3"), 410, "r3-pruned")
    problem(await client.get(f"/v1/sessions/{pruned_sid}/samples/0/r3",
                             params={"rows": "0:2", "layers": "1:2"}), 410, "r3-pruned")
    problem(await client.get(f"/v1/sessions/{pruned_sid}/samples",
                             params={"format": "safetensors"}), 410, "r3-pruned")
    after = await snapshot(client, pruned_sid)
    assert after["tree"] == before["tree"]
    assert after["state"] == before["state"]
    samples = after["samples"]
    assert [s["r3"] for s in samples["samples"]] == [
        {**s["r3"], "pruned": True} for s in before["samples"]["samples"]]
    for s in samples["samples"]:
        s["r3"].pop("pruned")
    assert samples == before["samples"]

    events = (await client.get(f"/v1/sessions/{pruned_sid}/events")).json()
    assert events[-1]["type"] == "r3_pruned" and events[-1]["bytes"] == stored
    turns = [e for e in events if e["type"] == "turn_recorded"]
    assert all(e["r3_pruned"] is True for e in turns)
    for e in turns:
        e.pop("r3_pruned")
    assert [e for e in events if e["type"] != "r3_pruned"] == before["events"]
    assert all(e["record"] == without_r3(e["record"]) for e in turns)

    feed = (await client.get("/v1/events", params={"after": cursor})).json()["events"]
    assert [(e["session_id"], e["type"]) for e in feed] == [(pruned_sid, "r3_pruned")]

    # The session the group never acknowledged keeps its R3.
    assert (await client.get(f"/v1/sessions/{kept_sid}/samples/0/r3")).status_code == 200
    kept_events = (await client.get(f"/v1/sessions/{kept_sid}/events")).json()
    assert all("r3_pruned" not in e for e in kept_events)

    metrics = (await client.get("/metrics")).text
    assert f"turnlog_r3_pruned_bytes_total {float(stored)}" in metrics


async def test_a_pruned_session_still_opens_in_the_ui(client, sid):
    name, (pruned,) = await acked(client, {"run_id": sid})
    await prune(client, name)
    page = await client.get(f"/ui/sessions/{pruned}")
    assert page.status_code == 200, page.text
    assert page.text.count('data-testid="tree-node"') == 2
    assert page.text.count('data-testid="sample-row"') == 1
    for seq in (0, 1):
        lanes = await client.get(f"/ui/sessions/{pruned}/nodes/{seq}")
        assert lanes.status_code == 200, lanes.text
    picture = await client.get(f"/ui/sessions/{pruned}/samples/0/r3.svg")
    assert picture.status_code == 200
    assert picture.headers["content-type"].startswith("image/svg+xml")


async def test_only_acks_strictly_before_the_time_count(client, sid):
    name, (only,) = await acked(client, {"run_id": sid})
    assert await prune(client, name, before="2000-01-01T00:00:00") == {"sessions": 0,
                                                                       "bytes": 0}
    assert (await client.get(f"/v1/sessions/{only}/samples/0/r3")).status_code == 200


async def test_times_at_the_edges_of_the_calendar(client, sid):
    """The last representable instant is a time like any other (it rounded into the year
    10000 through a float: a 500 after the prune committed); an instant past 9999 or
    before year 1 once in UTC is a 422 naming acked_before, with nothing freed."""
    name, (kept,) = await acked(client, {"run_id": sid})
    for edge in ("9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59"):
        r = await client.post("/v1/retention/r3", json={"consumer": name,
                                                        "acked_before": edge})
        assert r.status_code == 422 and r.json()["field"] == "acked_before", r.text
        assert (await client.get(f"/v1/sessions/{kept}/samples/0/r3")).status_code == 200
    last = "9999-12-31T23:59:59.999999Z"
    r = await client.post("/v1/retention/r3", json={"consumer": name, "acked_before": last})
    assert r.status_code == 200 and r.json()["acked_before"] == last, r.text
    assert r.json()["sessions"] == 1
    assert (await client.get(f"/v1/sessions/{kept}/samples/0/r3")).status_code == 410


async def test_sessions_without_r3_count_zero_and_get_no_event(client, sid):
    name, (plain,) = await acked(client, {"run_id": sid}, r3=False)
    assert await prune(client, name) == {"sessions": 0, "bytes": 0}
    events = (await client.get(f"/v1/sessions/{plain}/events")).json()
    assert "r3_pruned" not in [e["type"] for e in events]
    problem(await client.get(f"/v1/sessions/{plain}/samples/0/r3"), 404, "unknown-sample")


async def test_bad_requests(client):
    r = await client.post("/v1/retention/r3", json={"consumer": "nope-" + uuid.uuid4().hex[:8],
                                                    "acked_before": later()})
    problem(r, 404, "unknown-consumer")
    for body, field in (({"consumer": "g", "acked_before": "yesterday"}, "acked_before"),
                        ({"consumer": "g"}, "acked_before"),
                        ({"consumer": "g", "acked_before": later(), "dry_run": "no"},
                         "dry_run"),
                        ({"consumer": "g", "acked_before": later(), "x": 1}, "x")):
        assert problem(await client.post("/v1/retention/r3", json=body), 422,
                       "invalid-request")["field"] == field


async def test_rebuild_after_pruning_reproduces_every_projection(client, settings, sid):
    name, sids = await acked(client, {"run_id": sid}, count=2)
    await prune(client, name)
    db = Database(settings.store.database_url, settings)
    try:
        for session_id in sids:
            report = await rebuild(db, session_id)
            assert report.equal, report.mismatched
    finally:
        await db.dispose()
    assert (await client.get(f"/v1/sessions/{sids[0]}/state")).status_code == 200


@pytest.mark.parametrize("statement", [
    "UPDATE r3_patches SET data = :b WHERE session_id = :s",
    "UPDATE r3_patches SET start_row = start_row + 1 WHERE session_id = :s",
    "DELETE FROM r3_patches WHERE session_id = :s",
    "UPDATE events SET payload = '{}' WHERE session_id = :s",
])
async def test_immutability_holds_for_everything_else(client, db_url, backend, sid, statement):
    """After pruning (and with the prune permission set on PostgreSQL), nothing but
    emptying `data` passes the triggers; before pruning not even that does."""
    name, (pruned,) = await acked(client, {"run_id": sid})
    await prune(client, name)
    fresh = await r3_session(client, {"run_id": sid + "-other"})
    engine = create_async_engine(db_url)
    try:
        for target in (pruned, fresh):
            with pytest.raises(DBAPIError, match="immutable"):
                async with engine.begin() as conn:
                    if backend != "sqlite":
                        if backend == "citus":
                            await conn.execute(sa.text(
                                "SET LOCAL citus.propagate_set_commands = 'local'"))
                        await conn.execute(sa.text("SET LOCAL turnlog.r3_prune = 'on'"))
                    await conn.execute(sa.text(statement), {"s": target, "b": b"x"})
        # Emptying an unpruned session's R3 needs the permission (PG) or the mark (SQLite).
        with pytest.raises(DBAPIError, match="immutable"):
            async with engine.begin() as conn:
                await conn.execute(sa.text(
                    "UPDATE r3_patches SET data = :b WHERE session_id = :s"),
                    {"s": fresh, "b": b""})
    finally:
        await engine.dispose()
    assert (await client.get(f"/v1/sessions/{fresh}/samples/0/r3")).status_code == 200


async def test_postgres_space_is_reused_after_vacuum(client, settings, backend, sid):
    """Freed R3 lives in dead TOAST tuples; after VACUUM new patches reuse their pages,
    so storing as much R3 again barely grows the table."""
    if backend == "sqlite":
        pytest.skip("PostgreSQL storage (SQLite reuses its free pages by itself)")
    size_sql = ("SELECT citus_total_relation_size('r3_patches')" if backend == "citus"
                else "SELECT pg_total_relation_size('r3_patches')")
    db = Database(settings.store.database_url, settings)

    async def size() -> int:
        async with db.read() as conn:
            return int((await conn.execute(sa.text(size_sql))).scalar_one())

    async def big_sessions(tag: str) -> list[str]:
        out = []
        for i in range(4):
            s = f"{sid}-{tag}{i}"
            await client.post("/v1/sessions", json=open_body(
                s, labels={"run_id": sid + tag}, pause_generation_mode="in_place",
                r3={"num_layers": 16}))
            r = await client.post(f"/v1/sessions/{s}/turns", json=turn(
                list(range(1, 4001)), [1], start=0, r3=r3_b64(4000, 16, 8, seed=i)))
            assert r.status_code == 201
            await client.post(f"/v1/sessions/{s}/close", json={})
            out.append(s)
        return out

    try:
        await big_sessions("a")
        name = await group(client, {"run_id": sid + "a"})
        c = (await claim(client, name, limit=10)).json()
        await client.post(f"/v1/consumers/{name}/claims/{c['claim_id']}/ack", json={})
        first = await size()
        freed = await prune(client, name)
        assert freed["sessions"] == 4 and freed["bytes"] == 4 * 4000 * 16 * 8
        await Retention(db, StateCache(0)).vacuum()
        await big_sessions("b")
        grown = await size() - first
    finally:
        await db.dispose()
    # Without reuse the second batch would add about the bytes freed (2 MiB).
    assert grown < freed["bytes"] // 4, (first, grown)


async def test_cli_dry_run_then_free(client, db_url, sid):
    name, (only,) = await acked(client, {"run_id": sid})
    code, report, output = await run_cli("retention", "r3", "--consumer", name,
                                         "--acked-before", later(), "--dry-run",
                                         "--database-url", db_url, "--json")
    assert code == 0, output
    assert report["sessions"] == 1 and report["dry_run"] is True
    # The instant used, as POST /v1/retention/r3 names it: a time without a zone is UTC.
    assert report["acked_before"].endswith("Z"), report
    code, report, output = await run_cli("retention", "r3", "--consumer", name,
                                         "--acked-before", "2100-01-01T00:00:00", "--dry-run",
                                         "--database-url", db_url, "--json")
    assert code == 0 and report["acked_before"] == "2100-01-01T00:00:00Z", output
    assert (await client.get(f"/v1/sessions/{only}/samples/0/r3")).status_code == 200
    code, _, output = await run_cli("retention", "r3", "--consumer", name,
                                    "--acked-before", later(), "--database-url", db_url)
    assert code == 0, output
    assert "freed" in output and "1 session" in output
    assert f"{name!r} acknowledged before " in " ".join(output.split())
    problem(await client.get(f"/v1/sessions/{only}/samples/0/r3"), 410, "r3-pruned")
    code, _, output = await run_cli("retention", "r3", "--consumer", "no-such-group",
                                    "--acked-before", later(), "--database-url", db_url)
    assert code == 2 and "no consumer group" in output


@pytest.mark.parametrize("accept", ["application/json", "application/msgpack"])
async def test_an_events_page_racing_retention_reads_as_pruned(settings, accept, monkeypatch):
    # Issue 21: the page read the session row, then retention emptied the patches,
    # then the page read them (READ COMMITTED on PostgreSQL): 500, or a body cut
    # after a 200. The race is forced by freeing the R3 between the two reads.
    import httpx
    import msgspec

    from app.main import create_app
    from app.store.read import reader as reads

    app = create_app(settings)
    svc = app.state.services
    real_load_patches = reads.load_patches
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://turnlog") as http:
        sid = await r3_session(http, {"run_id": uuid.uuid4().hex})

        async def load_after_retention(conn, session_id, seqs):
            assert await svc.retention.prune_session(session_id, dry_run=False) > 0
            return await real_load_patches(conn, session_id, seqs)

        monkeypatch.setattr(reads, "load_patches", load_after_retention)
        r = await http.get(f"/v1/sessions/{sid}/events", headers={"accept": accept})
        monkeypatch.setattr(reads, "load_patches", real_load_patches)
        assert r.status_code == 200, r.text
        page = (msgspec.msgpack.decode(r.content) if accept.endswith("msgpack") else r.json())
        turns = [e for e in page if e["type"] == "turn_recorded"]
        assert len(turns) == 2
        # Either the snapshot predates retention (SQLite: one snapshot per read) and
        # every R3 is there, or the page is a pruned one: never half of each.
        after = (await http.get(f"/v1/sessions/{sid}/events")).json()
        if all(e.get("r3_pruned") for e in turns):
            assert all(e["record"] == without_r3(e["record"]) for e in turns)
            assert [e for e in after if e["type"] == "turn_recorded"] == turns
        else:
            assert not any("r3_pruned" in e for e in turns)
            assert all(e["record"] != without_r3(e["record"]) for e in turns)
    await svc.db.dispose()


async def test_retention_keeps_what_another_matching_group_has_not_acknowledged(client):
    # Issue 21: retention by one group freed R3 that another group matching the same
    # sessions had not acknowledged; that group then claimed sessions answering 410.
    labels = {"run_id": uuid.uuid4().hex}
    first, (sid,) = await acked(client, labels)
    second = await group(client, labels)
    assert await prune(client, first) == {"sessions": 0, "bytes": 0,
                                          "held_by": {second: 1}}
    c = (await claim(client, second, limit=10)).json()
    assert c["sessions"] == [sid]
    r = await client.get(f"/v1/sessions/{sid}/samples/0/r3")
    assert r.status_code == 200, r.text
    # Claimed but not acknowledged still holds it.
    assert (await prune(client, first))["held_by"] == {second: 1}
    r = await client.post(f"/v1/consumers/{second}/claims/{c['claim_id']}/ack",
                          json={"step": 1})
    assert r.status_code == 200, r.text
    freed = await prune(client, first)
    assert freed["sessions"] == 1 and "held_by" not in freed
    problem(await client.get(f"/v1/sessions/{sid}/samples/0/r3"), 410, "r3-pruned")


@pytest.mark.parametrize("sent, read", [
    ("2000-01-01T00:00:00", "2000-01-01T00:00:00Z"),
    ("2000-01-01T02:00:00+02:00", "2000-01-01T00:00:00Z"),
    ("2000-01-01T00:00:00.5z", "2000-01-01T00:00:00.500000Z")])
async def test_the_reply_says_which_utc_instant_acked_before_was(client, sent, read):
    # Issue 21: a time without a zone was read as UTC silently; the reply now names it.
    name = await group(client, {"run_id": uuid.uuid4().hex})
    r = await client.post("/v1/retention/r3", json={"consumer": name, "acked_before": sent})
    assert r.status_code == 200, r.text
    assert r.json()["acked_before"] == read


async def test_replay_shows_a_freed_session_as_the_api_does(client, db_url):
    """`turnlog replay` folds the log, the `r3_pruned` event among it: its samples say
    `"pruned": true` as §2's do (it left the mark out)."""
    labels = {"run_id": uuid.uuid4().hex}
    name, (freed,) = await acked(client, labels)
    await prune(client, name)
    code, report, output = await run_cli("replay", freed, "--json", "--database-url", db_url)
    assert code == 0, output
    assert report is not None
    api = (await client.get(f"/v1/sessions/{freed}/samples",
                            params={"arrays": "false"})).json()
    assert [s["r3"] for s in report["samples"]["samples"]] == [
        s["r3"] for s in api["samples"]] and api["samples"][0]["r3"]["pruned"] is True


async def test_a_turn_repeated_after_its_r3_was_freed_is_a_repeat_not_a_500(client):
    # A helper's finding: the repeat check decoded the freed patch (ValueError, 500),
    # so a client's late retry, or a dump imported again, failed after retention.
    labels = {"run_id": uuid.uuid4().hex}
    name, (sid,) = await acked(client, labels)
    events = (await client.get(f"/v1/sessions/{sid}/events")).json()
    sent = [{"event_id": e["event_id"], "record": e["record"]} for e in events
            if e["type"] == "turn_recorded"]
    replies = [(await client.post(f"/v1/sessions/{sid}/turns", json=b)).json() for b in sent]
    assert (await prune(client, name))["sessions"] == 1
    for body, reply in zip(sent, replies, strict=True):
        r = await client.post(f"/v1/sessions/{sid}/turns", json=body)
        assert r.status_code == 200 and r.json() == reply, r.text
        # Other content under the same event_id is still a conflict (R3 aside).
        other = {**body, "record": {**body["record"], "extra": 1}}
        problem(await client.post(f"/v1/sessions/{sid}/turns", json=other), 409,
                "idempotency-conflict")
