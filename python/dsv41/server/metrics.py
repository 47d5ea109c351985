"""The server's and the engine's metrics (Prometheus names dsv41_server_* and
dsv41_engine_*), in the cache's registry type; GET /metrics serves them followed by the
cache's own (dsv41_cache_*: lookups, hits per tier, evictions, promotions, latencies).

Recorded by the engine loop thread from the engine's stream events (TTFT, inter-token
latency, path and cached tokens per request) and by the HTTP handlers (requests per
endpoint and status).
"""
from __future__ import annotations

from ..cache.metrics import MetricsRegistry

__all__ = ["ServerMetrics", "TTFT_BUCKETS_S", "TOKEN_BUCKETS_S"]

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
        self.e2e = r.histogram(s + "request_seconds", "arrival at the engine -> last token",
                               buckets=TTFT_BUCKETS_S)
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

    def to_prometheus(self) -> str:
        return self.registry.to_prometheus()
