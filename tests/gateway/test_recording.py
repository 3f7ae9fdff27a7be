"""What the gateway records, on the three backends: a real `turnlog gateway` in front of
the simulator's SGLang, the store read back through the API.

Oracles: the bytes the fake SGLang answers the same request with directly
(it is deterministic), the JSON that went up, and `app.sim.simulator.route` (a full
forward) for the R3 rows.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from typing import Any

import httpx
import numpy as np
import pytest

from app.gateway.proxy import PARSE_ASIDE_BYTES
from app.sim.simulator import route
from tests.gateway.conftest import Sent, chat, metric, scrape, send_turn, wait_for


def sid() -> str:
    return f"gw-{uuid.uuid4().hex[:12]}"


async def events(client: httpx.AsyncClient, session_id: str) -> list[dict[str, Any]]:
    reply = await client.get(f"/v1/sessions/{session_id}/events")
    assert reply.status_code == 200, reply.text
    return list(reply.json())


def send_turn_of(session_id: str, reply: httpx.Response) -> Sent:
    return Sent(session_id, {}, reply.status_code, reply.content)


async def test_recorded_turns_equal_the_wire(db_url, client, gateway_process, fake_sglang):
    gateway = gateway_process(db_url, "--num-layers", "2", "--label", "run=r1",
                              "--label", "team=a")
    await gateway.wait_ready()
    session = sid()
    labels = {"team": "b", "rollout_id": 7}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http, \
            httpx.AsyncClient(base_url=fake_sglang.url, timeout=30) as direct:
        sent = []
        prompt = [11, 12, 13]
        for i in range(3):
            request = chat(prompt, return_routed_experts=True)
            turn = await send_turn(http, session, request,
                                   {"X-Turnlog-Labels": json.dumps(labels)})
            assert turn.status == 200, turn.reply
            # The caller got the upstream's bytes unchanged.
            assert turn.reply == (await direct.post("/v1/chat/completions",
                                                    json=request)).content
            sent.append(turn)
            output = [t for _, t in
                      json.loads(turn.reply)["choices"][0]["meta_info"]["output_token_logprobs"]]
            prompt = prompt + output + [20 + i, 21 + i]
        metrics = await scrape(http)
    assert metric(metrics, "turnlog_gateway_recorded_total") == 3
    # Each turn's store write is timed, within the latency the gateway added to it.
    store, added = "turnlog_gateway_store_seconds", "turnlog_gateway_added_seconds"
    assert metric(metrics, f"{store}_count", 'outcome="recorded"') == 3
    assert 0 < metric(metrics, f"{store}_sum", 'outcome="recorded"') \
        < metric(metrics, f"{added}_sum")
    assert metric(metrics, f"{store}_count", 'outcome="spooled"') == 0

    summary = (await client.get(f"/v1/sessions/{session}")).json()
    assert summary["opened_by"] == "gateway"
    # --label values, the header's on top (it wins on "team").
    assert summary["labels"] == {"run": "r1", "team": "b", "rollout_id": 7}
    assert summary["r3"] == {"num_layers": 2} and summary["version"] == "v2"
    assert summary["pause_generation_mode"] == "retract"
    assert [n["parent"] for n in summary["tree"]] == [None, 0, 1]

    turns = [e for e in await events(client, session) if e["type"] == "turn_recorded"]
    assert len(turns) == 3
    for event, turn in zip(turns, sent, strict=True):
        record = event["record"]
        assert record["request"] == turn.request
        assert record["response"] == json.loads(turn.reply)
        assert (record["method"], record["path"], record["status_code"]) == (
            "POST", "/v1/chat/completions", 200)
        assert record["request_timestamp"] <= record["timestamp"]
        assert len(event["event_id"]) == 32
        # R3: the rows are a full forward over the turn's tokens.
        meta = record["response"]["choices"][0]["meta_info"]
        tokens = turn.request["input_ids"] + [t for _, t in meta["output_token_logprobs"]]
        rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
        assert np.array_equal(rows, route(np.asarray(tokens), 2, 2, 16).ravel())


async def test_every_unrecorded_reason_is_counted_and_answered(db_url, client, gateway_process):
    gateway = gateway_process(db_url)  # no --num-layers: turns asking for R3 are rejected
    await gateway.wait_ready()
    closed, plain = sid(), sid()
    opened = await client.post("/v1/sessions", json={"session_id": closed, "version": "v2"})
    assert opened.status_code == 201
    assert (await client.post(f"/v1/sessions/{closed}/close", json={})).status_code == 200
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        nobody = sid()
        bad_json = await http.post("/v1/chat/completions", content=b"{not json",
                                   headers={"X-SMG-Routing-Key": nobody})
        # Only a POST is a turn; another method to a recorded path is forwarded as it
        # is and counted: not-tito with a session, else no-session.
        got = await http.get("/v1/chat/completions", headers={"X-SMG-Routing-Key": nobody})
        got_bare = await http.get("/v1/chat/completions")
        for reply in (got, got_bare):
            assert reply.status_code == 200 and reply.json()["method"] == "GET", reply.text
        cases: list[tuple[str, int, Any]] = [
            ("no-session", 200, await send_turn(http, None, chat([1, 2]))),
            ("no-session", 200, await send_turn(http, "not a valid id!", chat([1, 2]))),
            ("not-tito", 400, send_turn_of(nobody, bad_json)),
            ("not-tito", 400, await send_turn(http, nobody, {"messages": []})),
            ("not-tito", 200, await send_turn(http, nobody, chat([]))),
            ("stream", 200, await send_turn(http, nobody, chat([1, 2], stream=True))),
            ("upstream-status", 503,
             await send_turn(http, nobody, chat([1, 2]), {"X-Sim-Status": "503"})),
            ("not-json", 200,
             await send_turn(http, nobody, chat([1, 2]), {"X-Sim-Reply": "not-json"})),
            ("not-tito", 200,
             await send_turn(http, nobody, chat([1, 2]), {"X-Sim-Reply": "no-logprobs"})),
            ("session-closed", 200, await send_turn(http, closed, chat([1, 2]))),
            ("rejected", 200,
             await send_turn(http, plain, chat([1, 2], return_routed_experts=True))),
            # JSON all the same, with a number past float range: the store refuses it.
            ("rejected", 200, send_turn_of(plain, await http.post(
                "/v1/chat/completions",
                content=json.dumps(chat([1, 2]))[:-1].encode() + b', "temperature": 1e400}',
                headers={"X-SMG-Routing-Key": plain}))),
        ]
        metrics = await scrape(http)
    for reason, status, answer in cases:
        assert answer.status == status, (reason, answer.reply)
    expected_counts = {"no-session": 3, "not-tito": 5, "stream": 1, "upstream-status": 1,
                       "not-json": 1, "session-closed": 1, "rejected": 2}
    for reason, count in expected_counts.items():
        assert metric(metrics, "turnlog_gateway_unrecorded_total", f'reason="{reason}"') == count
    assert metric(metrics, "turnlog_gateway_recorded_total") == 0
    # No session is opened for a request that is not recorded.
    assert (await client.get(f"/v1/sessions/{nobody}")).status_code == 404
    # Nor for a turn the store refuses: the rejected turn opened no session.
    assert (await client.get(f"/v1/sessions/{plain}")).status_code == 404
    # A streamed request's reply came back as the upstream's event stream.
    stream = next(answer for reason, _, answer in cases if reason == "stream")
    assert stream.reply.startswith(b"data: ") and stream.reply.endswith(b"data: [DONE]\n\n")


async def test_a_first_turn_refused_by_the_empty_tree_opens_no_session(db_url, client,
                                                                      gateway_process):
    """A first turn that passes the body's own checks but not the new session's tree
    (addition R3 that starts at row 8 of a session with no turn: an R3 gap) is answered
    and counted as rejected, and leaves no session behind; the next good turn opens it."""
    gateway = gateway_process(db_url, "--pause-generation-mode", "in_place",
                              "--num-layers", "2")
    await gateway.wait_ready()
    session = sid()
    prompt = list(range(1, 11))
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        gap = await send_turn(http, session, chat(prompt, return_routed_experts=True,
                                                  routed_experts_start_len=8))
        assert gap.status == 200, gap.reply
        metrics = await scrape(http)
        assert metric(metrics, "turnlog_gateway_unrecorded_total", 'reason="rejected"') == 1
        assert metric(metrics, "turnlog_gateway_store_seconds_count",
                      'outcome="rejected"') == 1
        assert (await client.get(f"/v1/sessions/{session}")).status_code == 404
        good = await send_turn(http, session, chat(prompt, return_routed_experts=True,
                                                   routed_experts_start_len=0))
        assert good.status == 200
        metrics = await scrape(http)
    assert metric(metrics, "turnlog_gateway_recorded_total") == 1
    assert (await client.get(f"/v1/sessions/{session}")).json()["num_nodes"] == 1


@pytest.mark.parametrize("tokens", [50, 20_000], ids=["small", "parsed-aside"])
async def test_a_request_is_classified_alike_whatever_its_size(db_url, client, gateway_process,
                                                              tokens):
    """A request body of `PARSE_ASIDE_BYTES` or more is parsed on a worker thread while
    the upstream generates; the decisions and the stored turn are the same as inline."""
    gateway = gateway_process(db_url)
    await gateway.wait_ready()
    prompt = [int(t) for t in np.random.default_rng(tokens).integers(0, 150_000, tokens)]
    assert (len(json.dumps(chat(prompt))) >= PARSE_ASIDE_BYTES) == (tokens > 50)
    good, out_of_range, booleans = sid(), sid(), sid()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        recorded = await send_turn(http, good, chat(prompt))
        rejected = await send_turn(http, out_of_range, chat([*prompt[:-1], 2**31]))
        not_tito = await send_turn(http, booleans, chat([*prompt[:-1], True]))
        streamed = await send_turn(http, good, chat(prompt, stream=True))
        metrics = await scrape(http)
    assert [t.status for t in (recorded, rejected, not_tito, streamed)] == [200] * 4
    assert metric(metrics, "turnlog_gateway_recorded_total") == 1
    for reason in ("rejected", "not-tito", "stream"):
        assert metric(metrics, "turnlog_gateway_unrecorded_total", f'reason="{reason}"') == 1
    assert streamed.reply.startswith(b"data: ")
    turns = [e for e in await events(client, good) if e["type"] == "turn_recorded"]
    assert [t["record"]["request"] for t in turns] == [recorded.request]
    assert (await client.get(f"/v1/sessions/{out_of_range}")).status_code == 404
    assert (await client.get(f"/v1/sessions/{booleans}")).status_code == 404


async def test_a_session_opened_beforehand_is_used_as_is(db_url, client, gateway_process):
    gateway = gateway_process(db_url, "--num-layers", "2", "--label", "run=gw",
                              "--version", "v1")
    await gateway.wait_ready()
    session = sid()
    body = {"session_id": session, "version": "v2", "pause_generation_mode": "in_place",
            "r3": {"num_layers": 2}, "labels": {"run": "mine"}}
    assert (await client.post("/v1/sessions", json=body)).status_code == 201
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        turn = await send_turn(http, session, chat([5, 6, 7], return_routed_experts=True,
                                                   routed_experts_start_len=0),
                               {"X-Turnlog-Labels": '{"run": "header"}'})
    assert turn.status == 200
    summary = (await client.get(f"/v1/sessions/{session}")).json()
    assert summary["labels"] == {"run": "mine"} and summary["opened_by"] is None
    assert summary["version"] == "v2" and summary["num_nodes"] == 1
    assert summary["pause_generation_mode"] == "in_place"


async def test_a_malformed_label_header_is_ignored(db_url, client, gateway_process):
    gateway = gateway_process(db_url, "--label", "run=flag")
    await gateway.wait_ready()
    session = sid()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        for header in ("{not json", '["a"]', '{"nested": {"a": 1}}'):
            turn = await send_turn(http, session, chat([1, 2, 3]),
                                   {"X-Turnlog-Labels": header})
            assert turn.status == 200
    summary = (await client.get(f"/v1/sessions/{session}")).json()
    assert summary["labels"] == {"run": "flag"} and summary["num_nodes"] == 3


async def test_a_routing_header_sent_twice_records_under_the_last(db_url, client,
                                                                  gateway_process):
    # miles' session server sends `{**agent_headers, "X-SMG-Routing-Key": sid}`: an agent
    # that set the header itself puts two on the wire, miles' last.
    gateway = gateway_process(db_url)
    await gateway.wait_ready()
    session, agents = sid(), sid()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        turn = await send_turn(http, session, chat([1, 2, 3]), {"x-smg-routing-key": agents})
    assert turn.status == 200
    assert (await client.get(f"/v1/sessions/{session}")).json()["num_nodes"] == 1
    assert (await client.get(f"/v1/sessions/{agents}")).status_code == 404


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
async def test_a_compressed_reply_is_recorded_and_passed_on_compressed(
        db_url, client, gateway_process, fake_sglang, coding):
    gateway = gateway_process(db_url)
    await gateway.wait_ready()
    session = sid()
    request = chat([1, 2, 3])
    headers = {"X-Sim-Encoding": coding, "Accept-Encoding": coding}
    raw: list[bytes] = []
    for url, extra in ((gateway.url, {"X-SMG-Routing-Key": session}), (fake_sglang.url, {})):
        async with httpx.AsyncClient(base_url=url, timeout=30) as http, \
                http.stream("POST", "/v1/chat/completions", json=request,
                            headers={**headers, **extra}) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-encoding"] == coding
            raw.append(b"".join([chunk async for chunk in reply.aiter_raw()]))
    # The caller gets the upstream's compressed bytes; the store gets the JSON in them.
    via, straight = raw
    assert via == straight
    decoded = httpx.Response(200, headers={"content-encoding": coding}, content=straight).read()
    assert decoded != straight  # compressed, not identity
    (turn,) = [e for e in await events(client, session) if e["type"] == "turn_recorded"]
    assert turn["record"]["response"] == json.loads(decoded)


async def test_idle_close_closes_auto_opened_sessions_only(db_url, client, gateway_process):
    gateway = gateway_process(db_url, "--idle-close-seconds", "0.5")
    await gateway.wait_ready()
    auto, mine = sid(), sid()
    assert (await client.post("/v1/sessions",
                              json={"session_id": mine, "version": "v2"})).status_code == 201
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        for session in (auto, mine):
            assert (await send_turn(http, session, chat([1, 2, 3]))).status == 200

        async def closed() -> bool:
            return bool((await client.get(f"/v1/sessions/{auto}")).json()["status"] == "closed")

        await wait_for(closed, what="the idle close")
        close = [e for e in await events(client, auto) if e["type"] == "session_closed"]
        assert close[0]["close"]["metadata"] == {"closed_by": "gateway-idle"}
        # A later turn for it is answered, and counted as session-closed.
        assert (await send_turn(http, auto, chat([1, 2, 3, 4]))).status == 200
        metrics = await scrape(http)
    assert metric(metrics, "turnlog_gateway_unrecorded_total", 'reason="session-closed"') == 1
    assert (await client.get(f"/v1/sessions/{mine}")).json()["status"] == "open"


async def test_a_restarted_gateway_idle_closes_what_a_gateway_opened(db_url, client,
                                                                    gateway_process):
    # `labelled` only has a label of that name: its open body names no opener.
    left, mine, labelled = sid(), sid(), sid()
    for session, extra in ((left, {"opened_by": "gateway"}), (mine, {}),
                           (labelled, {"labels": {"opened_by": "gateway"}})):
        reply = await client.post("/v1/sessions",
                                  json={"session_id": session, "version": "v2", **extra})
        assert reply.status_code == 201
    gateway = gateway_process(db_url, "--idle-close-seconds", "0.5")
    await gateway.wait_ready()

    async def closed() -> bool:
        return bool((await client.get(f"/v1/sessions/{left}")).json()["status"] == "closed")

    await wait_for(closed, what="the idle close of a session a gateway opened before")
    assert (await client.get(f"/v1/sessions/{mine}")).json()["status"] == "open"
    assert (await client.get(f"/v1/sessions/{labelled}")).json()["status"] == "open"


async def _conversation(http: httpx.AsyncClient, session: str, turns: int, pause: float,
                        headers: dict[str, str] | None = None) -> None:
    """`turns` turns of one growing conversation, `pause` seconds apart; each recorded."""
    prompt = [1, 2, 3]
    for i in range(turns):
        turn = await send_turn(http, session, chat(prompt), headers)
        assert turn.status == 200, turn.reply
        output = [t for _, t in
                  json.loads(turn.reply)["choices"][0]["meta_info"]["output_token_logprobs"]]
        prompt = prompt + output + [40 + i]
        await asyncio.sleep(pause)


async def test_idle_close_leaves_a_session_another_gateway_is_recording(
        db_url, client, gateway_process):
    """One gateway per node on one store: a gateway with an idle close does not close a
    session whose turns go through another gateway (its own memory has no turn of it
    since it started; the store's last event decides)."""
    session = sid()
    recording = gateway_process(db_url)
    await recording.wait_ready()
    async with httpx.AsyncClient(base_url=recording.url, timeout=30) as http:
        # Turns 0.2 s apart for ~5 s, never 1.5 s idle in the store, while the other
        # gateway starts (taking the session in, as a gateway opened it) and watches.
        talking = asyncio.create_task(_conversation(http, session, 20, 0.2))
        closing = gateway_process(db_url, "--idle-close-seconds", "1.5")
        await closing.wait_ready()
        await talking
        assert (await client.get(f"/v1/sessions/{session}")).json()["status"] == "open"
        metrics = await scrape(http)
    assert metric(metrics, "turnlog_gateway_unrecorded_total", 'reason="session-closed"') == 0
    turns = [e for e in await events(client, session) if e["type"] == "turn_recorded"]
    assert len(turns) == 20

    async def closed() -> bool:
        return bool((await client.get(f"/v1/sessions/{session}")).json()["status"] == "closed")

    # Once no turn comes, the other gateway's idle close does close it.
    await wait_for(closed, what="the idle close once the turns stopped")
    close = [e for e in await events(client, session) if e["type"] == "session_closed"]
    assert close[0]["close"]["metadata"] == {"closed_by": "gateway-idle"}


async def test_idle_close_waits_for_a_turn_on_its_way(db_url, client, gateway_process):
    """A generation longer than the idle time: the session stays open while its turn is
    upstream, and the turn is recorded; the session is closed after it, once idle."""
    gateway = gateway_process(db_url, "--idle-close-seconds", "0.5")
    await gateway.wait_ready()
    session = sid()
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        await _conversation(http, session, 1, 0)
        # Turn 2 takes 2 s upstream: four idle periods without a recorded turn.
        first = (await events(client, session))[-1]["record"]["response"]
        output = [t for _, t in first["choices"][0]["meta_info"]["output_token_logprobs"]]
        turn = await send_turn(http, session, chat([1, 2, 3, *output, 9]),
                               {"X-Sim-Delay": "2"})
        assert turn.status == 200, turn.reply
        metrics = await scrape(http)
    assert metric(metrics, "turnlog_gateway_unrecorded_total", 'reason="session-closed"') == 0
    assert metric(metrics, "turnlog_gateway_recorded_total") == 2

    async def closed() -> bool:
        return bool((await client.get(f"/v1/sessions/{session}")).json()["status"] == "closed")

    await wait_for(closed, what="the idle close after the slow turn")
    kinds = [e["type"] for e in await events(client, session)]
    assert kinds == ["session_opened", "turn_recorded", "turn_recorded", "session_closed"]
