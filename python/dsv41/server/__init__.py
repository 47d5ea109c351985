"""`dsv41 serve`: an OpenAI-compatible HTTP server over the engine (docs/serve.md).

    protocol     request bodies (pydantic, strict), their checks, OpenAI's error JSON
    tenancy      API keys, tenants, cache namespaces, who may see cached_tokens
    tokenizer    a checkpoint's tokenizer.json + chat template, or the byte-level tokenizer
    loop         EngineLoop: the one engine thread; continuous batching, bounded queue
    generation   one request's choices: detokenizing, stop strings, logprobs, usage
    metrics      dsv41_server_*, dsv41_engine_*, KV pools, process_* (Prometheus text)
    fingerprint  system_fingerprint: the weights and the build
    app          middleware and one function per route
    transport    uvicorn with read timeouts, a connection limit, a body bound, a drain
    cli          `dsv41 serve` and Server (model, cache, engine, loop, app)

FastAPI and uvicorn are imported only here: `pip install dsv41[serve]`.
"""
from __future__ import annotations

from .cli import ServeOptions, Server, build_server

__all__ = ["ServeOptions", "Server", "build_server"]
