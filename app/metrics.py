"""Prometheus metrics: what the API process and a rebuild expose (prometheus-client).

Every `ApiMetrics` owns its own `CollectorRegistry`, so several apps in one
process (the tests) never collide. The collectors are fed by the shell (the
HTTP middleware, the append handler, the `/metrics` scrape, the rebuild
command); the domain and the store know nothing of them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "turnlog_http_requests", "HTTP requests answered, by route template and status",
            ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram(
            "turnlog_http_request_duration_seconds", "HTTP request latency by route template",
            ["method", "route"], registry=self.registry)
        self.turns = Counter(
            "turnlog_turns_appended", "Turn appends answered 2xx: created (201) or repeat (200)",
            ["result"], registry=self.registry)
        self.turns_rejected = Counter(
            "turnlog_turns_rejected", "Turn appends refused, by problem type",
            ["problem"], registry=self.registry)
        self.r3_bytes = Counter(
            "turnlog_r3_stored_bytes", "Bytes of R3 patch data stored (narrowed dtype)",
            registry=self.registry)
        self.r3_pruned_bytes = Counter(
            "turnlog_r3_pruned_bytes", "Bytes of stored R3 freed by retention (narrowed dtype)",
            registry=self.registry)
        self.r3_pruned_sessions = Counter(
            "turnlog_r3_pruned_sessions", "Sessions whose stored R3 retention freed",
            registry=self.registry)
        self.fence_lag = Gauge(
            "turnlog_feed_fence_lag_seconds",
            "How long the feed fence holds committed events back: the wait of the oldest "
            "event behind it, or the age of the oldest running transaction visible to this "
            "role if larger (PostgreSQL, no extra grant needed; 0 on SQLite; NaN if the "
            "database could not be asked)",
            registry=self.registry)

        self.consumer_sessions = Gauge(
            "turnlog_consumer_sessions",
            "Sessions of a consumer group by state: acked, leased (live lease), available",
            ["group", "state"], registry=self.registry)
        self.consumer_lag = Gauge(
            "turnlog_consumer_lag_seconds",
            "Age of the oldest session a consumer group could hand out (0 when none waits)",
            ["group"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RebuildProgress:
    """`turnlog rebuild` progress as gauges, in the process running the rebuild."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.done = Gauge("turnlog_rebuild_sessions_done", "Sessions rebuilt so far",
                          registry=self.registry)
        self.total = Gauge("turnlog_rebuild_sessions_total", "Sessions this rebuild covers",
                           registry=self.registry)

    def __call__(self, done: int, total: int) -> None:
        self.done.set(done)
        self.total.set(total)
