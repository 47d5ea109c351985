"""Cache metrics: a small thread-safe registry of counters, gauges and histograms, exposed as
a Python dict (`to_dict`) and in the Prometheus text exposition format (`to_prometheus`).

`CacheMetrics` declares every metric the cache tiers report (docs/cache.md lists them);
each tier takes one and records into it, so a server exposes one registry for all tiers.
"""
from __future__ import annotations

import math
import threading
from typing import Iterable

__all__ = ["Counter", "Gauge", "Histogram", "MetricsRegistry", "CacheMetrics",
           "LATENCY_BUCKETS_S"]

# Seconds: 10 us .. 10 s, roughly x2.5 per step.
LATENCY_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                     2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1 << 53):
        return str(int(v))
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Iterable[str], lock: threading.Lock):
        self.name, self.help = name, help
        self.labelnames = tuple(labelnames)
        self._lock = lock
        self._values: dict[tuple[str, ...], object] = {}

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {sorted(self.labelnames)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def _label_str(self, key: tuple[str, ...], extra: tuple[tuple[str, str], ...] = ()) -> str:
        pairs = list(zip(self.labelnames, key)) + list(extra)
        if not pairs:
            return ""
        return "{" + ",".join(f'{n}="{_escape(v)}"' for n, v in pairs) + "}"

    @staticmethod
    def _dict_key(names: tuple[str, ...], key: tuple[str, ...]) -> str:
        return ",".join(f"{n}={v}" for n, v in zip(names, key))


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0)

    def total(self) -> float:
        with self._lock:
            return sum(self._values.values())


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = value

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help, labelnames, lock, buckets=LATENCY_BUCKETS_S):
        super().__init__(name, help, labelnames, lock)
        self.buckets = tuple(sorted(buckets))

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            st = self._values.get(key)
            if st is None:
                st = self._values[key] = {"counts": [0] * (len(self.buckets) + 1), "sum": 0.0, "count": 0}
            i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
            st["counts"][i] += 1
            st["sum"] += value
            st["count"] += 1

    def snapshot(self, **labels: str) -> dict:
        with self._lock:
            st = self._values.get(self._key(labels))
            return self._export(st)

    def _export(self, st) -> dict:
        if st is None:
            return {"count": 0, "sum": 0.0, "buckets": {}}
        cum, out = 0, {}
        for b, c in zip(list(self.buckets) + [math.inf], st["counts"]):
            cum += c
            out[_fmt(b)] = cum
        return {"count": st["count"], "sum": st["sum"], "buckets": out}


class MetricsRegistry:
    def __init__(self):
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Counter:
        return self._add(Counter(name, help, labelnames, self._lock))

    def gauge(self, name: str, help: str, labelnames: Iterable[str] = ()) -> Gauge:
        return self._add(Gauge(name, help, labelnames, self._lock))

    def histogram(self, name: str, help: str, labelnames: Iterable[str] = (),
                  buckets: Iterable[float] = LATENCY_BUCKETS_S) -> Histogram:
        return self._add(Histogram(name, help, labelnames, self._lock, buckets))

    def to_dict(self) -> dict:
        """{name: value} without labels, {name: {"label=value,...": value}} with labels;
        histograms as {"count", "sum", "buckets": {le: cumulative count}}."""
        out: dict = {}
        with self._lock:
            for m in self._metrics.values():
                if isinstance(m, Histogram):
                    vals = {k: m._export(v) for k, v in m._values.items()}
                else:
                    vals = dict(m._values)
                if not m.labelnames:
                    out[m.name] = vals.get((), m._export(None) if isinstance(m, Histogram) else 0)
                else:
                    out[m.name] = {m._dict_key(m.labelnames, k): v for k, v in sorted(vals.items())}
        return out

    def to_prometheus(self) -> str:
        lines: list[str] = []
        with self._lock:
            for m in self._metrics.values():
                lines.append(f"# HELP {m.name} {m.help.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}")
                lines.append(f"# TYPE {m.name} {m.kind}")
                items = sorted(m._values.items())
                if not items and not m.labelnames:
                    items = [((), None)]
                for key, v in items:
                    if isinstance(m, Histogram):
                        st = m._export(v)
                        for le, c in st["buckets"].items() or {"+Inf": 0}.items():
                            lines.append(f"{m.name}_bucket{m._label_str(key, (('le', le),))} {c}")
                        lines.append(f"{m.name}_sum{m._label_str(key)} {_fmt(st['sum'])}")
                        lines.append(f"{m.name}_count{m._label_str(key)} {st['count']}")
                    else:
                        lines.append(f"{m.name}{m._label_str(key)} {_fmt(v or 0)}")
        return "\n".join(lines) + "\n"


class CacheMetrics:
    """Every metric of the cache tiers, under the prefix dsv41_cache_.

    Tiers: "gpu" (GlobalKVPool), "swa" (SwaSnapshotPool), "ssd" (PersistentStore).
    Eviction causes: capacity (LRU under a byte cap), ttl, corruption (failed checksum or
    header, truncated), missing (file gone), orphan (its parent block is gone), explicit.
    """

    def __init__(self, registry: MetricsRegistry | None = None, prefix: str = "dsv41_cache_"):
        r = self.registry = registry or MetricsRegistry()
        p = prefix
        self.lookups = r.counter(p + "lookups_total", "prefix lookups")
        self.lookup_tokens = r.counter(p + "lookup_tokens_total", "tokens asked for by lookups")
        self.hit_tokens = r.counter(p + "hit_tokens_total", "tokens served from a tier by lookups", ["tier"])
        self.hit_rate = r.gauge(p + "hit_rate", "hit_tokens_total / lookup_tokens_total per tier", ["tier"])
        self.inserted_blocks = r.counter(p + "inserted_blocks_total", "blocks or snapshots added to a tier", ["tier"])
        self.bytes_read = r.counter(p + "bytes_read_total", "payload bytes read from a tier", ["tier"])
        self.bytes_written = r.counter(p + "bytes_written_total", "bytes written to a tier", ["tier"])
        self.evictions = r.counter(p + "evictions_total", "entries removed from a tier", ["tier", "cause"])
        self.checksum_failures = r.counter(p + "checksum_failures_total",
                                           "persistent records that failed verification on read, by kind", ["kind"])
        self.read_errors = r.counter(p + "read_errors_total",
                                     "reads that failed without proving a record damaged (an I/O error, a short "
                                     "read, a file that would not open, the device path): a miss, nothing removed",
                                     ["tier", "kind"])
        self.collisions = r.counter(p + "collisions_total",
                                    "hash matches whose token ids or key differed (a miss, never served)", ["tier"])
        self.persist_failures = r.counter(p + "persist_failures_total",
                                          "batches that could not be persisted", ["cause"])
        self.promotions = r.counter(p + "promoted_blocks_total", "SSD blocks copied into the GPU pool")
        self.entries = r.gauge(p + "entries", "blocks or snapshots held", ["tier"])
        self.bytes = r.gauge(p + "bytes", "bytes held", ["tier"])
        self.lookup_seconds = r.histogram(p + "lookup_seconds", "PrefixCache.match latency")
        self.ssd_read_seconds = r.histogram(p + "ssd_read_seconds", "one batched, verified SSD read")
        self.ssd_commit_seconds = r.histogram(p + "ssd_commit_seconds", "one SSD batch commit (write + fsync + publish)")
        self.snapshot_seconds = r.histogram(p + "snapshot_seconds", "SWA snapshot put/get", ["op"])
        self.recovery_seconds = r.gauge(p + "recovery_seconds", "time to rebuild the SSD index on open")

    def record_lookup(self, asked: int, hits: dict[str, int]) -> None:
        self.lookups.inc()
        self.lookup_tokens.inc(asked)
        total = self.lookup_tokens.value()
        for tier, n in hits.items():
            self.hit_tokens.inc(n, tier=tier)
            self.hit_rate.set(self.hit_tokens.value(tier=tier) / total if total else 0.0, tier=tier)

    def to_dict(self) -> dict:
        return self.registry.to_dict()

    def to_prometheus(self) -> str:
        return self.registry.to_prometheus()
