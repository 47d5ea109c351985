"""The serving engine: requests through the tiered prefix cache with bounded replay.

    request      SamplingParams, Request, RequestStats, RequestOutput, StreamEvent
    sequence     one request's runtime state
    scheduler    which prefills and decodes go into a step
    prefix       cache lookup -> replay plan -> state; exact write-back
    runner       one model call per step (extend_batch)
    sampler      greedy / temperature / top-p, seeded per request
    llm_engine   Engine: add_request, step, generate, stream, metrics
    demo         the `dsv41 demo` agent workload
"""
from __future__ import annotations

from ..replay import ReplayConfig
from .llm_engine import Engine
from .request import Request, RequestOutput, RequestStats, SamplingParams, StreamEvent, TokenLogprob

__all__ = ["Engine", "ReplayConfig", "SamplingParams", "Request", "RequestOutput", "RequestStats",
           "StreamEvent", "TokenLogprob"]
