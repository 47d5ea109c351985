"""The HTTP side: FastAPI routes in OpenAI's shapes over an EngineLoop.

    app = create_app(loop, tokenizer, model_name="v41-tiny")
    POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events)
    GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text)

A handler validates, tokenizes and checks the context limit (400 naming the field), checks
the model name (404), enqueues its choices (503 when the bounded queue is full) and then
only streams what the engine loop sends back. When the client goes away (a closed stream,
or a dropped connection while waiting for a non-streamed answer) the handler aborts its
engine requests, which release every cache reference they held.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import SamplingParams
from .generation import Generation, Piece
from .loop import EngineFailed, EngineLoop, Overloaded
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .tokenizer import TemplateError

__all__ = ["create_app", "NAMESPACE_HEADER"]

NAMESPACE_HEADER = "x-cache-namespace"
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class _CountRequests:
    """Pure ASGI middleware (it does not buffer streams): requests per endpoint and status."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.http_requests.inc(endpoint=endpoint, status=str(message["status"]))
            await send(message)

        await self.app(scope, receive, counted)


def _param(loc) -> str | None:
    parts = [p for p in loc if p != "body"]
    if not parts:
        return None
    out = str(parts[0])
    for p in parts[1:]:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("str", "int", "list[int]", "list[str]", "list[list[int]]") or "[" in str(p):
            break                # pydantic names the union member it tried; not a field
        else:
            out += f".{p}"
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(loop: EngineLoop, tokenizer, *, model_name: str) -> FastAPI:
    engine = loop.engine
    max_context = engine.model.config.max_position_embeddings
    vocab = engine.model.config.vocab_size
    created = int(time.time())
    app = FastAPI(title="dsv41", docs_url=None, redoc_url=None)
    app.add_middleware(_CountRequests, metrics=loop.metrics)
    app.state.loop = loop
    app.state.tokenizer = tokenizer

    # ---- errors -------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = _param(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            return JSONResponse(APIError(400, f"the body is not valid JSON: {err.get('msg')}").body(), 400)
        if err.get("type") == "extra_forbidden":
            msg = f"Unrecognized request argument supplied: {param}"
        elif err.get("type") == "missing":
            msg = f"Missing required parameter: {param}"
        else:
            msg = f"Invalid value for {param}: {err.get('msg')}" if param else str(err.get("msg"))
        return JSONResponse(APIError(400, msg, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    # ---- shared steps -------------------------------------------------------------------

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{model_name}`).",
                           param="model", code="model_not_found")

    def namespace(body, request: Request) -> str:
        header = request.headers.get(NAMESPACE_HEADER)
        if body.cache_salt is not None and header is not None and body.cache_salt != header:
            raise APIError(400, f"cache_salt and the {NAMESPACE_HEADER} header name different tenants",
                           param="cache_salt")
        return body.cache_salt if body.cache_salt is not None else (header or "")

    def check_prompt(ids: list[int], max_new: int | None, param: str) -> int:
        """The checked max_new_tokens (None: what the context leaves)."""
        if not ids:
            raise APIError(400, f"{param} must not be empty", param=param)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in {param} is outside the vocabulary [0, {vocab})", param=param)
        if len(ids) >= max_context or (max_new is not None and len(ids) + max_new > max_context):
            want = f" + {max_new} to generate" if max_new is not None else ""
            raise APIError(400, f"This model's maximum context length is {max_context} tokens. However, "
                           f"you requested {len(ids)}{want} ({len(ids)} in the {param}).",
                           param=param if max_new is None or len(ids) >= max_context else "max_tokens",
                           code="context_length_exceeded")
        return max_new if max_new is not None else max_context - len(ids)

    def sampling(body, max_new: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                              max_new_tokens=max_new, stop_token_ids=tokenizer.eos_token_ids,
                              logprobs=logprobs)

    def start(body, request, prompts, params, prefix) -> Generation:
        try:
            return Generation(loop, tokenizer, prompts, params, n=body.n, stops=body.stop,
                              namespace=namespace(body, request), prefix=prefix)
        except Overloaded as e:
            raise APIError(503, f"The server is overloaded ({e}); retry later.", code="overloaded") from None

    async def collect(gen: Generation, request: Request) -> dict[int, list[Piece]] | None:
        """Every piece of every choice; None (and the choices aborted) if the client
        disconnects first."""
        out: dict[int, list[Piece]] = {c.index: [] for c in gen.choices}

        async def run():
            async for p in gen.pieces():
                out[p.index].append(p)

        work = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            gen.cancel()
        if not work.done() or work.cancelled():
            return None
        exc = work.exception()
        if isinstance(exc, ValueError):
            raise APIError(400, str(exc))
        if exc is not None:
            raise APIError(500, str(exc), code="engine_error")
        return out

    def streamed(gen: Generation, chunks, include_usage: bool, make) -> StreamingResponse:
        async def events():
            try:
                for c in chunks():
                    yield _sse(c)
                async for p in gen.pieces():
                    yield _sse(make(p))
                if include_usage:
                    yield _sse(make(None))
                yield "data: [DONE]\n\n"
            except (EngineFailed, ValueError) as e:
                yield _sse(APIError(500, str(e), code="engine_error").body())
            finally:
                gen.cancel()          # a client that went away aborts what is left
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ---- logprobs in the two shapes -----------------------------------------------------

    def completion_logprobs(pieces: list[Piece]) -> dict:
        lps = [lp for p in pieces for lp in p.logprobs]
        return {"tokens": [tokenizer.token_text(lp.token) for lp in lps],
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{tokenizer.token_text(t): v for t, v in lp.top} for lp in lps],
                "text_offset": [o for p in pieces for o in p.text_offsets]}

    def chat_logprobs(pieces: list[Piece]) -> dict:
        def entry(t, v):
            return {"token": tokenizer.token_text(t), "logprob": v, "bytes": tokenizer.token_bytes(t)}
        return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for p in pieces for lp in p.logprobs]}

    # ---- routes -------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check()
        check_model(body.model)
        p = body.prompt
        if isinstance(p, str):
            prompts = [tokenizer.encode(p)]
        elif p and isinstance(p[0], int):
            prompts = [list(p)]
        else:
            prompts = [tokenizer.encode(x) if isinstance(x, str) else list(x) for x in p]
        # max_tokens null: what the context leaves after the longest prompt
        max_new = min(check_prompt(ids, body.max_tokens, "prompt") for ids in prompts)
        params = sampling(body, max_new, body.logprobs)
        gen = start(body, request, prompts, params, "cmpl")
        rid, now = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": now, "model": model_name}
        want_lp = body.logprobs is not None

        if body.stream:
            def make(piece: Piece | None) -> dict:
                if piece is None:
                    return {**head, "choices": [], "usage": gen.usage()}
                ch = {"index": piece.index, "text": piece.text,
                      "logprobs": completion_logprobs([piece]) if want_lp else None,
                      "finish_reason": piece.finish_reason}
                return {**head, "choices": [ch], **({"usage": None} if body.include_usage else {})}
            return streamed(gen, lambda: [], body.include_usage, make)

        out = await collect(gen, request)
        if out is None:
            return Response(status_code=499)      # client closed the request: nobody reads this
        choices = [{"index": i, "text": "".join(p.text for p in ps),
                    "logprobs": completion_logprobs(ps) if want_lp else None,
                    "finish_reason": ps[-1].finish_reason if ps else None} for i, ps in out.items()]
        return {**head, "choices": choices, "usage": gen.usage()}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check()
        check_model(body.model)
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.render_chat(messages, add_generation_prompt=True)
        except TemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        max_new = check_prompt(ids, body.max_new_tokens, "messages")
        top = body.top_logprobs or 0
        gen = start(body, request, [ids], sampling(body, max_new, top if body.logprobs else None), "chatcmpl")
        rid, now = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": now, "model": model_name}

        if body.stream:
            chunk = {**head, "object": "chat.completion.chunk"}
            extra = {"usage": None} if body.include_usage else {}

            def first():
                return [{**chunk, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}], **extra}
                        for c in gen.choices]

            def make(piece: Piece | None) -> dict:
                if piece is None:
                    return {**chunk, "choices": [], "usage": gen.usage()}
                ch = {"index": piece.index, "delta": {"content": piece.text} if piece.text else {},
                      "logprobs": chat_logprobs([piece]) if body.logprobs else None,
                      "finish_reason": piece.finish_reason}
                return {**chunk, "choices": [ch], **extra}
            return streamed(gen, first, body.include_usage, make)

        out = await collect(gen, request)
        if out is None:
            return Response(status_code=499)
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(p.text for p in ps)},
                    "logprobs": chat_logprobs(ps) if body.logprobs else None,
                    "finish_reason": ps[-1].finish_reason if ps else None} for i, ps in out.items()]
        return {**head, "choices": choices, "usage": gen.usage()}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "dsv41",
                "max_model_len": max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card()

    @app.get("/health")
    async def health():
        if not loop.alive:
            raise APIError(503, "the engine loop is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text = loop.metrics.to_prometheus()
        if engine.cache is not None:
            text += engine.cache.metrics.to_prometheus()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
