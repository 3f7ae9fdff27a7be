"""Closes and rewards handed to the gateway (`POST /turnlog/v1/sessions/{sid}/close`,
`…/rewards`), on the three backends: answered as the store answers them when it
can carry them out at once, queued behind the session's spooled turns (202) when
it cannot, refused (4xx, nothing spooled) when the body or the store refuses.

Oracle: the store read back through its own API (events, samples), and the
store's own answers to the same bodies.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from app.gateway.spool import CLOSE, REWARD, Spool
from tests.gateway.conftest import chat, metric, scrape, send_turn, wait_for


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


async def test_a_close_and_rewards_through_the_gateway_answer_as_the_store(
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
    assert await kinds(client, session) == ["session_opened", "turn_recorded",
                                            "session_closed", "reward_recorded"]
    assert await reward_of(client, session) == (0.75, "rm")


async def test_bad_writes_are_refused_naming_the_field_and_spool_nothing(
        db_url, client, gateway_process):
    gateway = gateway_process(db_url, env={"TURNLOG_MAX_BODY_BYTES": "100000"})
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
        reply = await http.post(close_route(session), json={},
                                headers={"authorization": f"Bearer {write}"})
        assert reply.status_code == 201, reply.text
    assert (await kinds(client, session))[-1] == "session_closed"


async def test_a_spool_left_with_a_close_and_a_reward_drains_them_in_order_once(
        db_url, client, gateway_process, tmp_path):
    """A gateway killed with a turn, a close and a reward of a session in its spool: the
    next gateway over the spool writes them in order, each once — and a close that
    finds its session closed already (another close got there first) leaves its
    reward as a reward event instead (once, however often it is repeated)."""
    session, closed_first = sid(), sid()
    async with httpx.AsyncClient(base_url=(await _direct_gateway(db_url, gateway_process)),
                                 timeout=30) as http:
        for session_id in (session, closed_first):
            assert (await send_turn(http, session_id, chat([4, 5, 6]))).status == 200
    # The second session is closed through the store before the spool drains.
    assert (await client.post(f"/v1/sessions/{closed_first}/close",
                              json={"metadata": {"closed_by": "someone"}})).status_code == 200
    spool = Spool(tmp_path / "left", 1 << 20)
    late_close = {"metadata": {"reward": 0.25}}
    spool.add(session, {"metadata": {"reward": 1.0}}, None, CLOSE)
    spool.add(session, {"event_id": "rm-1", "reward": 0.5, "source": "rm"}, None, REWARD)
    spool.add(closed_first, late_close, None, CLOSE)
    spool.add(closed_first, late_close, None, CLOSE)  # a repeat: one reward in the end
    spool.add(session, {"event_id": "rm-1", "reward": 0.5, "source": "rm"}, None, REWARD)
    spool.close()
    gateway = gateway_process(db_url, spool=tmp_path / "left")
    await gateway.wait_ready()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        async def drained() -> bool:
            return metric(await scrape(http), "turnlog_gateway_spooled_writes") == 0

        await wait_for(drained, what="the spool to drain")
    assert await kinds(client, session) == ["session_opened", "turn_recorded", "session_closed",
                                            "reward_recorded"]
    assert await kinds(client, closed_first) == ["session_opened", "turn_recorded",
                                                 "session_closed", "reward_recorded"]
    events = (await client.get(f"/v1/sessions/{closed_first}/events")).json()
    assert events[2]["close"]["metadata"] == {"closed_by": "someone"}
    assert events[3]["reward"]["reward"] == 0.25 and events[3]["reward"]["source"] is None
    assert await reward_of(client, closed_first) == (0.25, None)
    assert await reward_of(client, session) == (0.5, "rm")


async def _direct_gateway(db_url: str, gateway_process: Any) -> str:
    gateway = gateway_process(db_url)
    await gateway.wait_ready()
    return str(gateway.url)


def test_a_spool_file_of_an_earlier_gateway_reads_as_a_turn(tmp_path):
    """Spool files written before closes and rewards were spooled have no `kind`."""
    spool = Spool(tmp_path, 1 << 20)
    spool.add("s-1", {"event_id": "e", "record": {}}, {"session_id": "s-1"})
    spool.add("s-1", {"metadata": {}}, None, CLOSE)
    spool.close()
    (first, _close) = sorted(tmp_path.glob("*.turn"))
    first.write_text(first.read_text().replace('"kind":"turn",', ""))
    assert '"kind"' not in first.read_text()
    again = Spool(tmp_path, 1 << 20)
    assert [entry.kind for entry in again.entries] == ["turn", "close"]
    assert (again.turns, len(again), again.count("s-1"), again.count_all("s-1")) == (1, 2, 1, 2)
    again.remove(again.entries[0])
    assert (again.turns, again.count("s-1"), again.count_all("s-1"), again.holds("s-1")) == (
        0, 0, 1, True)
    again.close()


@pytest.mark.parametrize("kind", [CLOSE, REWARD])
def test_a_write_past_the_spool_bound_is_refused(tmp_path, kind):
    from app.gateway.errors import SpoolFull

    spool = Spool(tmp_path, 200)
    with pytest.raises(SpoolFull):
        spool.add("s-1", {"metadata": {"text": "x" * 300}}, None, kind)
    assert len(spool) == 0 and not list(tmp_path.glob("*.turn"))
    spool.close()
