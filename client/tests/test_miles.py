"""The miles hooks, called as miles calls them, around a fake agent and a fake reward
function, against a real turnlog server (never a mock of the store).

miles calls `await agent(base_url=..., prompt=..., request_kwargs=..., metadata=...,
**kwargs)` with `base_url = http://<session server>/sessions/<sid>`, then
`await rm(args, sample, **kw)` per sample or `await rm(args, samples, **kw)`
batched; a `Sample` is an object with a `.metadata` dict.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import math
import sys
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import support
from support import LossyProxy, Sample, fake_http, free_port, new_sid

from turnlog_client import TurnlogClient
from turnlog_client import miles as hooks
from turnlog_client.miles import Settings, agent, reward_value, rm

SESSION_SERVER = "http://127.0.0.1:30000/sessions"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, server_url: str) -> Iterator[pytest.MonkeyPatch]:
    for name in ("TURNLOG_TOKEN", "TURNLOG_RUN_ID", "TURNLOG_MILES_LABEL_KEYS",
                 "TURNLOG_GATEWAY_URL",
                 "TURNLOG_MILES_VERSION", "TURNLOG_MILES_PAUSE_GENERATION_MODE",
                 "TURNLOG_MILES_NUM_LAYERS", "TURNLOG_MILES_MAX_TRIM_TOKENS",
                 "TURNLOG_MILES_SPECULATIVE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TURNLOG_URL", server_url)
    monkeypatch.setenv("TURNLOG_MILES_AGENT", "support.fake_agent")
    monkeypatch.setenv("TURNLOG_MILES_RM", "support:fake_rm")
    support.AGENT_CALLS.clear()
    support.RM_CALLS.clear()
    monkeypatch.setattr(hooks, "_UNREAD_DICTS_SAID", [])
    yield monkeypatch


@pytest.fixture(autouse=True)
async def no_work_left() -> AsyncIterator[None]:
    """What a test's hooks deferred (a close retried in the background) ends with it."""
    yield
    for task in list(hooks._TASKS):
        task.cancel()
    with contextlib.suppress(Exception):
        await hooks.finish(5)


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger="turnlog_client.miles")
    return caplog


async def run_agent(sid: str, metadata: dict[str, Any], **extra: Any) -> Any:
    return await agent(base_url=f"{SESSION_SERVER}/{sid}", prompt="2+2?",
                       request_kwargs={"temperature": 1.0}, metadata=metadata, **extra)


async def events_of(url: str, sid: str) -> list[dict[str, Any]]:
    async with TurnlogClient(url) as tl:
        return await tl.all_events(sid)


def close_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    (closed,) = [e for e in events if e["type"] == "session_closed"]
    return dict(closed["close"]["metadata"])


# -- the agent hook ----------------------------------------------------------------------


async def test_opens_with_labels_and_options_closes_with_the_result(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    env.setenv("TURNLOG_RUN_ID", "run-7")
    env.setenv("TURNLOG_MILES_LABEL_KEYS", "task, difficulty,nested,run_id,missing,weight")
    env.setenv("TURNLOG_MILES_VERSION", "v1")
    env.setenv("TURNLOG_MILES_PAUSE_GENERATION_MODE", "in_place")
    env.setenv("TURNLOG_MILES_NUM_LAYERS", "4")
    env.setenv("TURNLOG_MILES_MAX_TRIM_TOKENS", "1")
    env.setenv("TURNLOG_MILES_SPECULATIVE", "true")
    sid = new_sid()
    metadata = {"task": "math", "difficulty": 3, "nested": {"a": 1}, "run_id": "from-meta",
                "weight": float("inf"), "reward": 0.75, "untracked": "x"}

    returned = await run_agent(sid, metadata, extra_flag=True)

    (call,) = support.AGENT_CALLS
    assert call == {"base_url": f"{SESSION_SERVER}/{sid}", "prompt": "2+2?",
                    "request_kwargs": {"temperature": 1.0}, "metadata": metadata,
                    "extra_flag": True}
    assert returned == {"reward": 0.75, "turns": 2, "note": ("a", returned["note"][1]),
                        "turnlog_session_id": sid}
    assert math.isnan(returned["note"][1])
    async with TurnlogClient(server_url) as tl:
        summary = await tl.session(sid)
    assert summary["labels"] == {"run_id": "run-7", "task": "math", "difficulty": 3}
    assert summary["version"] == "v1" and summary["pause_generation_mode"] == "in_place"
    assert summary["r3"] == {"num_layers": 4} and summary["max_trim_tokens"] == 1
    assert summary["spec"] is True and summary["status"] == "closed"
    assert summary["num_nodes"] == 2
    assert close_of(await events_of(server_url, sid)) == {
        "reward": 0.75, "agent": {"reward": 0.75, "turns": 2, "note": ["a", None]},
        "agent_error": None}
    assert not warnings.records


async def test_defaults_without_labels(env: pytest.MonkeyPatch, server_url: str) -> None:
    sid = new_sid()
    await run_agent(sid, {"task": "math"})
    async with TurnlogClient(server_url) as tl:
        summary = await tl.session(sid)
    assert summary["labels"] == {}
    assert summary["version"] == "v2" and summary["pause_generation_mode"] == "retract"
    assert summary["r3"] is None and summary["max_trim_tokens"] == 0
    assert summary["spec"] is False


async def test_the_agents_error_is_recorded_and_re_raised(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    sid = new_sid()
    with pytest.raises(ValueError, match="the environment broke"):
        await run_agent(sid, {"behaviour": "raise"})
    assert close_of(await events_of(server_url, sid)) == {
        "reward": None, "agent": None, "agent_error": "ValueError: the environment broke"}
    assert not warnings.records


async def test_a_none_result_closes_with_nulls_and_returns_the_session_id(
        env: pytest.MonkeyPatch, server_url: str) -> None:
    sid = new_sid()
    assert await run_agent(sid, {"behaviour": "none"}) == {"turnlog_session_id": sid}
    assert close_of(await events_of(server_url, sid)) == {
        "reward": None, "agent": None, "agent_error": None}


async def miles_generate(sid: str, metadata: dict[str, Any]) -> Any:
    """miles' agentic generate around the hook (miles/rollout/generate_hub/
    agentic_tool_call.py): the agent's result, or the failure that aborts the sample."""
    result = await run_agent(sid, metadata)
    if result is None and getattr(agent, "_miles_fail_closed_result", False) is True:
        raise RuntimeError("fail-closed custom agent returned null without a trustworthy outcome")
    if result is not None and not isinstance(result, dict):
        raise TypeError("custom agent result must be an object or null")
    return result


async def test_a_fail_closed_agents_none_still_aborts_the_sample(
        env: pytest.MonkeyPatch, server_url: str) -> None:
    env.setenv("TURNLOG_MILES_AGENT", "support.fail_closed_agent")
    sid = new_sid()
    with pytest.raises(RuntimeError, match="fail-closed"):
        await miles_generate(sid, {"behaviour": "none"})
    closed = close_of(await events_of(server_url, sid))
    assert closed["reward"] is None and closed["agent"] is None
    assert closed["agent_error"].startswith("FailClosedNone: the agent returned None")
    # Its dicts go through as any agent's, with the session id.
    other = new_sid()
    assert (await miles_generate(other, {"behaviour": "dict"}))["turnlog_session_id"] == other
    # Its error is its own: recorded and raised as any agent's.
    failing = new_sid()
    with pytest.raises(ValueError, match="the environment broke"):
        await miles_generate(failing, {"behaviour": "raise"})
    assert close_of(await events_of(server_url, failing))["agent_error"] == \
        "ValueError: the environment broke"
    # Without a session id in base_url (nothing recorded), its None still aborts.
    env.setenv("TURNLOG_MILES_AGENT", "support.fail_closed_returning_agent")
    assert await agent(base_url="http://127.0.0.1:30000/", prompt="2+2?", request_kwargs={},
                       metadata={}) is None


async def test_an_agent_that_does_not_fail_closed_is_never_aborted_by_the_hooks_mark(
        env: pytest.MonkeyPatch, server_url: str) -> None:
    sid = new_sid()
    assert await miles_generate(sid, {"behaviour": "none"}) == {"turnlog_session_id": sid}
    # Without a session id in base_url (nothing recorded) a None still is no failure.
    env.setenv("TURNLOG_MILES_AGENT", "support.returning_agent")
    call = {"prompt": "2+2?", "request_kwargs": {}}
    assert await agent(base_url="http://127.0.0.1:30000/", metadata={}, **call) == {}
    assert await agent(base_url="http://127.0.0.1:30000/", metadata={"returns": {"a": 1}},
                       **call) == {"a": 1}


async def test_a_non_numeric_reward_is_closed_as_null(
        env: pytest.MonkeyPatch, server_url: str) -> None:
    sid = new_sid()
    returned = await run_agent(sid, {"reward": "good"})
    assert returned["reward"] == "good"
    assert close_of(await events_of(server_url, sid))["reward"] is None


async def test_an_integer_reward_is_closed_as_the_integer_returned(
        env: pytest.MonkeyPatch, server_url: str) -> None:
    # The store tells a reward's 1 from 1.0: the close carries the value returned.
    sid = new_sid()
    await run_agent(sid, {"reward": 1})
    closed = close_of(await events_of(server_url, sid))
    assert type(closed["reward"]) is int and closed["reward"] == 1
    assert type(closed["agent"]["reward"]) is int


@pytest.mark.usefixtures("rewards")
async def test_an_already_closed_session_gets_the_reward_as_an_event(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    sid = new_sid()
    returned = await run_agent(sid, {"behaviour": "idle-closed", "reward": 0.25})
    assert returned["turnlog_session_id"] == sid
    events = await events_of(server_url, sid)
    assert close_of(events) == {"closed_by": "gateway-idle"}  # no second close
    (reward,) = [e for e in events if e["type"] == "reward_recorded"]
    assert reward["reward"]["reward"] == 0.25 and reward["reward"]["sample"] is None
    assert reward["reward"]["response_id"] is None
    assert reward["reward"]["source"] == "support.fake_agent"
    assert not warnings.records


async def test_turnlog_down_never_fails_the_rollout(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    env.setenv("TURNLOG_URL", down)
    sid = new_sid()
    # The fake agent's own turns go to the real server: the gateway records them.
    env.setattr(support, "fake_agent", _agent_without_turns)
    returned = await run_agent(sid, {"reward": 0.5})
    assert returned == {"reward": 0.5, "turnlog_session_id": sid}
    (warning,) = warnings.records
    assert down in warning.getMessage() and sid in warning.getMessage()
    with pytest.raises(RuntimeError, match="boom"):
        env.setattr(support, "fake_agent", _agent_that_raises)
        await run_agent(new_sid(), {})
    assert len(warnings.records) == 2  # one more rollout, one more warning


async def _agent_without_turns(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                               metadata: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    return {"reward": metadata["reward"]}


async def _agent_that_raises(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                             metadata: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    raise RuntimeError("boom")


async def test_turnlog_answering_an_error_never_fails_the_rollout(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    env.setenv("TURNLOG_MILES_VERSION", "v9")  # the open is refused (422)
    sid = new_sid()
    returned = await run_agent(sid, {"behaviour": "no-turns", "reward": 1.0})
    assert returned == {"reward": 1.0, "turns": 2, "note": returned["note"],
                        "turnlog_session_id": sid}
    (warning,) = warnings.records
    assert "open: 422" in warning.getMessage()


def test_settings_and_the_session_id() -> None:
    assert hooks.session_id_of("http://h:1/sessions/abc123/") == "abc123"
    assert hooks.session_id_of("http://h:1/abc123") == "abc123"
    # Some miles versions hand their OpenAI clients `…/sessions/<sid>/v1`.
    assert hooks.session_id_of("http://h:1/sessions/abc123/v1") == "abc123"
    with pytest.raises(ValueError, match="no session id"):
        hooks.session_id_of("http://h:1/")
    settings = Settings.from_env({"TURNLOG_MILES_LABEL_KEYS": " a,,b ",
                                  "TURNLOG_MILES_NUM_LAYERS": "48"})
    assert settings.label_keys == ("a", "b") and settings.num_layers == 48
    assert settings.url == hooks.DEFAULT_URL and settings.token is None
    # A typo in the launcher's environment must not fail a rollout: ignored, with a warning.
    assert Settings.from_env({"TURNLOG_MILES_NUM_LAYERS": "many"}).num_layers is None
    # The store's values are lower case: an upper-case one means the same.
    loud = Settings.from_env({"TURNLOG_MILES_VERSION": "V1",
                              "TURNLOG_MILES_PAUSE_GENERATION_MODE": "IN_PLACE"})
    assert (loud.version, loud.pause_generation_mode) == ("v1", "in_place")


@pytest.mark.parametrize(("value", "on", "warned"), [
    ("1", True, False), ("Yes", True, False), ("y", True, False), ("on", True, False),
    ("0", False, False), ("off", False, False), ("", False, False),
    ("enabled", False, True), ("2", False, True)])
def test_the_speculative_flag_reads_the_usual_spellings_and_warns_on_others(
        caplog: pytest.LogCaptureFixture, value: str, on: bool, warned: bool) -> None:
    caplog.set_level(logging.WARNING, logger="turnlog_client.miles")
    assert Settings.from_env({"TURNLOG_MILES_SPECULATIVE": value}).speculative is on
    assert bool(caplog.records) is warned


async def test_the_agent_hook_needs_its_agent(env: pytest.MonkeyPatch) -> None:
    env.delenv("TURNLOG_MILES_AGENT")
    with pytest.raises(RuntimeError, match="TURNLOG_MILES_AGENT"):
        await run_agent(new_sid(), {})


@pytest.mark.parametrize(("dotted", "error", "said"), [
    ("support.nosuch", AttributeError, "'support' has no 'nosuch'"),
    ("nosuchmodule.agent", ModuleNotFoundError, "cannot import 'nosuchmodule'"),
    ("support:fake_agent.nosuch", AttributeError, "has no 'fake_agent.nosuch'"),
])
async def test_a_typo_in_the_agent_variable_names_the_variable(
        env: pytest.MonkeyPatch, dotted: str, error: type[Exception], said: str) -> None:
    env.setenv("TURNLOG_MILES_AGENT", dotted)
    with pytest.raises(error, match="TURNLOG_MILES_AGENT=") as raised:
        await run_agent(new_sid(), {})
    assert said in str(raised.value)


# -- the abort hook ----------------------------------------------------------------------


async def miles_abort(args: Any, agent_function_path: str) -> None:
    """miles' `call_agent_abort_hook`, as it finds the abort hook: the `abort` of the
    module of `--custom-agent-function-path` (its part before the last dot), awaited;
    nothing when that module has none."""
    module_path, _, _ = agent_function_path.rpartition(".")
    try:
        found = importlib.import_module(module_path).abort
    except (AttributeError, ModuleNotFoundError):
        return
    await found(args)


def agent_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("dotted", ["user_agents_abort.run", "user_agents_abort:run"])
async def test_miles_finds_the_users_abort_hook_through_turnlogs_agent(
        monkeypatch: pytest.MonkeyPatch, dotted: str) -> None:
    """miles looks for `abort` beside the agent function it runs, here
    `turnlog_client.miles`: the user's own, beside `TURNLOG_MILES_AGENT`, is called
    with miles' args, once, async or not."""
    calls: list[Any] = []

    async def user_abort(args: Any) -> None:
        calls.append(("async", args))

    agent_module(monkeypatch, "user_agents_abort", run=support.fake_agent, abort=user_abort)
    monkeypatch.setenv("TURNLOG_MILES_AGENT", dotted)
    args = types.SimpleNamespace(custom_agent_function_path="turnlog_client.miles.agent")
    await miles_abort(args, args.custom_agent_function_path)
    assert calls == [("async", args)]

    agent_module(monkeypatch, "user_agents_abort", run=support.fake_agent,
                 abort=lambda a: calls.append(("sync", a)))
    await miles_abort(args, args.custom_agent_function_path)
    assert calls == [("async", args), ("sync", args)]


async def test_an_abort_hook_error_reaches_miles(monkeypatch: pytest.MonkeyPatch) -> None:
    """miles logs the abort hook's failure: it is passed on, not swallowed."""
    async def user_abort(args: Any) -> None:
        raise ValueError("sandbox API down")

    agent_module(monkeypatch, "user_agents_failing_abort", run=support.fake_agent,
                 abort=user_abort)
    monkeypatch.setenv("TURNLOG_MILES_AGENT", "user_agents_failing_abort.run")
    with pytest.raises(ValueError, match="sandbox API down"):
        await hooks.abort(types.SimpleNamespace())


@pytest.mark.parametrize("agent_env", [None, "", "no_dot", "user_agents_no_abort.run",
                                       "no_such_module_for_turnlog.run",
                                       "turnlog_client.miles.agent"])
async def test_without_a_users_abort_hook_aborting_does_nothing(
        monkeypatch: pytest.MonkeyPatch, agent_env: str | None) -> None:
    agent_module(monkeypatch, "user_agents_no_abort", run=support.fake_agent)
    if agent_env is None:
        monkeypatch.delenv("TURNLOG_MILES_AGENT", raising=False)
    else:
        monkeypatch.setenv("TURNLOG_MILES_AGENT", agent_env)
    assert await hooks.abort(types.SimpleNamespace()) is None


# -- the reward hook ---------------------------------------------------------------------


async def rolled_out(metadata: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """One rollout through the agent hook: the session closed, miles' metadata back."""
    sid = new_sid()
    returned = await run_agent(sid, {"behaviour": "dict", "reward": None, **(metadata or {})})
    return sid, returned


async def rewards_of(url: str, sid: str) -> list[dict[str, Any]]:
    return [e["reward"] for e in await events_of(url, sid) if e["type"] == "reward_recorded"]


@pytest.mark.usefixtures("rewards")
async def test_single_reward_session_wide(env: pytest.MonkeyPatch, server_url: str,
                                          warnings: pytest.LogCaptureFixture) -> None:
    sid, returned = await rolled_out()
    sample = Sample(metadata={**returned, "score": 0.8})
    assert await rm("args", sample, extra=1) == 0.8
    (call,) = support.RM_CALLS
    assert call == ("args", sample, {"extra": 1})
    (recorded,) = await rewards_of(server_url, sid)
    assert recorded["reward"] == 0.8 and recorded["response_id"] is None
    assert recorded["sample"] is None and recorded["source"] == "support:fake_rm"
    async with TurnlogClient(server_url) as tl:
        samples = (await tl.samples(sid, arrays=False))["samples"]
    assert [s["reward"] for s in samples] == [0.8]
    assert not warnings.records


@pytest.mark.usefixtures("rewards")
async def test_batched_rewards_by_response_id(env: pytest.MonkeyPatch, server_url: str,
                                              warnings: pytest.LogCaptureFixture) -> None:
    (sid_a, meta_a), (sid_b, meta_b) = await rolled_out(), await rolled_out()
    batch = [
        Sample(metadata={**meta_a, "score": 0.1, "leaf": {"response_id": f"{sid_a}-r1"}}),
        Sample(metadata={**meta_b, "score": 0.9}),
        Sample(metadata={"score": 0.3}),  # not a turnlog rollout: nothing to record
        {"metadata": {**meta_b, "score": 0.4, "leaf": {"node_id": 1}}},  # a dict sample
    ]
    rewards = await rm(None, batch)
    assert rewards == [0.1, 0.9, 0.3, 0.4]
    recorded_a = await rewards_of(server_url, sid_a)
    assert [(r["reward"], r["response_id"]) for r in recorded_a] == [(0.1, f"{sid_a}-r1")]
    recorded_b = await rewards_of(server_url, sid_b)
    assert [(r["reward"], r["response_id"]) for r in recorded_b] == [(0.9, None), (0.4, None)]
    assert len({r["event_id"] for r in recorded_b}) == 2  # a fresh event_id per reward
    assert not warnings.records


@pytest.mark.usefixtures("rewards")
async def test_the_hooks_retries_reuse_the_event_id(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    sid, returned = await rolled_out()
    async with LossyProxy(server_url, lose="/rewards") as proxy:
        env.setenv("TURNLOG_URL", proxy.url)
        assert await rm(None, Sample(metadata={**returned, "score": 0.6})) == 0.6
    first, second = proxy.bodies  # the reply to the first was lost: resent once
    assert first == second
    (recorded,) = await rewards_of(server_url, sid)  # stored once
    assert recorded["reward"] == 0.6
    assert not warnings.records


@pytest.mark.usefixtures("rewards")
async def test_a_reward_for_a_turn_turnlog_does_not_have_says_where_to_look(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    # A tester's finding: every turn had been refused as invalid R3 (the layer count not
    # given), and the hook's warning said only "404 unknown-sample".
    sid, returned = await rolled_out()
    sample = Sample(metadata={**returned, "score": 0.5,
                              "leaf": {"response_id": "chatcmpl-never-recorded"}})
    assert await rm(None, sample) == 0.5
    (warning,) = warnings.records
    text = warning.getMessage()
    assert "unknown-sample" in text and "was the sample's last turn recorded?" in text
    assert "turnlog_gateway_unrecorded_total" in text and "invalid-r3" in text
    assert await rewards_of(server_url, sid) == []


async def test_the_reward_hook_with_turnlog_down(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture) -> None:
    env.setenv("TURNLOG_URL", f"http://127.0.0.1:{free_port()}")
    batch = [Sample(metadata={"turnlog_session_id": new_sid(), "score": s})
             for s in (0.1, 0.2, 0.3)]
    assert await rm(None, batch) == [0.1, 0.2, 0.3]
    (warning,) = warnings.records
    assert "did not record 3 reward(s)" in warning.getMessage()
    assert await rm(None, batch[0]) == 0.1
    assert len(warnings.records) == 2



# -- what other miles versions give and expect -------------------------------------------


@pytest.mark.usefixtures("rewards")
async def test_per_branch_rewards_the_agent_returns_are_recorded_by_response_id(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    # miles v2 gives a sample the agent's `rewards[response_id]` and then never calls the
    # reward model for it: the hook records them, or the trainer would read the close's.
    sid = new_sid()
    returned = await run_agent(sid, {"behaviour": "branch-rewards"})
    assert returned["rewards"][f"{sid}-r1"] == 0.9 and returned["turnlog_session_id"] == sid
    events = await events_of(server_url, sid)
    assert close_of(events)["reward"] == 0.5
    recorded = [e["reward"] for e in events if e["type"] == "reward_recorded"]
    assert [(r["reward"], r["response_id"], r["source"]) for r in recorded] == [
        (0.9, f"{sid}-r1", "support.fake_agent")]
    async with TurnlogClient(server_url) as tl:
        samples = (await tl.samples(sid, arrays=False))["samples"]
    assert [(s["reward"], s["reward_source"]) for s in samples] == [(0.9, "support.fake_agent")]
    (warning,) = warnings.records  # the response id no leaf has: named, the rollout goes on
    assert "no-such-leaf" in warning.getMessage()


async def test_an_agent_called_without_metadata(env: pytest.MonkeyPatch,
                                                server_url: str) -> None:
    calls: list[dict[str, Any]] = []

    async def older(base_url: str, prompt: Any, request_kwargs: dict[str, Any]) -> Any:
        calls.append({"base_url": base_url, "prompt": prompt})
        return {"reward": 1.0}

    env.setattr(support, "fake_agent", older)
    sid = new_sid()
    returned = await agent(base_url=f"{SESSION_SERVER}/{sid}", prompt="p",
                           request_kwargs={})
    assert returned == {"reward": 1.0, "turnlog_session_id": sid} and len(calls) == 1
    assert close_of(await events_of(server_url, sid))["reward"] == 1.0


async def test_an_agent_result_dataclass(env: pytest.MonkeyPatch, server_url: str) -> None:
    @dataclasses.dataclass
    class AgentResult:  # miles' generate_hub result type
        reward: float = 0.0
        status: str = "completed"
        metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
        metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    async def typed(**kwargs: Any) -> AgentResult:
        return AgentResult(reward=0.25, metrics={"turns": 3}, metadata={"task": "x"})

    env.setattr(support, "fake_agent", typed)
    sid = new_sid()
    returned = await run_agent(sid, {})
    assert isinstance(returned, AgentResult)
    assert returned.metadata == {"task": "x", "turnlog_session_id": sid}
    assert returned.reward == 0.25 and returned.metrics == {"turns": 3}
    assert close_of(await events_of(server_url, sid)) == {
        "reward": 0.25, "agent_error": None,
        "agent": {"reward": 0.25, "status": "completed", "metrics": {"turns": 3},
                  "metadata": {"task": "x"}}}


@pytest.mark.usefixtures("rewards")
async def test_dict_rewards_are_read_by_the_reward_key(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    sid, returned = await rolled_out()
    scored = {"score": 0.7, "format": 1.0}
    sample = Sample(metadata={**returned, "score": scored})
    args = types.SimpleNamespace(reward_key="score")
    assert await rm(args, sample) == scored  # miles gets its dict back unchanged
    assert not warnings.records
    no_key = types.SimpleNamespace(reward_key=None)
    assert await rm(no_key, sample) == scored  # no key: none, and said
    (recorded,) = await rewards_of(server_url, sid)
    assert recorded["reward"] == 0.7
    (warning,) = warnings.records
    assert "['format', 'score']" in warning.getMessage()
    assert "miles has no --reward-key to read it at" in warning.getMessage()
    assert await rm(no_key, [sample, sample]) == [scored, scored]
    assert len(warnings.records) == 1  # said once: miles calls the hook per sample


@pytest.mark.parametrize(("reward", "args", "said"), [
    ({"acc": 1.0}, {"reward_key": "score"}, "no entry at miles' reward keys ['score']"),
    ({"score": float("nan")}, {"reward_key": "score"}, "its entry 'score' is no finite number"),
    ({"score": None}, {"reward_key": "score", "eval_reward_key": "acc"},
     "its entry 'score' is no finite number (None)"),
])
async def test_an_unread_dict_reward_says_why(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture,
        reward: dict[str, Any], args: dict[str, Any], said: str) -> None:
    sid, returned = await rolled_out()
    sample = Sample(metadata={**returned, "score": reward})
    assert await rm(types.SimpleNamespace(**args), sample) == reward
    (warning,) = warnings.records
    assert said in warning.getMessage(), warning.getMessage()
    assert await rewards_of(server_url, sid) == []


async def test_a_reward_that_breaks_the_warning_still_goes_back(
        env: pytest.MonkeyPatch) -> None:
    class Odd(dict):  # type: ignore[type-arg]
        def __iter__(self):  # noqa: ANN204
            raise RuntimeError("no keys for you")

    odd = Odd(score="x")
    sid, returned = await rolled_out()
    sample = Sample(metadata={**returned, "score": odd})
    assert await rm(types.SimpleNamespace(reward_key="score"), sample) is odd


@pytest.mark.parametrize(("reward", "args", "read"), [
    ({"score": 0.7, "acc": 1.0}, {"reward_key": "score", "eval_reward_key": "acc"}, 0.7),
    ({"acc": 1.0}, {"reward_key": "score", "eval_reward_key": "acc"}, 1.0),  # an eval call
    ({"acc": 1.0}, {"reward_key": None, "eval_reward_key": "acc"}, 1.0),
    ({"other": 1.0}, {"reward_key": "score", "eval_reward_key": "acc"}, None),
    ({"score": 0.7}, {}, {"score": 0.7}),  # no key at all: the dict, never recorded
    (0.5, {"reward_key": "score"}, 0.5),
])
def test_a_dict_reward_is_read_as_miles_reads_it_for_training_or_evaluation(
        reward: Any, args: dict[str, Any], read: Any) -> None:
    assert reward_value(reward, types.SimpleNamespace(**args)) == read


async def test_a_result_the_id_cannot_be_added_to_goes_back_as_it_is(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    @dataclasses.dataclass
    class Picky:
        reward: float
        metadata: dict[str, Any]

        def __post_init__(self) -> None:
            if "turnlog_session_id" in self.metadata:
                raise RuntimeError("no foreign keys here")

    result = Picky(0.5, {})

    async def picky(**kwargs: Any) -> Picky:
        return result

    env.setattr(support, "fake_agent", picky)
    sid = new_sid()
    assert await run_agent(sid, {}) is result  # the rollout goes on
    assert close_of(await events_of(server_url, sid))["reward"] == 0.5
    (warning,) = warnings.records
    assert "Picky" in warning.getMessage() and sid in warning.getMessage()


# -- what an agent or the store may do to the hooks (audit) ------------------------------


def _agent_returning(value: Any) -> Any:
    async def inner(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                    metadata: dict[str, Any], **kwargs: Any) -> Any:
        return value
    return inner


async def test_a_cancelled_rollout_closes_its_session_then_stays_cancelled(
        env: pytest.MonkeyPatch, server_url: str) -> None:
    started = asyncio.Event()

    async def slow(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                   metadata: dict[str, Any], **kwargs: Any) -> Any:
        started.set()
        await asyncio.sleep(60)

    env.setattr(support, "fake_agent", slow)
    sid = new_sid()
    task = asyncio.create_task(run_agent(sid, {}))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert close_of(await events_of(server_url, sid)) == {
        "reward": None, "agent": None, "agent_error": "CancelledError: "}


@pytest.mark.parametrize("kind", ["cycle", "deep", "huge-int-reward", "too-many-values"])
async def test_an_agent_dict_the_close_cannot_carry_still_closes_the_session(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture,
        kind: str) -> None:
    result: dict[str, Any] = {"reward": 0.5}
    if kind == "cycle":
        result["me"] = result
    elif kind == "deep":
        node: dict[str, Any] = result
        for _ in range(3000):
            node["next"] = {}
            node = node["next"]
    elif kind == "huge-int-reward":
        result["reward"] = 10 ** 400
    else:  # past the store's 2M-value limit for one body
        result["values"] = list(range(2_100_000))
    env.setattr(support, "fake_agent", _agent_returning(result))
    sid = new_sid()
    returned = await run_agent(sid, {})
    assert returned["turnlog_session_id"] == sid
    async with TurnlogClient(server_url) as tl:
        assert (await tl.session(sid))["status"] == "closed"
    closed = close_of(await events_of(server_url, sid))
    if kind == "too-many-values":  # refused with it: closed again without it
        assert closed["agent"] is None and "too-large" in closed["agent_unrecorded"]
        assert closed["reward"] == 0.5
        (warning,) = warnings.records
        assert "agent" in warning.getMessage()
    elif kind == "huge-int-reward":
        assert closed["reward"] is None  # no float64: no number
        assert closed["agent"]["reward"] == 10 ** 400
    else:
        assert closed["reward"] == 0.5
        text = repr(closed["agent"])
        assert "<cycle>" in text if kind == "cycle" else "<nested deeper than" in text


async def test_one_reward_float64_cannot_hold_loses_only_itself(
        env: pytest.MonkeyPatch, server_url: str) -> None:
    sid = new_sid()
    await run_agent(sid, {"behaviour": "none"})

    def score(args: Any, samples: Any, **kw: Any) -> list[Any]:
        return [10 ** 400, 0.5]

    env.setattr(support, "fake_rm", score)
    samples = [Sample(metadata={"turnlog_session_id": sid}) for _ in range(2)]
    assert await rm(types.SimpleNamespace(), samples) == [10 ** 400, 0.5]
    rewards = [e["reward"]["reward"] for e in await events_of(server_url, sid)
               if e["type"] == "reward_recorded"]
    assert rewards == [0.5]


async def test_a_store_answering_5xx_costs_a_batch_one_call_not_one_per_sample(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture) -> None:
    calls = 0

    def failing(_target: str, _fields: dict[str, str]) -> tuple[bytes, bytes, bytes]:
        nonlocal calls
        calls += 1
        return (b"503 Service Unavailable",
                b"Content-Type: application/problem+json\r\nRetry-After: 30\r\n",
                b'{"type":"urn:turnlog:unavailable","status":503,"title":"down"}')

    env.setattr(hooks, "DEADLINE", 1.0)  # what is measured is in units of it
    async with fake_http(failing) as url:
        env.setenv("TURNLOG_URL", url)
        samples = [Sample(metadata={"turnlog_session_id": f"s-{i}"}) for i in range(16)]
        env.setattr(support, "fake_rm", lambda args, batch, **kw: [1.0] * len(batch))
        started = asyncio.get_running_loop().time()
        assert await rm(types.SimpleNamespace(), samples) == [1.0] * 16
        elapsed = asyncio.get_running_loop().time() - started
    assert calls <= hooks.RETRIES + 1  # the first sample's call and its resends only
    assert elapsed < 2 * hooks.DEADLINE
    (warning,) = warnings.records
    assert "did not record 16 reward(s)" in warning.getMessage()


async def test_a_store_that_never_answers_costs_each_call_the_deadline(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(60)

    env.setattr(hooks, "DEADLINE", 1.0)
    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    async with server:
        env.setenv("TURNLOG_URL", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
        started = asyncio.get_running_loop().time()
        sid = new_sid()
        assert (await run_agent(sid, {}))["turnlog_session_id"] == sid
        elapsed = asyncio.get_running_loop().time() - started
    # The open and the close, each given up after the deadline (not the old 10 s read).
    assert elapsed < 4 * hooks.DEADLINE
    (warning,) = warnings.records
    assert sid in warning.getMessage()


@pytest.mark.parametrize("url", ["http://[bad", "http://h:99999"])
async def test_a_malformed_turnlog_url_never_fails_the_rollout(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture, url: str) -> None:
    env.setenv("TURNLOG_URL", url)
    env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
    assert (await run_agent(new_sid(), {}))["reward"] == 1.0
    (warning,) = warnings.records  # one per rollout, naming what is wrong
    assert url.split("//")[1] in warning.getMessage()
    env.setattr(support, "fake_rm", lambda args, sample, **kw: 1.0)
    assert await rm(types.SimpleNamespace(), Sample(metadata={"turnlog_session_id": "x"})) == 1.0


async def test_a_turnlog_url_without_a_scheme_still_closes_through_the_gateway(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture) -> None:
    """A helper's finding: `TURNLOG_URL=127.0.0.1:8000` (no scheme) made the hook skip
    everything: no close even through a working gateway (the session stayed open), and
    no session id in the result, so the reward hook recorded nothing either."""
    closes: list[str] = []

    def gateway(target: str, _fields: dict[str, str]) -> tuple[bytes, bytes, bytes]:
        if target.endswith("/close"):
            closes.append(target)
            return b"200 OK", b"Content-Type: application/json\r\n", b'{"samples": []}'
        return b"404 Not Found", b"Content-Type: text/plain\r\n", b"no such route"

    env.setenv("TURNLOG_URL", "127.0.0.1:8000")
    env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
    async with fake_http(gateway) as url:
        env.setenv("TURNLOG_GATEWAY_URL", url)
        sid = new_sid()
        result = await run_agent(sid, {})
    assert result == {"reward": 1.0, "turnlog_session_id": sid}
    assert closes == [f"/turnlog/v1/sessions/{sid}/close"]
    (warning,) = warnings.records  # one per rollout, naming what is wrong
    assert "not opened here" in warning.getMessage()
    assert "not an http:// or https:// URL" in warning.getMessage()


async def test_hook_clients_share_one_tls_context(env: pytest.MonkeyPatch) -> None:
    """Each hook call builds its client; loading the CA bundle for each (~20-50 ms of
    blocking work) would stall every rollout on the loop when many start together."""
    first, second = Settings.from_env().client(), Settings.from_env().client()
    async with first, second:
        assert hooks._tls() is hooks._tls()


async def test_a_label_the_store_refuses_is_left_out_not_the_sessions_labels(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    env.setenv("TURNLOG_RUN_ID", "run-9")
    env.setenv("TURNLOG_MILES_LABEL_KEYS", "task,b c,long")
    sid = new_sid()
    await run_agent(sid, {"task": "math", "b c": 1, "long": "x" * 5000})
    async with TurnlogClient(server_url) as tl:
        summary = await tl.session(sid)
    assert summary["labels"] == {"run_id": "run-9", "task": "math"}
    (warning,) = warnings.records
    assert "'b c' left out" in warning.getMessage() and "'long' left out" in warning.getMessage()


async def test_the_close_asks_the_store_to_commit_it_before_the_hook_gives_up(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture) -> None:
    """A close the hook gave up on must not be carried out later (it could overtake the
    gateway's spooled turns): it says so in `X-Turnlog-Timeout`, below the hook's own
    deadline. Opens and rewards do not (carried out late, they lose nothing)."""
    timeouts: dict[str, list[float | None]] = {}

    def refusing(target: str, fields: dict[str, str]) -> tuple[bytes, bytes, bytes]:
        value = fields.get("x-turnlog-timeout")
        route = target.rsplit("/", 1)[-1]
        timeouts.setdefault(route, []).append(None if value is None else float(value))
        return (b"422 Unprocessable Content", b"Content-Type: application/problem+json\r\n",
                b'{"type":"urn:turnlog:invalid-request","status":422,"title":"no"}')

    async with fake_http(refusing) as url:
        env.setenv("TURNLOG_URL", url)
        env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
        sid = new_sid()
        await run_agent(sid, {})
        env.setattr(support, "fake_rm", lambda args, sample, **kw: 1.0)
        await rm(types.SimpleNamespace(), Sample(metadata={"turnlog_session_id": sid}))
    assert set(timeouts) == {"sessions", "close", "rewards"}, timeouts
    assert timeouts["close"] and all(t is not None and 0 < t < hooks.DEADLINE
                                     for t in timeouts["close"]), timeouts
    assert set(timeouts["sessions"]) == set(timeouts["rewards"]) == {None}, timeouts


async def test_with_a_gateway_the_close_waits_until_it_holds_no_spooled_turn(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    """`TURNLOG_GATEWAY_URL` naming a gateway that does not take closes (one before that
    route): the hook asks it (`GET /turnlog/sessions/<sid>`) until it holds none of the
    session's turns, then closes through the store. A gateway that cannot be reached
    (down, restarting: its spool may hold turns) is not asked again: the close is
    deferred, and one warning says why."""
    answers = [2, 1, 0]
    asked: list[str] = []

    def gateway(target: str, _fields: dict[str, str]) -> tuple[bytes, bytes, bytes]:
        if target.startswith("/turnlog/v1/"):  # a gateway without the close route
            return b"404 Not Found", b"Content-Type: text/plain\r\n", b"no such route"
        asked.append(target)
        return (b"200 OK", b"Content-Type: application/json\r\n",
                f'{{"session_id": "x", "spooled_turns": {answers.pop(0)}}}'.encode())

    env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
    async with fake_http(gateway) as url:
        env.setenv("TURNLOG_GATEWAY_URL", url + "/")
        sid = new_sid()
        await run_agent(sid, {})
    assert asked == [f"/turnlog/sessions/{sid}"] * 3 and not answers
    assert [e["type"] for e in await events_of(server_url, sid)][-1] == "session_closed"
    assert not warnings.records

    env.setenv("TURNLOG_GATEWAY_URL", f"http://127.0.0.1:{free_port()}")  # nobody there
    env.setattr(hooks, "DEADLINE", 1.0)
    env.setattr(hooks, "CLOSE_LATER_S", 1.0)
    env.setattr(hooks, "CLOSE_LATER_POLL_S", 0.2)
    sid = new_sid()
    started = asyncio.get_running_loop().time()
    await run_agent(sid, {})
    assert asyncio.get_running_loop().time() - started < 3 * hooks.DEADLINE
    (warning,) = warnings.records
    assert "close deferred" in warning.getMessage()
    assert "did not take the close" in warning.getMessage()
    assert "connection" in warning.getMessage().lower()
    await hooks.finish(10)  # the deferred close gives up: the session is left open
    assert [e["type"] for e in await events_of(server_url, sid)][-1] == "session_opened"
    assert "left open" in warnings.records[-1].getMessage()


async def test_finish_past_its_timeout_says_what_is_still_pending(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture) -> None:
    env.setenv("TURNLOG_URL", f"http://127.0.0.1:{free_port()}")  # nobody there
    env.setattr(hooks, "DEADLINE", 0.5)
    env.setattr(hooks, "CLOSE_LATER_POLL_S", 0.2)
    env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
    await run_agent(new_sid(), {})
    assert hooks._TASKS  # the close, deferred
    with pytest.raises(TimeoutError, match=r"deferred work of 1 session\(s\) still pending "
                                           r"after 0.3 s"):
        await hooks.finish(0.3)


async def test_a_silent_gateway_costs_the_close_at_most_the_deadline(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture) -> None:
    """A gateway that accepts and never answers: the whole wait is bounded by DEADLINE
    (not a read timeout per question), and the close is not sent."""
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(60)

    env.setattr(hooks, "DEADLINE", 1.0)
    env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    async with server:
        env.setenv("TURNLOG_GATEWAY_URL", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        started = asyncio.get_running_loop().time()
        await run_agent(new_sid(), {})
        waited = asyncio.get_running_loop().time() - started
    assert waited < 2.5 * hooks.DEADLINE, waited  # the open, and the gateway's wait
    (warning,) = warnings.records
    assert "close deferred" in warning.getMessage()
    for task in list(hooks._TASKS):  # the deferred close, waiting on the silent gateway
        task.cancel()
    await hooks.finish(10)
    assert "left open" in warnings.records[-1].getMessage()


async def test_a_close_the_store_could_not_commit_in_time_is_sent_again_later(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture) -> None:
    """A close answered 503 `deadline-exceeded` (a lock held the store past the close's
    own deadline) is not resent at once (a resend would get a new deadline) but
    deferred: sent again from the background until the store takes it."""
    closes: list[str | None] = []

    def store(target: str, fields: dict[str, str]) -> tuple[bytes, bytes, bytes]:
        if target.endswith("/close"):
            closes.append(fields.get("x-turnlog-timeout"))
            if len(closes) == 1:
                return (b"503 Service Unavailable",
                        b"Content-Type: application/problem+json\r\n",
                        b'{"type":"urn:turnlog:deadline-exceeded","status":503,"title":"t"}')
            return b"200 OK", b"Content-Type: application/json\r\n", b'{"samples": []}'
        return b"201 Created", b"Content-Type: application/json\r\n", b"{}"

    env.setattr(hooks, "CLOSE_LATER_POLL_S", 0.05)
    env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
    async with fake_http(store) as url:
        env.setenv("TURNLOG_URL", url)
        await run_agent(new_sid(), {})
        (warning,) = warnings.records
        assert "close deferred" in warning.getMessage() and "deadline-exceeded" in \
            warning.getMessage()
        await hooks.finish(10)
    assert len(closes) == 2 and all(c is not None for c in closes), closes
    assert len(warnings.records) == 1  # the deferred close went through: nothing more


async def test_a_gateway_url_that_names_no_gateway_closes_at_once_with_a_warning(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    """An older gateway, or a URL of something else (a 404 to the gateway's route), or
    not a URL at all: the close is not held back for it, and a warning says so."""
    def not_a_gateway(_target: str, _fields: dict[str, str]) -> tuple[bytes, bytes, bytes]:
        return b"404 Not Found", b"Content-Type: text/plain\r\n", b"no such route"

    env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
    async with fake_http(not_a_gateway) as url:
        for gateway in (url, "gateway-host:30010"):
            env.setenv("TURNLOG_GATEWAY_URL", gateway)
            sid = new_sid()
            started = asyncio.get_running_loop().time()
            await run_agent(sid, {})
            assert asyncio.get_running_loop().time() - started < hooks.DEADLINE
            assert [e["type"] for e in await events_of(server_url, sid)][-1] == \
                "session_closed"
            assert "closed without asking it" in warnings.records[-1].getMessage()
    assert not hooks._TASKS


@pytest.mark.usefixtures("rewards")
@pytest.mark.parametrize("catch_all", [
    (b"200 OK", b"Content-Type: application/json\r\n", b'{"path": "echoed"}'),
    (b"200 OK", b"Content-Type: text/plain\r\n", b"OK"),
], ids=["json", "text"])
async def test_a_gateway_url_that_answers_everything_200_is_not_taken_for_a_gateway(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture,
        catch_all: tuple[bytes, bytes, bytes]) -> None:
    """`TURNLOG_GATEWAY_URL` set to the router's address by mistake, where a catch-all
    answers 200 to any path (as the project's fake SGLang does): the close and the
    rewards did not go anywhere, so they go to the store, and a warning names the
    mistake. (They were taken as handed over: the session stayed open, the reward
    unrecorded, nothing said.)"""
    env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
    env.setattr(support, "fake_rm", lambda args, sample, **kw: 0.5)
    async with fake_http(lambda _target, _fields: catch_all) as url:
        env.setenv("TURNLOG_GATEWAY_URL", url)
        sid = new_sid()
        await run_agent(sid, {})
        await rm(types.SimpleNamespace(), Sample(metadata={"turnlog_session_id": sid}))
    assert not hooks._TASKS and not hooks._DEFERRED
    events = await events_of(server_url, sid)
    assert [e["type"] for e in events] == ["session_opened", "session_closed",
                                           "reward_recorded"]
    assert close_of(events)["reward"] == 1.0
    assert events[-1]["reward"]["reward"] == 0.5
    said = [record.getMessage() for record in warnings.records]
    assert len(said) == 2 and all("not a turnlog gateway" in line for line in said), said


async def test_a_call_gives_up_at_the_deadline_even_with_a_resend_in_flight(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture) -> None:
    """A store that answers 503 just before the hook's deadline and then never answers:
    the resend started after the 503 is cut at the deadline, not run to its own read
    timeout (one call took up to twice the deadline)."""
    async def flaky(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if not answered:
                answered.append(True)
                await asyncio.sleep(0.8 * hooks.DEADLINE)
                body = b'{"type":"urn:turnlog:unavailable","status":503,"title":"down"}'
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\n"
                             b"Content-Type: application/problem+json\r\nRetry-After: 0\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
            await asyncio.sleep(60)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()

    answered: list[bool] = []
    env.setattr(hooks, "DEADLINE", 1.0)
    server = await asyncio.start_server(flaky, "127.0.0.1", 0)
    async with server:
        env.setenv("TURNLOG_URL", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        started = asyncio.get_running_loop().time()
        await rm(types.SimpleNamespace(), Sample(metadata={"turnlog_session_id": "s-x"}))
        elapsed = asyncio.get_running_loop().time() - started
    assert answered and elapsed < 1.5 * hooks.DEADLINE, elapsed
    (warning,) = warnings.records
    assert "did not record 1 reward(s)" in warning.getMessage()


async def test_with_a_gateway_that_takes_closes_the_close_and_rewards_go_to_it(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    """A gateway with the close route takes the close (here: queued, 202) and the
    rewards: the store sees the open only, nothing waits in this process, nothing is
    logged. The close is the store's body, the rewards carry one event id each."""
    import json

    took: list[tuple[str, dict[str, Any]]] = []

    def gateway(target: str, fields: dict[str, str], body: bytes) -> tuple[bytes, bytes, bytes]:
        took.append((target, json.loads(body)))
        return (b"202 Accepted", b"Content-Type: application/json\r\n",
                b'{"outcome": "queued"}')

    env.setattr(support, "fake_agent", _agent_returning({"reward": 0.5,
                                                         "rewards": {"resp-1": 1.0}}))
    async with fake_http(gateway, with_body=True) as url:
        env.setenv("TURNLOG_GATEWAY_URL", url)
        sid = new_sid()
        await run_agent(sid, {})
        env.setattr(support, "fake_rm", lambda args, sample, **kw: 0.25)
        await rm(types.SimpleNamespace(), Sample(metadata={"turnlog_session_id": sid}))
    assert [target for target, _ in took] == [f"/turnlog/v1/sessions/{sid}/close",
                                              f"/turnlog/v1/sessions/{sid}/rewards",
                                              f"/turnlog/v1/sessions/{sid}/rewards"]
    close, branch, model = (body for _, body in took)
    assert close["metadata"]["reward"] == 0.5 and close["metadata"]["agent"]["reward"] == 0.5
    assert (branch["reward"], branch["response_id"]) == (1.0, "resp-1")
    assert (model["reward"], model["response_id"], model["source"]) == (
        0.25, None, "support:fake_rm")
    assert branch["event_id"] != model["event_id"]
    assert [e["type"] for e in await events_of(server_url, sid)] == ["session_opened"]
    assert not hooks._TASKS and not hooks._DEFERRED and not warnings.records


@pytest.mark.parametrize(("status", "slug"), [(b"503 Service Unavailable", "spool-full"),
                                           (b"401 Unauthorized", "unauthorized")])
async def test_a_gateway_that_does_not_take_the_close_leaves_it_to_the_store(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture,
        status: bytes, slug: str) -> None:
    """The gateway answers the close 503 `spool-full`, or 401 (tokens of its own): the
    hook asks it whether it holds spooled turns of the session (none), closes through
    the store, and says so once."""
    def gateway(target: str, _fields: dict[str, str]) -> tuple[bytes, bytes, bytes]:
        if target.startswith("/turnlog/v1/"):
            return (status, b"Content-Type: application/problem+json\r\n",
                    b'{"type":"urn:turnlog:%s","status":%s,"title":"no"}'
                    % (slug.encode(), status.split()[0]))
        return (b"200 OK", b"Content-Type: application/json\r\n",
                b'{"session_id": "x", "spooled_turns": 0}')

    env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
    async with fake_http(gateway) as url:
        env.setenv("TURNLOG_GATEWAY_URL", url)
        sid = new_sid()
        await run_agent(sid, {})
    assert [e["type"] for e in await events_of(server_url, sid)][-1] == "session_closed"
    (warning,) = warnings.records
    assert "did not take the close" in warning.getMessage() and slug in warning.getMessage()


async def test_a_reward_the_gateway_could_not_take_goes_to_the_store_with_its_event_id(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    """The gateway answers a reward 503 `spool-full` (not resent): the reward goes to the
    store with the event id the gateway was sent, so a gateway that did take it after
    all makes it a repeat, never a second reward."""
    import json

    sent: list[dict[str, Any]] = []

    def full(_target: str, _fields: dict[str, str], body: bytes) -> tuple[bytes, bytes, bytes]:
        sent.append(json.loads(body))
        return (b"503 Service Unavailable", b"Content-Type: application/problem+json\r\n",
                b'{"type":"urn:turnlog:spool-full","status":503,"title":"full"}')

    sid = new_sid()
    async with TurnlogClient(server_url) as tl:
        await tl.open({"session_id": sid, "version": "v2"})
        await tl.close(sid)
    env.setattr(support, "fake_rm", lambda args, sample, **kw: 0.5)
    async with fake_http(full, with_body=True) as url:
        env.setenv("TURNLOG_GATEWAY_URL", url)
        await rm(types.SimpleNamespace(), Sample(metadata={"turnlog_session_id": sid}))
    (gateway_try,) = sent  # spool-full is not resent
    (recorded,) = [e for e in await events_of(server_url, sid) if e["type"] == "reward_recorded"]
    assert recorded["event_id"] == gateway_try["event_id"]
    assert recorded["reward"]["reward"] == 0.5
    assert not warnings.records


async def test_a_reward_before_its_close_is_deferred_and_recorded_once_the_session_closes(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    """A reward for a session still open (its close deferred in another process, or
    spooled at a gateway that is down) is answered 409 `session-open`: it is not dropped
    but sent again from the background until the session is closed."""
    env.setattr(hooks, "CLOSE_LATER_POLL_S", 0.05)
    sid = new_sid()
    async with TurnlogClient(server_url) as tl:
        await tl.open({"session_id": sid, "version": "v2"})
        env.setattr(support, "fake_rm", lambda args, sample, **kw: 0.25)
        await rm(types.SimpleNamespace(), Sample(metadata={"turnlog_session_id": sid}))
        (warning,) = warnings.records
        assert "1 reward(s) deferred" in warning.getMessage()
        assert sid in hooks._DEFERRED
        await asyncio.sleep(0.2)  # tried again meanwhile: still open
        await tl.close(sid)
    await hooks.finish(10)
    kinds = [e["type"] for e in await events_of(server_url, sid)]
    assert kinds == ["session_opened", "session_closed", "reward_recorded"]
    assert len(warnings.records) == 1 and not hooks._DEFERRED


async def test_a_deferred_close_is_handed_to_the_gateway_once_it_answers(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    """The gateway is down when the agent returns: the close is deferred; once a gateway
    answers on that address, the deferred close is handed to it (not to the store)."""
    import json

    port = free_port()
    took: list[tuple[str, dict[str, Any]]] = []

    def gateway(target: str, _fields: dict[str, str], body: bytes) -> tuple[bytes, bytes, bytes]:
        took.append((target, json.loads(body)))
        return (b"202 Accepted", b"Content-Type: application/json\r\n",
                b'{"outcome": "spooled"}')

    env.setattr(hooks, "CLOSE_LATER_POLL_S", 0.05)
    env.setenv("TURNLOG_GATEWAY_URL", f"http://127.0.0.1:{port}")
    env.setattr(support, "fake_agent", _agent_returning({"reward": 0.5}))
    sid = new_sid()
    await run_agent(sid, {})
    (warning,) = warnings.records
    assert "close deferred" in warning.getMessage()
    async with fake_http(gateway, with_body=True, port=port):
        await hooks.finish(10)
    assert [target for target, _ in took] == [f"/turnlog/v1/sessions/{sid}/close"]
    assert took[0][1]["metadata"]["reward"] == 0.5
    assert [e["type"] for e in await events_of(server_url, sid)] == ["session_opened"]


async def test_a_deferred_reward_goes_to_the_store_when_the_gateway_stays_down(
        env: pytest.MonkeyPatch, server_url: str, warnings: pytest.LogCaptureFixture) -> None:
    """Nothing answers at `TURNLOG_GATEWAY_URL`: within the hook call there is no time to
    ask the store too, so the reward is deferred; in the background it goes to the
    store, and is recorded (the session was closed there)."""
    env.setattr(hooks, "CLOSE_LATER_POLL_S", 0.05)
    env.setenv("TURNLOG_GATEWAY_URL", f"http://127.0.0.1:{free_port()}")
    sid = new_sid()
    async with TurnlogClient(server_url) as tl:
        await tl.open({"session_id": sid, "version": "v2"})
        await tl.close(sid)
    env.setattr(support, "fake_rm", lambda args, sample, **kw: 0.5)
    await rm(types.SimpleNamespace(), Sample(metadata={"turnlog_session_id": sid}))
    (warning,) = warnings.records
    assert "1 reward(s) deferred" in warning.getMessage()
    await hooks.finish(10)
    kinds = [e["type"] for e in await events_of(server_url, sid)]
    assert kinds == ["session_opened", "session_closed", "reward_recorded"]


async def test_metadata_given_fourth_as_in_the_documented_signature(
        env: pytest.MonkeyPatch, server_url: str) -> None:
    """`agent(base_url, prompt, request_kwargs, metadata, **kwargs)` is miles' documented
    signature: `metadata` given positionally reaches the inner agent and the labels."""
    env.setenv("TURNLOG_MILES_LABEL_KEYS", "task")
    sid = new_sid()
    await agent(f"{SESSION_SERVER}/{sid}", "2+2?", {}, {"task": "math"})
    (call,) = support.AGENT_CALLS
    assert call["metadata"] == {"task": "math"}
    async with TurnlogClient(server_url) as tl:
        assert (await tl.session(sid))["labels"] == {"task": "math"}


@pytest.mark.parametrize(("status", "token", "said"), [
    (401, None, "TURNLOG_TOKEN is not set"),
    (401, "wrong", "TURNLOG_TOKEN is not one of the tokens"),
    (403, "read-only", "TURNLOG_TOKEN has no write scope"),
])
async def test_a_token_the_store_refuses_is_said_with_what_it_costs(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture, status: int,
        token: str | None, said: str) -> None:
    """401 / 403 to the open and the close: the warning says which of the token's
    troubles it is (unset, unknown, without write scope) and that the session stays
    open (a 401 is not deferred: it would be refused again)."""
    reason = {401: b"401 Unauthorized", 403: b"403 Forbidden"}[status]
    kind = {401: b"unauthorized", 403: b"forbidden"}[status]

    def refusing(_target: str, _fields: dict[str, str]) -> tuple[bytes, bytes, bytes]:
        return (reason, b"Content-Type: application/problem+json\r\n",
                b'{"type":"urn:turnlog:' + kind + b'","status":' + str(status).encode()
                + b',"title":"no"}')

    env.setattr(support, "fake_agent", _agent_returning({"reward": 1.0}))
    if token is None:
        env.delenv("TURNLOG_TOKEN", raising=False)
    else:
        env.setenv("TURNLOG_TOKEN", token)
    async with fake_http(refusing) as url:
        env.setenv("TURNLOG_URL", url)
        await run_agent(new_sid(), {})
    (warning,) = warnings.records
    assert said in warning.getMessage()
    assert "the session stays open" in warning.getMessage()
    assert not hooks._DEFERRED


@pytest.mark.parametrize("url", ["notaurl", "ftp://host/x"])
async def test_a_turnlog_url_that_is_no_http_url_defers_nothing(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture, url: str) -> None:
    """Rewards for a TURNLOG_URL that can never answer are said once, not deferred and
    tried for ten minutes."""
    env.setenv("TURNLOG_URL", url)
    env.setattr(support, "fake_rm", lambda args, sample, **kw: 0.5)
    await rm(types.SimpleNamespace(), Sample(metadata={"turnlog_session_id": new_sid()}))
    assert not hooks._DEFERRED and not hooks._TASKS
    (warning,) = warnings.records
    assert "did not record 1 reward(s)" in warning.getMessage()
    assert "not an http:// or https:// URL" in warning.getMessage()


async def test_a_malformed_turnlog_url_never_fails_the_reward_hook(
        env: pytest.MonkeyPatch, warnings: pytest.LogCaptureFixture) -> None:
    env.setenv("TURNLOG_URL", "::not a url::")
    env.setattr(support, "fake_rm", lambda args, sample, **kw: 0.5)
    assert await rm(types.SimpleNamespace(),
                    Sample(metadata={"turnlog_session_id": new_sid()})) == 0.5
    (warning,) = warnings.records
    assert "did not record 1 reward(s)" in warning.getMessage()


def test_numpy_scalars_in_the_metadata_are_labels_too() -> None:
    """A dataset's metadata often holds numpy scalars: §15 keeps a string, number or
    boolean, and np.int64 / np.bool_ were dropped (np.float64, a float, was kept)."""
    import numpy as np

    settings = dataclasses.replace(Settings.from_env({}), label_keys=("a", "b", "c", "d", "e"))
    body = hooks.open_body("s", settings, {"a": np.int64(3), "b": np.float64(2.5),
                                           "c": np.bool_(True), "d": np.str_("x"),
                                           "e": np.float32("nan")})
    assert body["labels"] == {"a": 3, "b": 2.5, "c": True, "d": "x"}
    assert [type(v) for v in body["labels"].values()] == [int, float, bool, str]
