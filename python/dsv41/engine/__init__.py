"""The serving engine: requests through the tiered prefix cache with bounded replay.

    request      SamplingParams, Request, RequestStats, RequestOutput, StreamEvent
    sequence     one request's runtime state
    scheduler    which prefill chunks and decodes go into a step
    runtime      where KV lives and how a step runs: the paged runtime (paged_kv: the page
                 pool and slots; paged_runner: the batched step, decode CUDA graphs) or the
                 per-sequence reference runtime
    prefix       cache lookup -> replay plan -> state; exact write-back
    sampler      greedy / temperature / top-p, seeded per request
    engine       Engine: add_request, step, generate, stream, metrics
    demo         the `dsv41 demo` agent workload
"""
from __future__ import annotations

from ..replay import ReplayConfig
from .engine import Engine
from .request import Request, RequestOutput, RequestStats, SamplingParams, StreamEvent, TokenLogprob

__all__ = ["Engine", "ReplayConfig", "SamplingParams", "Request", "RequestOutput", "RequestStats",
           "StreamEvent", "TokenLogprob"]
