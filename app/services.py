"""The store services one process runs: built once from settings, shared by every caller.

The web layer (`app.api`), the CLI and batch jobs (`app.transfer`) all take
their database, state cache, writer and readers from here, so a batch job
never has to import the web layer to reach the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.metrics import ApiMetrics
from app.settings import Settings
from app.store.append.writes import Writer
from app.store.ci.gates import Gates
from app.store.ci.history import History, metric_keys
from app.store.engine.db import Database
from app.store.fold.loader import StateCache
from app.store.handoff.consumers import Consumers
from app.store.ops.integrity import IntegrityCheck
from app.store.ops.retention import Retention
from app.store.read.analytics import Analytics
from app.store.read.reader import Reader
from app.store.read.samples import SampleReader


@dataclass
class Services:
    settings: Settings
    db: Database
    cache: StateCache
    writer: Writer
    reader: Reader
    samples: SampleReader
    analytics: Analytics
    history: History
    gates: Gates
    integrity: IntegrityCheck
    consumers: Consumers
    retention: Retention
    metrics: ApiMetrics = field(default_factory=ApiMetrics)


def build_services(settings: Settings) -> Services:
    db = Database(settings.store.database_url, settings)
    cache = StateCache(settings.cache.state_cache_sessions, settings.cache.state_cache_bytes)
    reader = Reader(db, cache)
    return Services(
        settings=settings,
        db=db,
        cache=cache,
        writer=Writer(db, cache, settings.limits.max_nodes),
        reader=reader,
        samples=SampleReader(db, cache),
        analytics=Analytics(db),
        history=History(db, metric_keys(settings.history.metric_keys)),
        gates=Gates(db),
        integrity=IntegrityCheck(db, settings.store.integrity_check),
        # Closes notify the reader; claims waiting for sessions wake on the same event.
        consumers=Consumers(db, wakeup=lambda: reader.new_events),
        retention=Retention(db, cache),
    )
