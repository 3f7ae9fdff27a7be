"""R3 retention: free the stored R3 of sessions a consumer group acknowledged.

Only sessions that *every* consumer group matching them has acknowledged are
freed: a session another group still has to claim (or has claimed and not
acked) keeps its R3 and is reported in `held_by`, by group; a later run frees
it once that group acked. (A group created afterwards "from the beginning"
still gets the freed sessions, and reads their R3 as 410 `r3-pruned`.)

One short transaction per session, locked like an append (so on Citus it is
one worker's, like every write): skip a session already freed or without
stored R3; else append an `r3_pruned` event (`{"bytes": n}`, seen in the
session's events and the feed), mark the session (`r3_pruned_bytes`) and
empty the `data` of its patch rows. Everything else of a patch row — its
rows, layers, topk, dtype — stays, so the tree and `/state` still report
the rows each turn covered, and folds, rebuild and replay are unchanged.

The immutability trigger allows exactly this update (migration 0005): on
PostgreSQL only while the transaction-local setting `turnlog.r3_prune` is
on (on Citus the setting is propagated to the worker with
`citus.propagate_set_commands`); on SQLite only once the session row is
marked. On PostgreSQL the freed bytes were TOAST chunks (R3 is stored
EXTERNAL, out of line): after the update they are dead tuples, and VACUUM
(autovacuum, or `vacuum()` here) makes their pages reusable by new patches,
so the table stops growing; returning the pages to the operating system
needs `VACUUM FULL` / pg_repack, which lock the table.

Refuses: deciding which sessions a group acknowledged (the consumer tables
say), writing the log itself (the `r3_pruned` event is appended by
`app.store.append.writes.append_r3_pruned`), and anything but R3.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import sqlalchemy as sa

from app.domain.errors import UnknownConsumer
from app.domain.handoff.retention import R3Retention
from app.store.append.writes import append_r3_pruned
from app.store.engine.db import Database
from app.store.engine.dialect import citus_detected, permit_r3_prune, vacuum
from app.store.engine.schema import consumer_groups, consumer_sessions, r3_patches, sessions
from app.store.fold.loader import StateCache, session_row


@dataclass(frozen=True)
class Pruned:
    sessions: int
    bytes: int
    # (session_id, bytes) of each session freed (or that would be, on a dry run).
    freed: tuple[tuple[str, int], ...] = ()
    # Sessions kept because another group matching them has not acknowledged them
    # yet: {group: sessions}. Freed by a later run, once every such group acked.
    held_by: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Held:
    """A session not freed: these groups match it and have not acknowledged it."""

    groups: tuple[str, ...]


class Retention:
    def __init__(self, db: Database, cache: StateCache) -> None:
        self.db = db
        self.cache = cache
        self._citus: bool | None = None

    async def candidates(self, request: R3Retention) -> list[str]:
        """Sessions the group acknowledged strictly before the time, oldest ack first."""
        cs = consumer_sessions.c
        async with self.db.read() as conn:
            known = (await conn.execute(sa.select(consumer_groups.c.group_name).where(
                consumer_groups.c.group_name == request.consumer))).first()
            if known is None:
                raise UnknownConsumer(f"no consumer group {request.consumer!r}",
                                      field="consumer", expected="an existing consumer group",
                                      actual=request.consumer)
            return list((await conn.execute(
                sa.select(cs.session_id)
                .where(cs.group_name == request.consumer, cs.acked_us.is_not(None),
                       cs.acked_us < request.acked_before_us)
                .order_by(cs.acked_us, cs.session_id))).scalars())

    async def _is_citus(self) -> bool:
        if self._citus is None:
            async with self.db.read() as conn:
                self._citus = await citus_detected(conn)
        return self._citus

    async def prune_session(self, session_id: str, dry_run: bool) -> int | Held:
        """Free one session's R3; the bytes freed (0: already freed or none stored), or
        `Held` when a consumer group that matches it has not acknowledged it."""
        rp = r3_patches.c
        cs = consumer_sessions.c
        citus = not dry_run and await self._is_citus()
        async with self.db.write() as conn:
            if not dry_run:
                await permit_r3_prune(conn, citus)
            row = await session_row(conn, session_id, lock=True)
            if row["r3_pruned_bytes"] is not None:
                return 0
            # Every group that matches a session gets its row when the session closes;
            # one not acknowledged yet will claim it and read its R3.
            waiting = tuple((await conn.execute(
                sa.select(cs.group_name).where(cs.session_id == session_id,
                                               cs.acked_us.is_(None))
                .order_by(cs.group_name))).scalars())
            if waiting:
                return Held(waiting)
            stored = int((await conn.execute(
                sa.select(sa.func.coalesce(sa.func.sum(sa.func.length(rp.data)), 0))
                .where(rp.session_id == session_id))).scalar_one())
            if stored == 0 or dry_run:
                return stored
            await append_r3_pruned(conn, session_id, stored)
            await conn.execute(sessions.update().where(sessions.c.session_id == session_id)
                               .values(r3_pruned_bytes=stored))
            await conn.execute(r3_patches.update().where(rp.session_id == session_id)
                               .values(data=b""))
        self.cache.forget(session_id)
        return stored

    async def prune(self, request: R3Retention,
                    progress: Callable[[int, int], None] | None = None) -> Pruned:
        ids = await self.candidates(request)
        freed: list[tuple[str, int]] = []
        held_by: dict[str, int] = {}
        for done, session_id in enumerate(ids, start=1):
            count = await self.prune_session(session_id, request.dry_run)
            if isinstance(count, Held):
                for name in count.groups:
                    held_by[name] = held_by.get(name, 0) + 1
            elif count:
                freed.append((session_id, count))
            if progress is not None:
                progress(done, len(ids))
        return Pruned(len(freed), sum(n for _, n in freed), tuple(freed), held_by)

    async def vacuum(self) -> None:
        """Make the freed TOAST pages reusable now rather than at autovacuum's next pass
        (PostgreSQL and Citus; SQLite reuses freed pages by itself)."""
        await vacuum(self.db.writer, "r3_patches")
