"""Consumer groups across crashes, against a real `turnlog serve` subprocess.

A trainer process SIGKILLed between its claim and its ack: its sessions come
back to the group after the lease and are acknowledged exactly once. The
server SIGKILLed while an ack is in flight: after the restart the retried ack
answers as if it had been sent once (same sessions, the first step kept, one
ack each)."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import textwrap
import uuid
from collections import Counter

import httpx
import pytest

from turnlog_client import TurnlogClient


async def closed_sessions(tl: TurnlogClient, labels: dict[str, str], n: int) -> list[str]:
    sids = []
    for _ in range(n):
        sid = f"s-{uuid.uuid4().hex}"
        await tl.open({"session_id": sid, "version": "v2", "labels": labels})
        await tl.append_body(sid, {"record": {
            "request": {"input_ids": [1, 2]},
            "response": {"choices": [{"finish_reason": "stop", "meta_info": {
                "output_token_logprobs": [[-0.1, 3]]}}]}}})
        await tl.close(sid)
        sids.append(sid)
    return sids


TRAINER = textwrap.dedent("""
    import os, signal, sys
    from turnlog_client import SyncTurnlogClient
    with SyncTurnlogClient(sys.argv[1]) as tl:
        claim = tl.claim_sessions(sys.argv[2], limit=int(sys.argv[3]), lease_seconds=2)
        print(" ".join(claim.sessions), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # dies holding the lease, before any ack
""")


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_a_trainer_killed_between_claim_and_ack_gives_its_sessions_back(
        fresh_database, server_process, backend):
    server = server_process(fresh_database(backend))
    await server.wait_ready()
    labels = {"run_id": uuid.uuid4().hex}
    async with TurnlogClient(server.base_url) as tl:
        sids = await closed_sessions(tl, labels, 6)
        await tl.define_group("trainers", labels)
        dead = subprocess.run([sys.executable, "-c", TRAINER, server.base_url, "trainers", "4"],
                              capture_output=True, text=True, timeout=60)
        assert dead.returncode == -9, dead.stderr
        held = dead.stdout.split()
        assert held == sids[:4]
        # While its lease lives, nobody else gets those sessions.
        now = await tl.claim_sessions("trainers", limit=10)
        assert now.sessions == sids[4:]
        await now.ack(step=1)
        await asyncio.sleep(2.1)
        async with tl.claim("trainers", limit=10) as again:
            assert again.sessions == held
            again.step = 2
        acks = (await tl.acks("trainers", limit=100))["acks"]
        assert Counter(a["session_id"] for a in acks) == Counter(sids)
        assert {a["session_id"]: a["step"] for a in acks} == {
            **dict.fromkeys(sids[4:], 1), **dict.fromkeys(held, 2)}


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_an_ack_interrupted_by_a_server_kill_answers_as_if_sent_once(
        fresh_database, server_process, backend):
    server = server_process(fresh_database(backend))
    await server.wait_ready()
    rng = random.Random(backend)
    labels = {"run_id": uuid.uuid4().hex}
    rounds = 3
    async with TurnlogClient(server.base_url, retries=200, retry_deadline=60, backoff=0.05,
                             max_backoff=0.5) as tl:
        sids = await closed_sessions(tl, labels, 5 * rounds)
        await tl.define_group("g", labels)
        for step in range(rounds):
            claim = await tl.claim_sessions("g", limit=5)
            assert len(claim.sessions) == 5
            url = f"{server.base_url}/v1/consumers/g/claims/{claim.claim_id}/ack"
            async with httpx.AsyncClient(timeout=10) as raw:
                inflight = asyncio.create_task(raw.post(url, json={"step": step}))
                await asyncio.sleep(rng.uniform(0.0, 0.02))
                server.kill()
                outcome = await asyncio.gather(inflight, return_exceptions=True)
            server.start()
            await server.wait_ready()
            # Whether or not the first ack committed, the retry (another step,
            # even) answers the same sessions and keeps whichever step came first.
            assert await claim.ack(step=step + 100) == claim.sessions
            assert await claim.ack(step=step + 200) == claim.sessions
            first_committed = not isinstance(outcome[0], BaseException) and \
                outcome[0].status_code == 200
            steps = {a["step"] for a in (await tl.acks("g", limit=1000))["acks"]
                     if a["session_id"] in claim.sessions}
            # The killed ack either committed (its step stays) or did not (the retry's).
            assert steps in ({step}, {step + 100})
            if first_committed:
                assert steps == {step}
        acks = (await tl.acks("g", limit=1000))["acks"]
        assert Counter(a["session_id"] for a in acks) == Counter(sids)
        doc = await tl.group("g")
        assert (doc["acked"], doc["leased"], doc["available"]) == (len(sids), 0, 0)
