"""Sessions the end-to-end tests play, the same whether the driver talks straight
to the fake SGLang or through the gateway: tool calls, v2 retries and re-sent
first turns (branches and a second root), v1 rollbacks."""

from __future__ import annotations

from typing import Any

from tests.gateway_e2e.session_driver import SessionDriver

TOOLS: list[dict[str, Any]] = [{"type": "function",
                                "function": {"name": "calc",
                                             "parameters": {"type": "object"}}}]


async def play_v2(driver: SessionDriver) -> None:
    """A tool-call loop, a retry of its answer (a sibling branch), a follow-up
    extending the first answer (the older sibling), a re-sent first turn (a
    second root) and an unchanged resend of a turn (a superseding sibling)."""
    messages = await driver.agent_loop("what is 2 + 2", TOOLS)          # seq 0, 1
    await driver.chat(messages[:-1], tools=TOOLS, seed=7)               # seq 2: retry of 1
    follow = [*messages, {"role": "user", "content": "and times 3 please"}]
    reply = await driver.chat(follow, tools=TOOLS)                      # seq 3: extends 1
    follow.append(reply["choices"][0]["message"])
    follow.append({"role": "tool", "tool_call_id": "call_x", "content": "12"})
    await driver.chat(follow, tools=TOOLS, seed=1)                      # seq 4: extends 3
    await driver.chat(messages[:2], tools=TOOLS, seed=3)                # seq 5: a new root
    # The caller resends seq 4's request unchanged (a client-side retry): the
    # same reply, recorded again as a sibling, which supersedes seq 4's leaf.
    await driver.chat(follow, tools=TOOLS, seed=1)                      # seq 6: sibling of 4


async def play_v1(driver: SessionDriver) -> None:
    """A tool-call loop, a follow-up, then a rollback of one assistant step (the
    last user message rephrased) and two more turns on the new line."""
    messages = await driver.agent_loop("hello there", TOOLS)            # seq 0, 1
    follow = [*messages, {"role": "user", "content": "second question"}]
    reply = await driver.chat(follow)                                   # seq 2
    follow.append(reply["choices"][0]["message"])
    rephrased = [*messages, {"role": "user", "content": "second question, rephrased"}]
    reply = await driver.chat(rephrased)                                # seq 3: rollback of 2
    rephrased += [reply["choices"][0]["message"], {"role": "user", "content": "third"}]
    await driver.chat(rephrased, seed=2)                                # seq 4


async def play(driver: SessionDriver) -> None:
    await (play_v2(driver) if driver.version == "v2" else play_v1(driver))


# (version, addition R3) pairs every end-to-end test is run over.
MODES = (("v2", True), ("v2", False), ("v1", True), ("v1", False))
