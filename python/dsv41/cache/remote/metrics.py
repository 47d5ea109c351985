"""The remote tier's metrics, registered in the cache's registry (prefix dsv41_cache_remote_),
so they appear in CacheMetrics.to_dict() and the Prometheus text with the other tiers'."""
from __future__ import annotations

from ..metrics import LATENCY_BUCKETS_S, MetricsRegistry

__all__ = ["RemoteMetrics"]


class RemoteMetrics:
    """role: "blocks" (global KV) or "snapshots" (SWA); backend: "mooncake" or "redis"."""

    def __init__(self, registry: MetricsRegistry, prefix: str = "dsv41_cache_remote_"):
        r, p = registry, prefix
        self.hits = r.counter(p + "hits_total", "values found and verified", ["role"])
        self.misses = r.counter(p + "misses_total", "values looked up and not served (absent, unverified, fault)",
                                ["role"])
        self.bytes_read = r.counter(p + "bytes_read_total", "verified payload bytes served", ["role"])
        self.bytes_written = r.counter(p + "bytes_written_total", "value bytes put", ["role"])
        self.writes = r.counter(p + "writes_total", "values put", ["role"])
        self.seconds = r.histogram(p + "seconds", "one remote call, deadline included", ["backend", "op"],
                                   buckets=LATENCY_BUCKETS_S)
        self.verify_failures = r.counter(p + "verify_failures_total",
                                         "values that failed verification (never served), by kind",
                                         ["role", "kind"])
        self.expired = r.counter(p + "expired_total", "values older than the TTL (backends without TTL)", ["role"])
        self.errors = r.counter(p + "errors_total", "calls that did not complete, by cause", ["backend", "cause"])
        self.breaker_state = r.gauge(p + "breaker_state", "0 closed, 1 open, 2 half-open", ["backend"])
        self.dropped_writes = r.counter(p + "dropped_writes_total", "writes not done, by cause", ["role", "cause"])
        self.queue_depth = r.gauge(p + "write_queue_depth", "writes waiting for the background writer")
        self.verify_seconds = r.histogram(p + "verify_seconds", "verifying one lookup's values")

    @classmethod
    def of(cls, registry: MetricsRegistry) -> "RemoteMetrics":
        """The registry's one RemoteMetrics (caches sharing a registry share it)."""
        rm = getattr(registry, "_dsv41_remote_metrics", None)
        if rm is None:
            rm = cls(registry)
            registry._dsv41_remote_metrics = rm
        return rm
