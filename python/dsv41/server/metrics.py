"""The server's and the engine's metrics (Prometheus names dsv41_server_* and
dsv41_engine_*), in the cache's registry type; GET /metrics serves them followed by the
KV pools' usage, the process's standard metrics (process_*) and the cache's own
(dsv41_cache_*: lookups, hits per tier, evictions, promotions, latencies).

Recorded by the engine loop thread from the engine's stream events (TTFT, queue, prefill
and decode time, inter-token latency, path and cached tokens per request) and by the HTTP
handlers (requests per endpoint and status). The pools' usage is read from
`Engine.memory_stats()` at each scrape, on the engine thread; the process's from /proc.
"""
from __future__ import annotations

import os
import resource

from ..cache.metrics import MetricsRegistry
from ..ops.fallbacks import fallbacks

__all__ = ["ServerMetrics", "TTFT_BUCKETS_S", "TOKEN_BUCKETS_S", "fallback_metrics", "pool_metrics",
           "process_metrics"]

TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                  30.0, 60.0)
TOKEN_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, registry: MetricsRegistry | None = None):
        r = self.registry = registry or MetricsRegistry()
        s, e = "dsv41_server_", "dsv41_engine_"
        self.http_requests = r.counter(s + "http_requests_total", "HTTP requests answered",
                                       ["endpoint", "status"])
        self.pending = r.gauge(s + "pending_requests", "requests (choices) accepted and not finished")
        self.rejected = r.counter(s + "rejected_requests_total", "requests refused because the queue was full")
        self.ttft = r.histogram(s + "time_to_first_token_seconds", "arrival at the engine -> first token",
                                buckets=TTFT_BUCKETS_S)
        self.token_latency = r.histogram(s + "inter_token_latency_seconds", "between output tokens of a request",
                                         buckets=TOKEN_BUCKETS_S)
        self.e2e = r.histogram(s + "request_seconds", "arrival at the engine -> last token (completed requests)",
                               buckets=TTFT_BUCKETS_S)
        self.queue_time = r.histogram(e + "request_queue_seconds", "arrival at the engine -> its prefill step starts",
                                      buckets=TTFT_BUCKETS_S)
        self.prefill_time = r.histogram(e + "request_prefill_seconds", "the prefill step's model time",
                                        buckets=TTFT_BUCKETS_S)
        self.decode_time = r.histogram(e + "request_decode_seconds", "first -> last output token (completed "
                                       "requests)", buckets=TTFT_BUCKETS_S)
        self.finished = r.counter(e + "requests_finished_total", "requests ended, by reason", ["reason"])
        self.paths = r.counter(e + "requests_by_path_total", "prefills by cache path (cold, both_hit, "
                               "encoder_replay, recompute)", ["path"])
        self.prompt_tokens = r.counter(e + "prompt_tokens_total", "prompt tokens of prefilled requests")
        self.cached_tokens = r.counter(e + "cached_prompt_tokens_total",
                                       "prompt tokens served from the prefix cache (not computed)")
        self.prefill_tokens = r.counter(e + "prefill_tokens_total", "tokens run through the model by prefills")
        self.replayed_tokens = r.counter(e + "replayed_tokens_total", "cached tokens replayed to rebuild SWA state")
        self.hit_tokens = r.counter(e + "prompt_hit_tokens_total", "prompt tokens found per cache tier", ["tier"])
        self.generation_tokens = r.counter(e + "generation_tokens_total", "output tokens sampled")
        self.steps = r.counter(e + "steps_total", "engine steps (one model call each)")
        self.step_seconds = r.histogram(e + "step_seconds", "one engine step", buckets=TOKEN_BUCKETS_S + (5.0, 10.0))
        self.running = r.gauge(e + "running_requests", "sequences decoding")
        self.waiting = r.gauge(e + "waiting_requests", "sequences waiting for admission")
        self.errors = r.counter(e + "step_errors_total", "engine steps that raised (their requests failed)")
        self.preemptions = r.counter(e + "preemptions_total", "running sequences sent back to waiting "
                                     "(their KV freed) to make room")
        self.info = r.gauge(s + "info", "constant 1; the labels say what is served", ["model", "system_fingerprint",
                                                                                   "version"])

    def to_prometheus(self) -> str:
        return self.registry.to_prometheus()


def _gauge_lines(name: str, help: str, samples: list[tuple[str, float]], kind: str = "gauge") -> list[str]:
    lines = [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {_num(v)}" for labels, v in samples]
    return lines


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _labels(**kv: str) -> str:
    esc = {k: str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in kv.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


def pool_metrics(stats: dict[str, dict]) -> str:
    """Prometheus text for `Engine.memory_stats()`: every pool it returns, every numeric
    field of each (used, free, total, and whatever else the pool reports) as
    dsv41_engine_kv_pool{pool, unit, state}, and used / total as
    dsv41_engine_kv_pool_usage_ratio{pool} (vLLM's kv_cache_usage_perc, as a ratio)."""
    sizes, ratios = [], []
    for pool, st in sorted(stats.items()):
        unit = str(st.get("unit", ""))
        for field, v in st.items():
            if field != "unit" and isinstance(v, (int, float)) and not isinstance(v, bool):
                sizes.append((_labels(pool=pool, unit=unit, state=field), v))
        if st.get("total"):
            ratios.append((_labels(pool=pool), st.get("used", 0) / st["total"]))
    lines = _gauge_lines("dsv41_engine_kv_pool", "KV memory per pool and state (used, free, total, ...), "
                         "in the pool's unit", sizes)
    lines += _gauge_lines("dsv41_engine_kv_pool_usage_ratio", "used / total per KV pool", ratios)
    return "\n".join(lines) + "\n"


def fallback_metrics() -> str:
    """Prometheus text for `dsv41.ops.fallbacks`: CUDA calls that ran the generic kernel
    where a tensor-core kernel was wanted, per op and reason (each kind is also logged once)."""
    samples = [(_labels(op=op, reason=reason), n) for op, reason, n in fallbacks.items()]
    lines = _gauge_lines("dsv41_kernel_fallbacks_total", "CUDA calls that fell back to a generic "
                         "kernel, per op and reason", samples, kind="counter")
    return "\n".join(lines) + "\n"


def _proc_stat() -> tuple[float, float] | None:
    """(CPU seconds, start time in seconds since the epoch) from /proc, or None off Linux."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            btime = next(float(x.split()[1]) for x in f if x.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    # fields[0] is field 3 (state): utime is field 14, stime 15, starttime 22
    return (int(fields[11]) + int(fields[12])) / ticks, btime + int(fields[19]) / ticks


def process_metrics(started: float) -> str:
    """The process metrics every Prometheus client exports (prometheus_client's names):
    resident and virtual memory, CPU seconds, open and maximum fds, start time. `started`
    (time.time() at start-up) stands in for the start time where /proc is missing."""
    out: list[tuple[str, str, float, str]] = []
    st = _proc_stat()
    if st is not None:
        cpu, start = st
    else:
        t = os.times()
        cpu, start = t.user + t.system, started
    out.append(("process_cpu_seconds_total", "user and system CPU time, seconds", cpu, "counter"))
    out.append(("process_start_time_seconds", "start time since the epoch, seconds", start, "gauge"))
    try:
        with open("/proc/self/statm") as f:
            pages = f.read().split()
        page = os.sysconf("SC_PAGE_SIZE")
        out.append(("process_virtual_memory_bytes", "virtual memory size, bytes", int(pages[0]) * page, "gauge"))
        out.append(("process_resident_memory_bytes", "resident memory size, bytes", int(pages[1]) * page, "gauge"))
    except (OSError, IndexError, ValueError):
        pass
    try:
        out.append(("process_open_fds", "open file descriptors", len(os.listdir("/proc/self/fd")), "gauge"))
    except OSError:
        pass
    out.append(("process_max_fds", "the soft limit on open file descriptors",
                resource.getrlimit(resource.RLIMIT_NOFILE)[0], "gauge"))
    lines: list[str] = []
    for name, help, v, kind in out:
        lines += _gauge_lines(name, help, [("", v)], kind)
    return "\n".join(lines) + "\n"
