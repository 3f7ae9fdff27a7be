"""Closes and rewards handed to the gateway (`POST /turnlog/v1/sessions/{sid}/close`,
`…/rewards`), on the three backends: carried out at once with the store's verdicts
when it can, spooled behind the session's spooled turns (202) when it cannot,
refused (4xx, nothing spooled) when the body or the store refuses.

Oracle: the store read back through its own API (events, samples), and the
store's own answers to the same bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.gateway.spool import CLOSE, REWARD, Spool
from tests.gateway.conftest import chat, drained, metric, scrape, send_turn, sqlite_lock, wait_for


def sid() -> str:
    return f"gw-{uuid.uuid4().hex[:12]}"


def close_route(session_id: str) -> str:
    return f"/turnlog/v1/sessions/{session_id}/close"


def reward_route(session_id: str) -> str:
    return f"/turnlog/v1/sessions/{session_id}/rewards"


async def kinds(client: httpx.AsyncClient, session_id: str) -> list[str]:
    reply = await client.get(f"/v1/sessions/{session_id}/events")
    assert reply.status_code == 200, reply.text
    return [event["type"] for event in reply.json()]


async def reward_of(client: httpx.AsyncClient, session_id: str) -> tuple[Any, Any]:
    """The reward and its source of the session's one sample."""
    reply = await client.get(f"/v1/sessions/{session_id}/samples?arrays=false")
    (sample,) = reply.json()["samples"]
    return sample["reward"], sample["reward_source"]


async def held(http: httpx.AsyncClient, session_id: str) -> dict[str, Any]:
    reply = await http.get(f"/turnlog/sessions/{session_id}")
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


async def test_a_close_and_rewards_through_the_gateway_get_the_stores_verdicts(
        db_url, client, gateway_process):
    gateway = gateway_process(db_url)
    await gateway.wait_ready()
    session = sid()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        assert (await send_turn(http, session, chat([1, 2, 3]))).status == 200
        close = {"metadata": {"reward": 0.5, "agent": {"steps": 1}}}
        first = await http.post(close_route(session), json=close)
        assert first.status_code == 201, first.text
        assert first.json() == {"session_id": session, "kind": "close", "outcome": "written",
                                "spooled_writes": 0}
        again = await http.post(close_route(session), json=close)
        assert (again.status_code, again.json()["outcome"]) == (200, "repeat")
        other = await http.post(close_route(session), json={"metadata": {"reward": 1.0}})
        assert other.status_code == 409, other.text
        assert other.json()["type"] == "urn:turnlog:session-closed"
        assert other.headers["content-type"] == "application/problem+json"

        reward = {"event_id": "rm-1", "reward": 0.75, "source": "rm"}
        recorded = await http.post(reward_route(session), json=reward)
        assert (recorded.status_code, recorded.json()["outcome"]) == (201, "written")
        repeat = await http.post(reward_route(session), json=reward)
        assert (repeat.status_code, repeat.json()["outcome"]) == (200, "repeat")
        conflict = await http.post(reward_route(session), json={**reward, "reward": 0.1})
        assert conflict.status_code == 409
        assert conflict.json()["type"] == "urn:turnlog:idempotency-conflict"
        assert metric(await scrape(http), "turnlog_gateway_spooled_writes") == 0
        # A timeout too short for any store is the caller's: the close is spooled (or
        # done), and the gateway stays ready. A reward with nothing of its session in
        # the spool to wait behind is not spooled (503 store-unavailable) but may be
        # recorded by the try in flight: sent again with its event id, it is one reward.
        quick = {"X-Turnlog-Timeout": "0.001"}
        for i in range(3):
            repeat = await http.post(close_route(session), json=close, headers=quick)
            assert repeat.status_code in (200, 202), repeat.text
            assert (await http.get("/turnlog/readyz")).status_code == 200
            hasty = {"event_id": f"quick-{i}", "reward": 0.75, "source": "rm"}
            answer = await http.post(reward_route(session), json=hasty, headers=quick)
            assert answer.status_code in (201, 202, 503), answer.text
            if answer.status_code == 503:
                assert answer.json()["type"] == "urn:turnlog:store-unavailable"
                again = await http.post(reward_route(session), json=hasty)
                assert again.status_code in (200, 201), again.text
            assert (await http.get("/turnlog/readyz")).status_code == 200

        await wait_for(lambda: drained(http), what="the spooled writes")
    assert await kinds(client, session) == ["session_opened", "turn_recorded",
                                            "session_closed"] + ["reward_recorded"] * 4
    assert await reward_of(client, session) == (0.75, "rm")


async def test_bad_writes_are_refused_naming_the_field_and_spool_nothing(
        db_url, client, gateway_process):
    gateway = gateway_process(db_url, env={"TURNLOG_MAX_BODY_BYTES": "100000",
                                           "TURNLOG_MAX_BODY_VALUES": "1000"})
    await gateway.wait_ready()
    session = sid()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        assert (await send_turn(http, session, chat([1, 2, 3]))).status == 200
        cases = [
            (close_route(session), {"content": b"{not json"}, 422, "invalid-request", "body"),
            (close_route(session), {"json": {"metadata": 3}}, 422, "invalid-request",
             "metadata"),
            (close_route(session), {"json": {"colour": 1}}, 422, "invalid-request", "colour"),
            (close_route(session), {"content": b"{}", "headers": {"content-type": "text/xml"}},
             415, "unsupported-media-type", "content-type"),
            (reward_route(session), {"json": {"event_id": "r", "reward": "high"}}, 422,
             "invalid-request", "reward"),
            (reward_route(session), {"json": {"reward": 1.0}}, 422, "invalid-request",
             "event_id"),
            # Rewards come after the close: the store's verdict, passed on.
            (reward_route(session), {"json": {"event_id": "r", "reward": 1.0}}, 409,
             "session-open", "session_id"),
            (close_route("gw-nobody-" + uuid.uuid4().hex[:6]), {"json": {}}, 404,
             "unknown-session", None),
            (close_route("not%20an%20id"), {"json": {}}, 404, "unknown-session",
             "session_id"),
        ]
        for path, request, status, slug, field in cases:
            reply = await http.post(path, **request)
            assert reply.status_code == status, (path, request, reply.text)
            problem = reply.json()
            assert problem["type"] == f"urn:turnlog:{slug}", problem
            if field is not None:
                assert problem["field"] == field, problem
        wrong = await http.get(close_route(session))
        assert (wrong.status_code, wrong.headers["allow"]) == (405, "POST")
        too_big = await http.post(close_route(session), content=b"{" + b" " * 200_000 + b"}")
        assert too_big.status_code == 413, too_big.text
        many = await http.post(close_route(session),  # past TURNLOG_MAX_BODY_VALUES
                               json={"metadata": {"values": [0] * 2000}})
        assert many.status_code == 413, many.text
        assert await held(http, session) == {"session_id": session, "spooled_turns": 0,
                                             "spooled_writes": 0}
    assert await kinds(client, session) == ["session_opened", "turn_recorded"]


async def test_the_close_and_reward_routes_need_a_write_token_when_the_store_has_tokens(
        db_url, client, gateway_process):
    write, read = "w" * 32, "r" * 32
    gateway = gateway_process(db_url, env={"TURNLOG_API_TOKENS": f"{write}:write,{read}:read"})
    await gateway.wait_ready()
    session = sid()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        # Recorded turns are not asked for tokens (SGLang's callers send none).
        assert (await send_turn(http, session, chat([1, 2, 3]))).status == 200
        for headers, status in (({}, 401), ({"authorization": f"Bearer {read}"}, 403),
                                ({"authorization": "Bearer " + "x" * 32}, 401)):
            reply = await http.post(close_route(session), json={}, headers=headers)
            assert reply.status_code == status, reply.text
            assert reply.headers["www-authenticate"].startswith("Bearer")
        # A token in the URL is refused even beside a good header, as the store refuses
        # it (the auth helper's finding: the gateway carried the close out).
        reply = await http.post(close_route(session) + "?access_token=" + write, json={},
                                headers={"authorization": f"Bearer {write}"})
        assert reply.status_code == 401 and reply.json()["field"] == "access_token", reply.text
        assert write not in reply.text
        reply = await http.post(close_route(session), json={},
                                headers={"authorization": f"Bearer {write}"})
        assert reply.status_code == 201, reply.text
    assert (await kinds(client, session))[-1] == "session_closed"


async def test_a_spool_left_with_a_close_and_a_reward_drains_them_in_order_once(
        db_url, client, gateway_process, tmp_path):
    """A gateway killed with closes and rewards in its spool: the next gateway over the
    spool carries them out in order, each once. A close the store committed before the
    crash (its file not yet deleted) is a repeat. A close that finds its session closed
    already by a close without a reward (the idle close) leaves its reward as a reward
    event, once however often it is repeated; one that finds it closed with a reward is
    refused and counted, and replaces nothing."""
    session, idle_closed, rewarded, committed = sid(), sid(), sid(), sid()
    async with httpx.AsyncClient(base_url=(await _direct_gateway(db_url, gateway_process)),
                                 timeout=30) as http:
        for session_id in (session, idle_closed, rewarded, committed):
            assert (await send_turn(http, session_id, chat([4, 5, 6]))).status == 200
    # Closed through the store before the spool drains.
    for session_id, close in ((idle_closed, {"closed_by": "gateway-idle"}),
                              (rewarded, {"reward": 1.0}), (committed, {"reward": 0.5})):
        reply = await client.post(f"/v1/sessions/{session_id}/close",
                                  json={"metadata": close})
        assert reply.status_code == 200, reply.text
    spool = Spool(tmp_path / "left", 1 << 20)
    late_close = {"metadata": {"reward": 0.25}}
    spool.add(session, {"metadata": {"reward": 1.0}}, None, CLOSE)
    spool.add(session, {"event_id": "rm-1", "reward": 0.5, "source": "rm"}, None, REWARD)
    spool.add(idle_closed, late_close, None, CLOSE)
    spool.add(idle_closed, late_close, None, CLOSE)  # a repeat: one reward in the end
    spool.add(rewarded, late_close, None, CLOSE)  # a second, different close: refused
    spool.add(committed, {"max_seq_len": None, "metadata": {"reward": 0.5}}, None, CLOSE)
    spool.add(session, {"event_id": "rm-1", "reward": 0.5, "source": "rm"}, None, REWARD)
    spool.close()
    gateway = gateway_process(db_url, spool=tmp_path / "left")
    await gateway.wait_ready()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        await wait_for(lambda: drained(http), what="the spool to drain")
        metrics = await scrape(http)
    assert metric(metrics, "turnlog_gateway_refused_writes_total", 'kind="close"') == 1
    assert metric(metrics, "turnlog_gateway_refused_writes_total", 'kind="reward"') == 0
    closed = ["session_opened", "turn_recorded", "session_closed"]
    assert await kinds(client, session) == [*closed, "reward_recorded"]
    assert await kinds(client, idle_closed) == [*closed, "reward_recorded"]
    assert await kinds(client, rewarded) == closed
    assert await kinds(client, committed) == closed
    events = (await client.get(f"/v1/sessions/{idle_closed}/events")).json()
    assert events[2]["close"]["metadata"] == {"closed_by": "gateway-idle"}
    assert events[3]["reward"]["reward"] == 0.25 and events[3]["reward"]["source"] is None
    assert await reward_of(client, idle_closed) == (0.25, None)
    assert await reward_of(client, rewarded) == (1.0, None)
    assert await reward_of(client, session) == (0.5, "rm")


async def test_a_reward_behind_spooled_turns_but_no_close_is_refused_at_once(
        tmp_path, gateway_process):
    """While the spool holds a session's turns and no close, a reward would meet an open
    session when its turn came: it is answered 409 `session-open` now (as the store
    answers a reward before the close), never 202 and dropped later."""
    async with one_session_on_sqlite(tmp_path, gateway_process, "--store-timeout", "1") as (
            path, http, session):
        with sqlite_lock(path):
            assert (await send_turn(http, session, chat([1, 2, 3, 4]))).status == 200
            assert (await held(http, session))["spooled_turns"] == 1
            early = await http.post(reward_route(session), json={"event_id": "e", "reward": 1})
            assert early.status_code == 409, early.text
            assert early.json()["type"] == "urn:turnlog:session-open"
            closing = await http.post(close_route(session), json={})
            assert closing.status_code == 202, closing.text
            late = await http.post(reward_route(session), json={"event_id": "e", "reward": 1})
            assert late.status_code == 202, late.text
            assert await held(http, session) == {"session_id": session, "spooled_turns": 1,
                                                 "spooled_writes": 3}

        await wait_for(lambda: drained(http), what="the spool to drain")
        assert metric(await scrape(http), "turnlog_gateway_refused_writes_total",
                      'kind="reward"') == 0


async def test_a_close_the_full_spool_refuses_is_never_written_later(tmp_path,
                                                                    gateway_process):
    """The store hangs past the store timeout and the spool has no room: the close is
    answered by its own store write once that ends (here: written when the lock goes),
    never 503 for a close that commits later."""
    async with one_session_on_sqlite(tmp_path, gateway_process, "--store-timeout", "0.5",
                                     "--spool-max-bytes", "200") as (path, http, session):
        lock = sqlite_lock(path)
        lock.__enter__()
        asyncio.get_running_loop().call_later(2.0, lock.__exit__, None, None, None)
        reply = await http.post(close_route(session), json={"metadata": {"note": "x" * 400}})
        assert (reply.status_code, reply.json()["outcome"]) == (201, "written"), reply.text


@contextlib.asynccontextmanager
async def one_session_on_sqlite(tmp_path: Path, gateway_process: Any, *flags: str,
                                ) -> AsyncIterator[tuple[Path, httpx.AsyncClient, str]]:
    """A gateway on a SQLite file (`flags` its own), a session with one recorded turn,
    and a client of the gateway: (the file, the client, the session id)."""
    path = tmp_path / "store.db"
    gateway = gateway_process(f"sqlite:///{path}", *flags)
    await gateway.wait_ready()
    session = sid()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        assert (await send_turn(http, session, chat([1, 2, 3]))).status == 200
        yield path, http, session


async def _direct_gateway(db_url: str, gateway_process: Any) -> str:
    gateway = gateway_process(db_url)
    await gateway.wait_ready()
    return str(gateway.url)


def test_a_spool_file_of_an_earlier_gateway_reads_as_a_turn(tmp_path):
    """Spool files written before closes and rewards were spooled have no `kind`."""
    old = (b'{"session_id":"s-1","body":{"event_id":"e","record":{}},'
           b'"open":{"session_id":"s-1"},"spooled_at":1.5}')
    (tmp_path / "00000000000000000000.turn").write_bytes(old)
    spool = Spool(tmp_path, 1 << 20)
    spool.add("s-1", {"metadata": {}}, None, CLOSE)
    assert [(entry.kind, entry.sequence) for entry in spool.entries] == [("turn", 0),
                                                                         ("close", 1)]
    assert spool.read(spool.entries[0]).open_body == {"session_id": "s-1"}
    assert [entry.event_id for entry in spool.entries] == ["e", None]
    assert (spool.turns, len(spool), spool.count_turns("s-1"),
            spool.count_writes("s-1")) == (1, 2, 1, 2)
    spool.remove(spool.entries[0])
    assert (spool.turns, spool.count_turns("s-1"), spool.count_writes("s-1"),
            spool.holds("s-1"), spool.holds_close("s-1")) == (0, 0, 1, True, True)
    spool.remove(spool.entries[0])
    assert not spool.holds("s-1") and not spool.holds_close("s-1")
    spool.close()


def test_a_spool_file_of_an_unknown_kind_stops_the_gateway(tmp_path):
    from app.gateway.spool import SpoolUnreadable

    (tmp_path / "00000000000000000000.turn").write_bytes(
        b'{"kind":"merge","session_id":"s-1","body":{},"open":null,"spooled_at":1.5}')
    with pytest.raises(SpoolUnreadable, match="merge"):
        Spool(tmp_path, 1 << 20)


@pytest.mark.parametrize("content", [
    b'{"kind":"turn","session_id":"s-1","body":{},"op',  # cut short
    b'{"kind":"turn","body":{},"open":null,"spooled_at":1.5}',  # no session
    b'[1, 2]',  # not a gateway's
    b'{"kind":"turn","session_id":"s-1","body":{},"open":null,"spooled_at":"x"}',
])
def test_a_damaged_spool_file_stops_the_gateway_naming_it(tmp_path, content):
    """Said as a SpoolUnreadable naming the file (the CLI's one-line error), not a
    traceback; and the spool is not left locked."""
    from app.gateway.spool import SpoolUnreadable

    path = tmp_path / "00000000000000000000.turn"
    path.write_bytes(content)
    with pytest.raises(SpoolUnreadable, match=str(path)):
        Spool(tmp_path, 1 << 20)
    path.unlink()
    Spool(tmp_path, 1 << 20).close()  # nothing holds it


@pytest.mark.parametrize("kind", [CLOSE, REWARD])
def test_a_write_past_the_spool_bound_is_refused(tmp_path, kind):
    from app.gateway.errors import SpoolFull

    spool = Spool(tmp_path, 200)
    with pytest.raises(SpoolFull):
        spool.add("s-1", {"metadata": {"text": "x" * 300}}, None, kind)
    assert len(spool) == 0 and not list(tmp_path.glob("*.turn"))
    spool.close()


async def test_a_reward_with_nothing_to_wait_behind_is_not_spooled_when_the_store_hangs(
        tmp_path, gateway_process):
    """The store is locked and the spool holds nothing of the session: a reward is not
    spooled (it could meet an open session and be dropped after a 202) but answered
    503 `store-unavailable`, and stays the client's to send again; a close is spooled,
    and a reward behind it then is too."""
    async with one_session_on_sqlite(tmp_path, gateway_process, "--store-timeout", "0.5") as (
            path, http, session):
        with sqlite_lock(path):
            alone = await http.post(reward_route(session), json={"event_id": "a", "reward": 1})
            assert alone.status_code == 503, alone.text
            assert alone.json()["type"] == "urn:turnlog:store-unavailable"
            assert (await http.post(close_route(session), json={})).status_code == 202
            behind = await http.post(reward_route(session), json={"event_id": "a", "reward": 1})
            assert behind.status_code == 202, behind.text

        await wait_for(lambda: drained(http), what="the spool to drain")
        assert metric(await scrape(http), "turnlog_gateway_refused_writes_total",
                      'kind="reward"') == 0


@pytest.mark.parametrize("metadata", [
    {"reward": 0.25},
    {"reward": 1, "agent": {"steps": [1, 2.5, "é"], "ok": True, "none": None},
     "agent_error": None},
    {"reward": -3.0e-7, "agent": {"z": {"nested": ["\u2028", 10**20]}}, "a": 0.1},
])
def test_the_miles_hook_and_the_gateway_give_a_late_close_reward_one_event_id(metadata):
    """The hook's reward for a close that met a closed session, and the gateway's for a
    spooled one, carry the same event id (the close's fingerprint): tried both ways,
    the reward is recorded once. The body goes through JSON as it does on the wire."""
    import json

    from app.domain.body.gateway import reward_of_late_close
    from app.domain.body.session import SessionClose, parse_close
    from turnlog_client.miles import late_close_event_id

    sent = json.loads(json.dumps({"max_seq_len": None, "metadata": metadata}))
    reward = reward_of_late_close(parse_close(sent), SessionClose(None, {}))
    assert reward is not None
    assert reward["event_id"] == late_close_event_id(metadata)
