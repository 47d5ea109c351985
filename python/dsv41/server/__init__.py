"""`dsv41 serve`: an OpenAI-compatible HTTP server over the engine (docs/serve.md).

    protocol     request bodies (pydantic) and OpenAI's error JSON
    tokenizer    a checkpoint's tokenizer.json + chat template, or the byte-level tokenizer
    loop         EngineLoop: the one engine thread; continuous batching, bounded queue
    generation   one request's choices: detokenizing, stop strings, logprobs, usage
    metrics      dsv41_server_* and dsv41_engine_* (Prometheus text with the cache's)
    app          the FastAPI routes
    cli          `dsv41 serve` and Server (model, cache, engine, loop, app)

FastAPI and uvicorn are imported only here: `pip install dsv41[serve]`.
"""
from __future__ import annotations

from .cli import ServeOptions, Server, build_server

__all__ = ["ServeOptions", "Server", "build_server"]
