"""The trainer side of `turnlog_client`: claim contexts, iter_claims, the samples wire,
R3 slices."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import numpy as np
import pytest

from app.main import create_app
from tests.factory import open_body, r3_b64, turn
from turnlog_client import Claim, TurnlogClient, TurnlogError


@pytest.fixture
async def app(settings):
    app = create_app(settings)
    yield app
    await app.state.services.db.dispose()


@pytest.fixture
async def tl(app):
    async with TurnlogClient("http://turnlog", transport=httpx.ASGITransport(app=app),
                             backoff=0.001) as client:
        yield client


async def closed(tl, labels, r3=False) -> str:
    sid = f"s-{uuid.uuid4().hex}"
    if r3:
        await tl.open(open_body(sid, labels=labels, r3={"num_layers": 3}))
        await tl.append_body(sid, turn([1, 2, 3], [4, 5], r3=r3_b64(4, 3, 2)))
    else:
        await tl.open(open_body(sid, labels=labels))
        await tl.append_body(sid, turn([1, 2], [3]))
    await tl.close(sid)
    return sid


async def new_group(tl) -> tuple[str, dict[str, str]]:
    labels = {"run_id": uuid.uuid4().hex}
    name = f"g-{uuid.uuid4().hex[:10]}"
    await tl.define_group(name, labels)
    return name, labels


async def test_claim_context_acks_with_its_step_on_success(tl):
    name, labels = await new_group(tl)
    sids = [await closed(tl, labels) for _ in range(2)]
    async with tl.claim(name, limit=5) as claim:
        assert isinstance(claim, Claim) and claim.sessions == sids
        claim.step = 4
    doc = await tl.group(name)
    assert doc["acked"] == 2
    assert [a["step"] for a in (await tl.acks(name))["acks"]] == [4, 4]


async def test_claim_context_releases_on_an_exception(tl):
    name, labels = await new_group(tl)
    sid = await closed(tl, labels)
    with pytest.raises(RuntimeError):
        async with tl.claim(name) as claim:
            assert claim.sessions == [sid]
            raise RuntimeError("trainer crashed")
    doc = await tl.group(name)
    assert (doc["acked"], doc["leased"], doc["available"]) == (0, 0, 1)


async def test_iter_claims_acks_each_claim_when_the_loop_moves_on(tl):
    name, labels = await new_group(tl)
    sids = [await closed(tl, labels) for _ in range(5)]
    seen = []
    async for claim in tl.iter_claims(name, limit=2, wait=0, until_idle=True):
        seen += claim.sessions
        claim.step = len(seen)
    assert seen == sids
    assert (await tl.group(name))["acked"] == 5


async def test_lease_lost_is_a_typed_error(tl):
    name, labels = await new_group(tl)
    await closed(tl, labels)
    first = await tl.claim_sessions(name, lease_seconds=1)
    await asyncio.sleep(1.1)
    await tl.claim_sessions(name)
    with pytest.raises(TurnlogError) as exc:
        await first.ack()
    assert exc.value.slug == "lease-lost" and exc.value.status == 409


async def test_samples_wire_and_r3_slices(tl):
    sid = await closed(tl, {"run_id": "x"}, r3=True)
    tensors = await tl.samples(sid, format="safetensors")
    doc = await tl.samples(sid)
    assert tensors["tokens.0"].tolist() == doc["samples"][0]["tokens"]
    full = await tl.r3(sid, 0)
    assert np.array_equal(tensors["rollout_routed_experts.0"], full)
    assert np.array_equal(await tl.r3(sid, 0, rows="1:3", layers=slice(1, None)),
                          full[1:3, 1:, :])
    assert np.array_equal(await tl.r3(sid, 0, layers=(0, 1)), full[:, 0:1, :])


def closed_sync(tl, labels, count) -> list[str]:
    """`count` closed one-turn sessions with `labels`, through the sync client."""
    sids = [f"s-{uuid.uuid4().hex}" for _ in range(count)]
    for sid in sids:
        tl.open(open_body(sid, labels=labels))
        tl.append_body(sid, turn([1, 2], [3]))
        tl.close(sid)
    return sids


def test_sync_claim_context(settings):
    from turnlog_client.sync import SyncTurnlogClient

    app = create_app(settings)
    with SyncTurnlogClient("http://turnlog", transport=httpx.ASGITransport(app=app)) as tl:
        labels = {"run_id": uuid.uuid4().hex}
        (sid,) = closed_sync(tl, labels, 1)
        name = f"g-{uuid.uuid4().hex[:10]}"
        tl.define_group(name, labels)
        with tl.claim(name) as claim:
            assert claim.sessions == [sid]
            claim.step = 1
        assert tl.group(name)["acked"] == 1
        assert [c.sessions for c in tl.iter_claims(name, wait=0, until_idle=True)] == []


def test_the_sync_clients_claims_settle_when_asked(settings):
    """A claim from the sync client has blocking `ack()` / `release()`: a release in a
    `with` block gives the sessions back (it returned an unawaited coroutine, and the
    block's end then acknowledged them), from `claim_sessions` and `iter_claims` too."""
    from turnlog_client import SyncClaim
    from turnlog_client.sync import SyncTurnlogClient

    app = create_app(settings)
    with SyncTurnlogClient("http://turnlog", transport=httpx.ASGITransport(app=app)) as tl:
        labels = {"run_id": uuid.uuid4().hex}
        closed_sync(tl, labels, 2)
        name = f"g-{uuid.uuid4().hex[:10]}"
        tl.define_group(name, labels)
        with tl.claim(name, limit=1) as claim:
            assert isinstance(claim, SyncClaim) and claim.release() == claim.sessions
        assert (tl.group(name)["acked"], tl.group(name)["available"]) == (0, 2)
        claim = tl.claim_sessions(name, limit=1)
        claim.step = 7
        assert claim.ack() == claim.sessions
        (claimed,) = list(tl.iter_claims(name, wait=0, until_idle=True))
        assert isinstance(claimed, SyncClaim)
        acks = tl.acks(name)["acks"]
        assert (tl.group(name)["acked"], [a["step"] for a in acks]) == (2, [7, None])


async def test_a_group_may_require_rewards(tl):
    name = f"g-{uuid.uuid4().hex[:10]}"
    defined = await tl.define_group(name, {"run_id": "x"}, require_reward=True)
    assert defined["require_reward"] is True
    assert (await tl.group(name))["require_reward"] is True
