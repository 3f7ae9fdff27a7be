"""The client on its own against a real turnlog server: the calls a session server
and a trainer make, rewards after the close, and the connection error a newcomer
sees first. Runs in a venv holding only the client (tests/test_client_alone.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest
from support import free_port, new_sid, turn

from turnlog_client import SyncTurnlogClient, TurnlogClient, TurnlogConnectionError, TurnlogError


def test_the_server_is_not_installed_beside_the_client() -> None:
    if os.environ.get("TURNLOG_CLIENT_ALONE") != "1":
        pytest.skip("not the client-alone venv (tests/test_client_alone.py sets it)")
    assert importlib.util.find_spec("app") is None
    for server_only in ("fastapi", "sqlalchemy", "pyarrow", "uvicorn"):
        assert importlib.util.find_spec(server_only) is None, server_only


async def test_connection_error_names_the_url_and_how_to_start_a_server() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with TurnlogClient(url, retries=1, backoff=0.01) as tl:
        with pytest.raises(TurnlogConnectionError) as caught:
            await tl.session("nobody")
    text = str(caught.value)
    assert url in text and "turnlog serve" in text, text
    assert "None" not in text and text.startswith("connection-failed: "), text
    assert caught.value.status is None and caught.value.url == url
    assert caught.value.retryable


async def test_open_append_close_samples(server_url: str) -> None:
    sid = new_sid()
    async with TurnlogClient(server_url) as tl:
        opened = await tl.open({"session_id": sid, "version": "v2", "labels": {"run_id": "c"}})
        assert opened["session_id"] == sid and opened["status"] == "open"
        first = await tl.append_body(sid, turn([1, 2, 3], [4, 5]))
        await tl.append_body(sid, turn([1, 2, 3, 4, 5, 6], [7]))
        assert first["seq"] == 0
        closed = await tl.close(sid, metadata={"reward": 0.5})
        samples = await tl.samples(sid)
    assert len(samples["samples"]) == len(closed["samples"]) == 1
    assert samples["samples"][0]["tokens"] == [1, 2, 3, 4, 5, 6, 7]


async def _closed_session(tl: TurnlogClient, leaves: list[str]) -> str:
    """A closed session with one root-to-leaf path (so one sample) per response id."""
    sid = new_sid()
    await tl.open({"session_id": sid, "version": "v2"})
    for i, response_id in enumerate(leaves):
        await tl.append_body(sid, {**turn([100 + i, 1], [2], response_id=response_id),
                                   "parent": None})
    await tl.close(sid)
    return sid


@pytest.mark.usefixtures("rewards")
async def test_record_reward_session_wide_then_per_sample(server_url: str) -> None:
    async with TurnlogClient(server_url) as tl:
        sid = await _closed_session(tl, ["leaf-a", "leaf-b"])
        event = await tl.record_reward(sid, 1.0, source="unit")
        assert event["type"] == "reward_recorded" and event["event_id"]
        assert event["reward"]["reward"] == 1.0 and event["reward"]["source"] == "unit"
        await tl.record_reward(sid, 0.25, response_id="leaf-b")
        samples = (await tl.samples(sid, arrays=False))["samples"]
    # Two leaves, two samples: leaf-b's own reward wins over the session-wide one.
    assert sorted((s["reward"], s["reward_source"]) for s in samples) == \
        [(0.25, None), (1.0, "unit")]


@pytest.mark.usefixtures("rewards")
async def test_record_reward_repeat_and_errors(server_url: str) -> None:
    async with TurnlogClient(server_url, retries=0) as tl:
        sid = await _closed_session(tl, ["x"])
        first = await tl.record_reward(sid, 2.0, event_id="e1")
        again = await tl.record_reward(sid, 2.0, event_id="e1")
        assert again["position"] == first["position"]
        with pytest.raises(TurnlogError) as conflict:
            await tl.record_reward(sid, 3.0, event_id="e1")
        assert conflict.value.status == 409 and conflict.value.event_id == "e1"
        with pytest.raises(TurnlogError) as unknown:
            await tl.record_reward(sid, 1.0, response_id="no-such-leaf")
        assert unknown.value.status == 404
        open_sid = new_sid()
        await tl.open({"session_id": open_sid, "version": "v2"})
        with pytest.raises(TurnlogError) as still_open:
            await tl.record_reward(open_sid, 1.0)
        assert still_open.value.status == 409 and still_open.value.slug == "session-open"


@pytest.mark.usefixtures("rewards")
def test_sync_client_records_rewards(server_url: str) -> None:
    with SyncTurnlogClient(server_url) as tl:
        sid = new_sid()
        tl.open({"session_id": sid, "version": "v2"})
        tl.append_body(sid, turn([1, 2], [3]))
        tl.close(sid)
        event = tl.record_reward(sid, 0.5, sample=0)
        assert event["reward"]["sample"] == 0
        assert tl.samples(sid, arrays=False)["samples"][0]["reward"] == 0.5


async def test_dot_ids_and_odd_characters_reach_their_own_session(server_url: str) -> None:
    """`.` and `..` are valid session ids: they must not be folded into the path around
    them (`/v1/sessions/..` is not `/v1/`), and an id with `?`, `#` or a space is that
    id (an unknown session), not a path with a query."""
    async with TurnlogClient(server_url) as tl:
        for sid in (".", ".."):
            await tl.open({"session_id": sid, "version": "v2"})  # a repeat on a rerun
            assert (await tl.session(sid))["session_id"] == sid
            assert (await tl.events(sid))[0]["type"] == "session_opened"
        for odd in ("no?such", "no#such", "no such", "50%"):
            with pytest.raises(TurnlogError) as caught:
                await tl.session(odd)
            assert caught.value.status == 404 and caught.value.slug == "unknown-session", odd


async def test_a_close_that_missed_its_commit_within_is_refused_not_resent(
        server_url: str) -> None:
    sid = new_sid()
    async with TurnlogClient(server_url) as tl:
        await tl.open({"session_id": sid, "version": "v2"})
        await tl.append_body(sid, turn([1, 2, 3], [4, 5]))
        with pytest.raises(TurnlogError) as caught:
            await tl.close(sid, commit_within=0.000001)  # no write can meet it
        assert caught.value.slug == "deadline-exceeded" and not caught.value.retryable
        assert (await tl.session(sid))["status"] == "open"
        closed = await tl.close(sid, commit_within=30)
        # A repeat of a close that committed is answered as one, whatever its deadline.
        assert await tl.close(sid, commit_within=0.000001) == closed
        for bad in (0, -1, float("nan"), 1e9):
            with pytest.raises(ValueError):
                await tl.close(sid, commit_within=bad)


async def test_the_sync_client_in_a_running_loop_is_warned_about() -> None:
    with pytest.warns(RuntimeWarning, match="use TurnlogClient"):
        tl = SyncTurnlogClient("http://127.0.0.1:9")
    tl.shutdown()


def test_a_shut_down_sync_client_says_so() -> None:
    tl = SyncTurnlogClient("http://127.0.0.1:9")
    tl.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        tl.session("s")


def test_the_sync_client_has_the_async_clients_methods_and_signatures() -> None:
    import inspect

    for name, method in vars(SyncTurnlogClient).items():
        if name.startswith("_") or not callable(method) or name in ("shutdown", "claim"):
            continue
        like = getattr(TurnlogClient, name)
        assert inspect.signature(method) == inspect.signature(like), name
        assert method.__doc__ == like.__doc__, name


def test_errors_cross_process_boundaries_intact() -> None:
    # A helper's finding: pickling (a ProcessPoolExecutor worker's error) failed with a
    # ValueError, so the pool broke instead of raising the documented TurnlogError.
    import copy
    import pickle

    import httpx

    from turnlog_client.errors import TurnlogConnectionError, TurnlogError

    error = TurnlogError({"type": "urn:turnlog:session-closed", "status": 409,
                          "detail": "closed", "field": "session_id"}, event_id="e1")
    for twin in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(twin) is TurnlogError and twin.problem == error.problem
        assert (twin.slug, twin.status, twin.event_id, str(twin)) == (
            "session-closed", 409, "e1", str(error))
    down = TurnlogConnectionError(httpx.ConnectError("refused"), url="http://x:1")
    twin = pickle.loads(pickle.dumps(down))
    assert type(twin) is TurnlogConnectionError and twin.url == "http://x:1"
    assert str(twin) == str(down)


async def test_paging_past_the_servers_largest_page_still_reads_everything() -> None:
    # A helper's finding: iter_sessions(page_size=5000) against 1050 sessions yielded
    # the first 1000 and stopped: the server answers at most 1000 a page, and a page
    # shorter than page_size was taken for the last.
    import httpx

    from turnlog_client import TurnlogClient

    names = [f"s{i:04d}" for i in range(1050)]
    positions = list(range(1, 100_051))

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/sessions":
            start = int(request.url.params.get("after") or 0)
            take = min(int(request.url.params["limit"]), 1000)
            page = names[start:start + take]
            return httpx.Response(200, json={
                "sessions": [{"session_id": n} for n in page], "next": str(start + len(page))})
        after = int(request.url.params.get("after") or 0)
        take = min(int(request.url.params["limit"]), 100_000)
        return httpx.Response(200, json=[{"position": p} for p in positions
                                         if p > after][:take])

    async with TurnlogClient("http://turnlog", transport=httpx.MockTransport(answer)) as tl:
        seen = [s["session_id"] async for s in tl.iter_sessions(page_size=5000)]
        events = await tl.all_events("s0001", page_size=200_000)
    assert seen == names
    assert len(events) == len(positions)


@pytest.mark.parametrize(("body", "named"), [
    ({"reward": float("nan")}, "reward is nan"),
    ({"record": {"response": {"choices": [{"meta_info": {
        "output_token_logprobs": [[-0.5, 3], [float("-inf"), 4]]}}]}}},
     "record.response.choices[0].meta_info.output_token_logprobs[1][0] is -inf"),
    ([1.0, float("inf")], "[1] is inf"),
])
def test_a_non_finite_number_is_refused_before_sending_naming_where_it_is(body, named):
    from turnlog_client.transport import encode

    with pytest.raises(ValueError, match="JSON carries no NaN or infinity") as caught:
        encode(body)
    assert str(caught.value).startswith(named)
    assert encode({"reward": 1.5, "x": [None, 2]}) == b'{"reward":1.5,"x":[null,2]}'
