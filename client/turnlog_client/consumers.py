"""Trainer-side calls of the async client: consumer groups, claims, the samples wire
and R3 slices.

Owns what makes a trainer's hand-off safe to retry and hard to misuse: every
claim carries a client-made `claim_id` (a retried claim answers the original
sessions), `claim()` is an async context manager that acknowledges the claim
with its `step` when the block succeeds and releases it when the block raises,
and `iter_claims()` acknowledges each claim when the loop asks for the next.
`TurnlogClient` inherits these calls; they send through the client's one
`Transport` (retries, errors), handed to `ConsumerCalls.__init__`. Refuses to
own any rule (the server decides what a claim holds and whether an ack wins).
"""

from __future__ import annotations

import contextlib
import io
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from turnlog_client.errors import TurnlogError
from turnlog_client.transport import Transport

SAFETENSORS = "application/x-safetensors"


@dataclass
class Claim:
    """Sessions handed to this trainer under a lease. Set `step` to the training step
    that used them before the claim is acknowledged."""

    group: str
    claim_id: str
    epoch: int
    expires_at: str
    sessions: list[str]
    step: int | None = None
    settled: bool = field(default=False, repr=False)
    client: ConsumerCalls | None = field(default=None, repr=False, compare=False)

    async def ack(self, sessions: list[str] | None = None, step: int | None = None
                  ) -> list[str]:
        """Acknowledge (all, or `sessions`); 409 `lease-lost` if another claim won."""
        assert self.client is not None
        acked = await self.client.ack(self.group, self.claim_id, sessions=sessions,
                                      step=self.step if step is None else step)
        if sessions is None:
            self.settled = True
        return acked

    async def release(self, sessions: list[str] | None = None) -> list[str]:
        """Give the sessions back at once (all, or `sessions`)."""
        assert self.client is not None
        released = await self.client.release(self.group, self.claim_id, sessions=sessions)
        if sessions is None:
            self.settled = True
        return released


class _ClaimContext:
    def __init__(self, client: ConsumerCalls, group: str, options: dict[str, Any]) -> None:
        self.client = client
        self.group = group
        self.options = options
        self.claim: Claim | None = None

    async def __aenter__(self) -> Claim:
        self.claim = await self.client.claim_sessions(self.group, **self.options)
        return self.claim

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        claim = self.claim
        if claim is None or claim.settled or not claim.sessions:
            return
        if exc_type is None:
            await claim.ack()
            return
        # The block failed: hand the sessions back now rather than after the lease.
        # If that fails too, the lease expiry returns them; the block's error wins.
        with contextlib.suppress(TurnlogError):
            await claim.release()


class ConsumerCalls:
    """Consumer-group and trainer read calls (inherited by `TurnlogClient`)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    # -- groups -------------------------------------------------------------------

    async def define_group(self, group: str, labels: Mapping[str, Any] | None = None, *,
                           start: str = "beginning",
                           require_reward: bool = False) -> dict[str, Any]:
        """`PUT /v1/consumers/{group}`: consume the closed sessions matching `labels`,
        from the `beginning` or only those closed from `now` on; with `require_reward`,
        only once every sample of a session has a reward (from the close or recorded
        after it). Idempotent."""
        result: dict[str, Any] = await self._transport.json(
            "PUT", f"/v1/consumers/{group}",
            body={"labels": dict(labels or {}), "from": start, "require_reward": require_reward})
        return result

    async def group(self, group: str) -> dict[str, Any]:
        """The group's definition and its acked / leased / available counts."""
        result: dict[str, Any] = await self._transport.json("GET", f"/v1/consumers/{group}")
        return result

    async def groups(self) -> list[dict[str, Any]]:
        """Every consumer group, by name."""
        result: dict[str, Any] = await self._transport.json("GET", "/v1/consumers")
        return list(result["groups"])

    async def acks(self, group: str, *, step: int | None = None, after: str | None = None,
                   limit: int | None = None) -> dict[str, Any]:
        """One page of the group's acks in ack order (which sessions trained `step`)."""
        result: dict[str, Any] = await self._transport.json(
            "GET", f"/v1/consumers/{group}/acks",
            params={"step": step, "after": after, "limit": limit})
        return result

    # -- claims -------------------------------------------------------------------

    async def claim_sessions(self, group: str, *, limit: int = 1, lease_seconds: int = 600,
                             wait: float = 0, claim_id: str | None = None) -> Claim:
        """`POST …/claims` once (retries reuse the same `claim_id`)."""
        body = {"claim_id": claim_id or uuid.uuid4().hex, "limit": limit,
                "lease_seconds": lease_seconds, "wait": wait}
        reply = await self._transport.json(
            "POST", f"/v1/consumers/{group}/claims", body=body,
            timeout=self._transport.long_poll(wait))
        return Claim(group=group, claim_id=reply["claim_id"], epoch=reply["epoch"],
                     expires_at=reply["expires_at"], sessions=list(reply["sessions"]),
                     client=self)

    def claim(self, group: str, *, limit: int = 1, lease_seconds: int = 600, wait: float = 0,
              claim_id: str | None = None) -> _ClaimContext:
        """`async with tl.claim(group, limit=32) as c:` — the block gets `c.sessions`;
        leaving it normally acknowledges them with `c.step`, an exception releases them."""
        return _ClaimContext(self, group, {
            "limit": limit, "lease_seconds": lease_seconds, "wait": wait,
            "claim_id": claim_id})

    async def iter_claims(self, group: str, *, limit: int = 1, lease_seconds: int = 600,
                          wait: float = 10, until_idle: bool = False) -> AsyncIterator[Claim]:
        """Non-empty claims, one after another (long-polling `wait` seconds between).
        A claim the loop body left unsettled is acknowledged (with its `step`) when
        the loop asks for the next one; if the body raises, its lease returns the
        sessions. With `until_idle`, stops at the first empty claim."""
        while True:
            claim = await self.claim_sessions(group, limit=limit, lease_seconds=lease_seconds,
                                              wait=wait)
            if not claim.sessions:
                if until_idle:
                    return
                continue
            yield claim
            if not claim.settled:
                await claim.ack()

    async def ack(self, group: str, claim_id: str, *, sessions: list[str] | None = None,
                  step: int | None = None) -> list[str]:
        """Acknowledge a claim's sessions (all by default); repeats answer the same."""
        body: dict[str, Any] = {"step": step}
        if sessions is not None:
            body["sessions"] = sessions
        reply = await self._transport.json(
            "POST", f"/v1/consumers/{group}/claims/{claim_id}/ack", body=body)
        return list(reply["acked"])

    async def release(self, group: str, claim_id: str, *,
                      sessions: list[str] | None = None) -> list[str]:
        """Give a claim's unacknowledged sessions back at once (all by default)."""
        body: dict[str, Any] = {} if sessions is None else {"sessions": sessions}
        reply = await self._transport.json(
            "POST", f"/v1/consumers/{group}/claims/{claim_id}/release", body=body)
        return list(reply["released"])

    # -- trainer reads ------------------------------------------------------------

    async def samples_wire(self, session_id: str) -> dict[str, np.ndarray]:
        """The samples as the miles samples wire: safetensors tensors by name
        (`tokens.<i>`, `loss_mask.<i>`, `rollout_log_probs.<i>`,
        `rollout_routed_experts.<i>`, `_samples_meta`). Needs the `safetensors` extra
        (`pip install 'turnlog-client[safetensors]'`)."""
        try:
            from safetensors.numpy import load
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                "the samples wire needs the safetensors package: pip install "
                "'turnlog-client[safetensors]' (or safetensors)", name=exc.name) from exc

        response = await self._transport.send(
            "GET", f"/v1/sessions/{session_id}/samples", params={"format": "safetensors"})
        tensors: dict[str, np.ndarray] = load(response.content)
        return tensors

    async def r3_slice(self, session_id: str, index: int, *, rows: str | None = None,
                       layers: str | None = None) -> np.ndarray:
        """`[a:b, c:d, :]` of a sample's R3 (`rows="a:b"`, `layers="c:d"`)."""
        response = await self._transport.send(
            "GET", f"/v1/sessions/{session_id}/samples/{index}/r3",
            params={"rows": rows, "layers": layers})
        array: np.ndarray = np.load(io.BytesIO(response.content), allow_pickle=False)
        return array


def bounds(value: str | slice | tuple[int | None, int | None] | None) -> str | None:
    """`rows=`/`layers=` as the query wants them: a slice, a pair or "a:b" text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, slice):
        if value.step not in (None, 1):
            raise ValueError("R3 slices take no step")
        lo, hi = value.start, value.stop
    else:
        lo, hi = value
    return f"{'' if lo is None else lo}:{'' if hi is None else hi}"
