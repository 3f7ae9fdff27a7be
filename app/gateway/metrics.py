"""The gateway's Prometheus metrics (`/turnlog/metrics`), in a registry of their own.

Fed by the proxy and the recorder; the spool gauges are read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.domain.body.gateway import STORE_OUTCOMES, UNRECORDED_REASONS
from app.gateway.spool import CLOSE, REWARD

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Added latency is milliseconds on a healthy store, up to the store timeout on a sick one.
ADDED_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.recorded = Counter(
            "turnlog_gateway_recorded", "Turns made durable: committed, or spooled and drained",
            registry=self.registry)
        self.unrecorded = Counter(
            "turnlog_gateway_unrecorded",
            "Requests to a recorded path forwarded without being recorded, by reason",
            ["reason"], registry=self.registry)
        for reason in UNRECORDED_REASONS:
            self.unrecorded.labels(reason)
        self.refused_writes = Counter(
            "turnlog_gateway_refused_writes",
            "Spooled closes and rewards the store refused when their turn came (their "
            "clients had been answered 202), by kind", ["kind"], registry=self.registry)
        for kind in (CLOSE, REWARD):
            self.refused_writes.labels(kind)
        self.spooled_turns = Gauge(
            "turnlog_gateway_spooled_turns", "Turns waiting in the spool for the store",
            registry=self.registry)
        self.spooled_writes = Gauge(
            "turnlog_gateway_spooled_writes",
            "Writes waiting in the spool for the store: turns, and the closes and rewards "
            "spooled behind them", registry=self.registry)
        self.spooled_bytes = Gauge(
            "turnlog_gateway_spooled_bytes", "Bytes of the writes waiting in the spool",
            registry=self.registry)
        self.promised_bytes = Gauge(
            "turnlog_gateway_spool_promised_bytes",
            "Room in the spool promised to turns whose reply went out while they were "
            "written (counted as taken by every other write)", registry=self.registry)
        self.drain_lag = Gauge(
            "turnlog_gateway_drain_lag_seconds",
            "Age of the oldest write waiting in the spool (0 when it is empty)",
            registry=self.registry)
        self.added = Histogram(
            "turnlog_gateway_added_seconds",
            "Latency the gateway adds to a recorded turn: reply sent minus upstream reply "
            "complete", buckets=ADDED_BUCKETS, registry=self.registry)
        self.store = Histogram(
            "turnlog_gateway_store_seconds",
            "The store's part of the added latency: a turn's write from its parsed reply to "
            "the store's answer, by outcome (recorded, spooled, spool-full, or the store's "
            "refusal)", ["outcome"], buckets=ADDED_BUCKETS, registry=self.registry)
        for outcome in STORE_OUTCOMES:
            self.store.labels(outcome)

    def watch_spool(self, turns: Callable[[], float], writes: Callable[[], float],
                    size: Callable[[], float], lag: Callable[[], float],
                    promised: Callable[[], float] = lambda: 0.0) -> None:
        self.spooled_turns.set_function(turns)
        self.promised_bytes.set_function(promised)
        self.spooled_writes.set_function(writes)
        self.spooled_bytes.set_function(size)
        self.drain_lag.set_function(lag)

    def render(self) -> bytes:
        return generate_latest(self.registry)
