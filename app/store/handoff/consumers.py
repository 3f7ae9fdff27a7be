"""Consumer groups in the database: definitions, claims under leases, acks, releases.

Exactly once per group: a session of a group has one `consumer_sessions` row,
and every claim, ack and release changes it under a row lock. Claims take
their candidates with `FOR UPDATE SKIP LOCKED` on PostgreSQL, so concurrent
claimers never wait on (or take) each other's sessions, and only then bump
the group's epoch counter; SQLite has one writer. A group's rows are made
when it is defined (`from: beginning`: every matching closed session) and
when a matching session closes (`enqueue_closed`, inside the close's
transaction) — for a group that requires rewards, once every sample of the
session has one: at the close, or when a recorded reward completes them
(`enqueue_rewarded`, inside the reward's transaction). These cannot miss
each other on PostgreSQL: closes and rewards hold a shared advisory lock
that defining a group takes exclusively.

The rules (what is claimable, the ack verdict, parsing) are
`app/domain/handoff/consumers.py`; this module only orders locks, reads the clock
and persists.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from app.domain.body.labels import parse_label_filters
from app.domain.errors import ConsumerConflict, InvalidRequest, UnknownClaim, UnknownConsumer
from app.domain.handoff.consumers import (
    FROM_BEGINNING,
    ClaimRequest,
    GroupSpec,
    Holding,
    ack_verdict,
    claim_id_of,
    enqueued_late,
    known_group,
    label_texts,
    matches,
    offered,
    parse_ack,
    parse_claim,
    parse_group,
    parse_release,
    requested,
)
from app.domain.projection.rows import iso_us
from app.domain.wire import jsonio
from app.store.engine.db import Database, now_us
from app.store.engine.dialect import advisory_xact_lock, feed_fence, lock_rows, skip_locked
from app.store.engine.schema import (
    consumer_acks,
    consumer_claims,
    consumer_groups,
    consumer_sessions,
    sessions,
)
from app.store.read import cursor
from app.store.read.selects import label_filter

# Closes take this advisory lock shared, defining a group takes it exclusive.
GROUPS_LOCK_KEY = 0x7475726E6C6F67  # "turnlog"
POLL_SECONDS = 0.25


async def _groups_lock(conn: AsyncConnection, shared: bool) -> None:
    await advisory_xact_lock(conn, GROUPS_LOCK_KEY, shared)


async def enqueue_closed(conn: AsyncConnection, session_id: str, labels: Mapping[str, Any],
                         closed_us: int, rewarded: bool = True) -> None:
    """Hand a session that is closing (in `conn`'s transaction) to every group it
    matches; a group requiring rewards only if every sample has one (`rewarded`)."""
    await _groups_lock(conn, shared=True)
    groups = (await conn.execute(
        sa.select(consumer_groups.c.group_name, consumer_groups.c.labels,
                  consumer_groups.c.require_reward))).all()
    rows = [{"session_id": session_id, "group_name": g.group_name, "closed_us": closed_us}
            for g in groups if matches(label_texts(jsonio.loads(g.labels)), labels)
            and offered(g.require_reward, rewarded)]
    if rows:
        await conn.execute(consumer_sessions.insert(), rows)


async def enqueue_rewarded(conn: AsyncConnection, session_id: str, labels: Mapping[str, Any],
                           closed_us: int) -> None:
    """Hand a closed session whose samples have all just got a reward (in `conn`'s
    transaction) to the groups requiring rewards that it matches. It happens once
    per session: a recorded reward is never null, so it never becomes unrewarded."""
    await _groups_lock(conn, shared=True)
    groups = (await conn.execute(
        sa.select(consumer_groups.c.group_name, consumer_groups.c.labels,
                  consumer_groups.c.start, consumer_groups.c.created_us)
        .where(consumer_groups.c.require_reward.is_(True)))).all()
    rows = [{"session_id": session_id, "group_name": g.group_name, "closed_us": closed_us}
            for g in groups if matches(label_texts(jsonio.loads(g.labels)), labels)
            and enqueued_late(g.start, g.created_us, closed_us)]
    if rows:
        await conn.execute(consumer_sessions.insert(), rows)


def _holding(row: Any) -> Holding:
    return Holding(session_id=row.session_id, claim_id=row.claim_id,
                   expires_us=row.expires_us, acked=row.acked_us is not None)


class _NothingYet(Exception):
    """Rolls back an empty claim attempt while the caller may still wait."""


@dataclass(frozen=True)
class Claimed:
    body: dict[str, Any]
    created: bool


class Consumers:
    def __init__(self, db: Database,
                 wakeup: Callable[[], asyncio.Event] | None = None) -> None:
        self.db = db
        # The event a close in this process sets (waiting claims wake on it).
        self.wakeup = wakeup
        # The claimability probe under way per group, shared by its waiting claims.
        self._probing: dict[str, asyncio.Future[bool]] = {}

    # -- groups ---------------------------------------------------------------

    async def put_group(self, group: str, raw: Any) -> tuple[dict[str, Any], bool]:
        spec = parse_group(group, raw)
        fingerprint = jsonio.fingerprint(spec.body())
        async with self.db.read() as conn:
            # A repeat (every trainer defines its group at start) needs no lock.
            stored = (await conn.execute(
                sa.select(consumer_groups.c.fingerprint)
                .where(consumer_groups.c.group_name == group))).scalar()
        if stored is not None:
            self._same(stored, fingerprint, group)
            return await self.group(group), False
        try:
            async with self.db.write() as conn:
                await _groups_lock(conn, shared=False)
                existing = (await conn.execute(
                    sa.select(consumer_groups.c.fingerprint)
                    .where(consumer_groups.c.group_name == group))).first()
                if existing is not None:
                    self._same(existing.fingerprint, fingerprint, group)
                    created = False
                else:
                    await self._create(conn, spec, fingerprint)
                    created = True
        except IntegrityError:
            async with self.db.read() as conn:
                stored = (await conn.execute(
                    sa.select(consumer_groups.c.fingerprint)
                    .where(consumer_groups.c.group_name == group))).scalar_one()
            self._same(stored, fingerprint, group)
            created = False
        return await self.group(group), created

    @staticmethod
    def _same(stored: str, fingerprint: str, group: str) -> None:
        if stored != fingerprint:
            raise ConsumerConflict(f"consumer group {group!r} exists with another definition",
                                   field="body", expected="the body the group was defined with",
                                   actual="a different body")

    async def _create(self, conn: AsyncConnection, spec: GroupSpec, fingerprint: str) -> None:
        await conn.execute(consumer_groups.insert().values(
            group_name=spec.group, labels=jsonio.dumps(spec.labels), start=spec.start,
            require_reward=spec.require_reward, fingerprint=fingerprint, epoch=0,
            created_us=now_us()))
        if spec.start != FROM_BEGINNING:
            return
        closed = (sa.select(sessions.c.session_id, sa.literal(spec.group),
                            sessions.c.closed_us)
                  .where(sessions.c.status == "closed")
                  .where(*label_filter(parse_label_filters(spec.label_texts()))))
        if spec.require_reward:
            # The others wait for their rewards (`enqueue_rewarded`).
            closed = closed.where(sessions.c.rewarded.is_(True))
        await conn.execute(consumer_sessions.insert().from_select(
            ["session_id", "group_name", "closed_us"], closed))

    async def _group_row(self, conn: AsyncConnection, group: str) -> Any:
        known_group(group)
        row = (await conn.execute(
            sa.select(consumer_groups).where(consumer_groups.c.group_name == group))).first()
        if row is None:
            raise UnknownConsumer(f"no consumer group {group!r}", field="group",
                                  expected="an existing consumer group", actual=group)
        return row

    async def group(self, group: str) -> dict[str, Any]:
        doc, _oldest = await self._group_doc(group)
        return doc

    async def _group_doc(self, group: str) -> tuple[dict[str, Any], int | None]:
        now = now_us()
        cs = consumer_sessions.c
        live = sa.and_(cs.claim_id.is_not(None), cs.expires_us > now)
        open_ = cs.acked_us.is_(None)
        async with self.db.read() as conn:
            row = await self._group_row(conn, group)
            acked, leased, available, oldest = (await conn.execute(
                sa.select(
                    sa.func.count(cs.acked_us),
                    sa.func.coalesce(sa.func.sum(sa.case(
                        (sa.and_(open_, live), 1), else_=0)), 0),
                    sa.func.coalesce(sa.func.sum(sa.case(
                        (sa.and_(open_, sa.not_(live)), 1), else_=0)), 0),
                    sa.func.min(sa.case((sa.and_(open_, sa.not_(live)), cs.closed_us))),
                ).where(cs.group_name == group))).one()
        oldest_us = None if oldest is None else int(oldest)
        return {
            "group": group,
            "labels": dict(jsonio.loads(row.labels)),
            "from": row.start,
            "require_reward": bool(row.require_reward),
            "acked": int(acked),
            "leased": int(leased),
            "available": int(available),
            "oldest_available_closed_at": None if oldest_us is None else iso_us(oldest_us),
        }, oldest_us

    async def _names(self) -> list[str]:
        async with self.db.read() as conn:
            return list((await conn.execute(
                sa.select(consumer_groups.c.group_name)
                .order_by(consumer_groups.c.group_name))).scalars().all())

    async def list_groups(self) -> list[dict[str, Any]]:
        return [await self.group(name) for name in await self._names()]

    async def gauges(self) -> list[tuple[dict[str, Any], float]]:
        """Per group: its document and its lag, the age in seconds of the oldest
        session it could hand out (0 when none waits)."""
        out = []
        for name in await self._names():
            doc, oldest = await self._group_doc(name)
            lag = 0.0 if oldest is None else max(0.0, (now_us() - oldest) / 1e6)
            out.append((doc, lag))
        return out

    # -- claims ---------------------------------------------------------------

    async def claim(self, group: str, raw: Any, closing: asyncio.Event | None = None
                    ) -> Claimed:
        """Claim sessions of `group`, waiting up to the body's `wait` for one; the wait
        ends early, as if it had run out, once `closing` is set (the server is shutting
        down)."""
        known_group(group)
        try:
            request = parse_claim(raw)
        except InvalidRequest:
            # Only a body that fails its checks pays this look-up.
            repeat = await self._repeat(group, claim_id_of(raw))
            if repeat is None:
                raise
            return repeat
        deadline = time.monotonic() + request.wait
        first = True
        while True:
            wakeup = self.wakeup() if self.wakeup is not None else None
            final = time.monotonic() >= deadline or (closing is not None and closing.is_set())
            try:
                # While waiting, a read probes first: an empty attempt would take the
                # write lock (SQLite) for nothing on every wake-up.
                probe = (True if final
                         else await self._probe(group, request.claim_id) if first
                         else await self._claimable(group))
                first = False
                if isinstance(probe, Claimed):
                    return probe
                if probe:
                    return await self._claim_once(group, request, allow_empty=final)
            except _NothingYet:
                pass
            except IntegrityError:
                # The same claim_id committed concurrently: answer its reply.
                async with self.db.read() as conn:
                    repeat = await self._claim_row(conn, group, request.claim_id)
                if repeat is None:
                    raise
                return Claimed(self._claim_body(repeat), created=False)
            # Until the next tick of a grid every waiter shares (or a close wakes
            # them): waiters of a group then probe together, and share one query.
            remaining = deadline - time.monotonic()
            tick = POLL_SECONDS - time.monotonic() % POLL_SECONDS
            pause = max(0.0, min(remaining, tick))
            if wakeup is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wakeup.wait(), timeout=pause)
            else:
                await asyncio.sleep(pause)

    async def _probe(self, group: str, claim_id: str) -> Claimed | bool:
        """The original reply of a repeated claim_id, else whether some session is
        claimable now."""
        cs = consumer_sessions.c
        async with self.db.read() as conn:
            await self._group_row(conn, group)
            repeat = await self._claim_row(conn, group, claim_id)
            if repeat is not None:
                return Claimed(self._claim_body(repeat), created=False)
            found = (await conn.execute(
                sa.select(cs.session_id)
                .where(cs.group_name == group, cs.acked_us.is_(None))
                .where(sa.or_(cs.claim_id.is_(None), cs.expires_us <= now_us()))
                .limit(1))).first()
        return found is not None

    async def _claimable(self, group: str) -> bool:
        """Whether some session of `group` is claimable now: one query however many
        claims of the group wait (they join the one under way), so 900 waiting
        claims cost a query per wake-up, not 900."""
        pending = self._probing.get(group)
        if pending is None:
            pending = asyncio.ensure_future(self._claimable_now(group))
            self._probing[group] = pending
            pending.add_done_callback(lambda _done: self._probing.pop(group, None))
        return await asyncio.shield(pending)

    async def _claimable_now(self, group: str) -> bool:
        cs = consumer_sessions.c
        async with self.db.read() as conn:
            await self._group_row(conn, group)
            found = (await conn.execute(
                sa.select(cs.session_id)
                .where(cs.group_name == group, cs.acked_us.is_(None))
                .where(sa.or_(cs.claim_id.is_(None), cs.expires_us <= now_us()))
                .limit(1))).first()
        return found is not None

    async def _repeat(self, group: str, claim_id: str | None) -> Claimed | None:
        """The original reply of an existing claim_id (404 for an unknown group)."""
        if claim_id is None:
            return None
        async with self.db.read() as conn:
            await self._group_row(conn, group)
            row = await self._claim_row(conn, group, claim_id)
        return None if row is None else Claimed(self._claim_body(row), created=False)

    @staticmethod
    async def _claim_row(conn: AsyncConnection, group: str, claim_id: str) -> Any:
        return (await conn.execute(
            sa.select(consumer_claims).where(consumer_claims.c.group_name == group)
            .where(consumer_claims.c.claim_id == claim_id))).first()

    @staticmethod
    def _claim_body(row: Any) -> dict[str, Any]:
        return {"claim_id": row.claim_id, "epoch": int(row.epoch),
                "expires_at": iso_us(int(row.expires_us)),
                "sessions": list(jsonio.loads(row.sessions))}

    async def _claim_once(self, group: str, request: ClaimRequest, allow_empty: bool
                          ) -> Claimed:
        cs = consumer_sessions.c
        # A repeated claim_id is rare (a retry after a lost reply): it is caught by
        # the claim row's primary key at the end, which rolls this attempt back,
        # and `claim` answers the original; the common path pays no lookup.
        async with self.db.write() as conn:
            now = now_us()
            candidates = (await conn.execute(skip_locked(
                sa.select(cs.session_id)
                .where(cs.group_name == group, cs.acked_us.is_(None))
                .where(sa.or_(cs.claim_id.is_(None), cs.expires_us <= now))
                .order_by(cs.closed_us, cs.session_id)
                .limit(request.limit)
            ))).scalars().all()
            if not candidates and not allow_empty:
                await self._group_row(conn, group)  # an unknown group is 404 at once
                raise _NothingYet
            # The epoch counter is bumped last, so the group row is locked only
            # for the rest of this short transaction.
            bumped = (await conn.execute(
                consumer_groups.update().where(consumer_groups.c.group_name == group)
                .values(epoch=consumer_groups.c.epoch + 1)
                .returning(consumer_groups.c.epoch))).scalar()
            if bumped is None:  # no such group (it has no sessions and no claims either)
                await self._group_row(conn, group)
            epoch = int(bumped)
            expires = now + request.lease_seconds * 1_000_000
            taken = list(candidates)
            if taken:
                await conn.execute(
                    consumer_sessions.update()
                    .where(cs.group_name == group, cs.session_id.in_(taken))
                    .values(claim_id=request.claim_id, epoch=epoch, expires_us=expires))
            await conn.execute(consumer_claims.insert().values(
                group_name=group, claim_id=request.claim_id, epoch=epoch, expires_us=expires,
                sessions=jsonio.dumps(taken), created_us=now))
        return Claimed({"claim_id": request.claim_id, "epoch": epoch,
                        "expires_at": iso_us(expires), "sessions": taken}, created=True)

    async def _claim_for_update(self, conn: AsyncConnection, group: str, claim_id: str
                                ) -> Any:
        row = await self._claim_row(conn, group, claim_id)
        if row is None:
            await self._group_row(conn, group)  # 404 unknown-consumer first
            raise UnknownClaim(f"consumer group {group!r} has no claim {claim_id!r}",
                               field="claim_id", expected="a claim_id this group answered",
                               actual=claim_id[:128])
        return row

    async def _lock_sessions(self, conn: AsyncConnection, group: str, wanted: list[str]
                             ) -> list[Any]:
        cs = consumer_sessions.c
        # One lock order (session_id) for every writer: concurrent acks never deadlock.
        return list((await conn.execute(lock_rows(
            sa.select(consumer_sessions)
            .where(cs.group_name == group, cs.session_id.in_(wanted))
            .order_by(cs.session_id)))).all())

    async def ack(self, group: str, claim_id: str, raw: Any) -> dict[str, Any]:
        known_group(group)
        request = parse_ack(raw)
        cs = consumer_sessions.c
        async with self.db.write() as conn:
            claim = await self._claim_for_update(conn, group, claim_id)
            wanted = requested(jsonio.loads(claim.sessions), request.sessions)
            rows = await self._lock_sessions(conn, group, wanted)
            now = now_us()
            acked_by = {row.session_id: row.claim_id for row in rows
                        if row.acked_us is not None}
            fresh = ack_verdict(claim_id, [_holding(row) for row in rows], acked_by, now)
            if fresh:
                await conn.execute(
                    consumer_sessions.update()
                    .where(cs.group_name == group, cs.session_id.in_(fresh))
                    .values(claim_id=claim_id, epoch=claim.epoch, acked_us=now,
                            step=request.step))
                await conn.execute(consumer_acks.insert(), [
                    {"session_id": sid, "group_name": group, "claim_id": claim_id,
                     "epoch": claim.epoch, "step": request.step, "acked_us": now}
                    for sid in sorted(fresh)])
        return {"acked": wanted}

    async def release(self, group: str, claim_id: str, raw: Any) -> dict[str, Any]:
        known_group(group)
        wanted_raw = parse_release(raw)
        cs = consumer_sessions.c
        async with self.db.write() as conn:
            claim = await self._claim_for_update(conn, group, claim_id)
            wanted = requested(jsonio.loads(claim.sessions), wanted_raw)
            rows = await self._lock_sessions(conn, group, wanted)
            held = {row.session_id for row in rows
                    if row.claim_id == claim_id and row.acked_us is None}
            released = [sid for sid in wanted if sid in held]
            if released:
                await conn.execute(
                    consumer_sessions.update()
                    .where(cs.group_name == group, cs.session_id.in_(released))
                    .values(claim_id=None, epoch=None, expires_us=None))
        return {"released": released}

    async def acks(self, group: str, step: int | None, after: str | None,
                   limit: int) -> dict[str, Any]:
        """(`step` and `limit` parsed: `parse_step_filter`, `ACKS_PAGE`.)"""
        start = cursor.decode(after, 2)
        ca = consumer_acks.c
        query = (sa.select(consumer_acks).where(ca.group_name == group)
                 .where(sa.tuple_(ca.xid, ca.position) > sa.tuple_(*start))
                 .order_by(ca.xid, ca.position).limit(limit))
        if step is not None:
            query = query.where(ca.step == step)
        async with self.db.read() as conn:
            await self._group_row(conn, group)
            fence = await feed_fence(conn, ca.xid)
            if fence is not None:
                query = query.where(fence)
            rows = (await conn.execute(query)).all()
        next_cursor = cursor.encode(rows[-1].xid, rows[-1].position) if rows \
            else after or cursor.encode(*start)
        return {"acks": [{"session_id": r.session_id, "claim_id": r.claim_id,
                          "epoch": int(r.epoch), "step": r.step, "acked_at": iso_us(r.acked_us)}
                         for r in rows],
                "next": next_cursor}
