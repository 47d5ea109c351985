"""The HTTP side: FastAPI routes in OpenAI's shapes over an EngineLoop.

    app = create_app(loop, tokenizer, model_name="v41-tiny", tenancy=Tenancy(keys),
                     fingerprint="fp_...", limits=HTTPLimits())
    POST /v1/completions, POST /v1/chat/completions   (stream: server-sent events)
    GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text)

One function per route; what they share (the request's namespace, starting and collecting
a Generation, streaming, logprobs) are the functions below them, and what they check is
protocol.py's. A handler validates (400 naming the field), checks the model name (404),
tokenizes and checks the context (400), enqueues its choices (503 with Retry-After when the
bounded queue is full or the server drains) and then only streams what the engine loop
sends back. When the client goes away (a closed stream, or a dropped connection while
waiting for a non-streamed answer) the handler aborts its engine requests, which release
every cache reference they held.

Middleware, outermost first: requests counted per endpoint and status; API keys (401
before the body is read; the caller's tenant goes into the request's state); the body read
whole within its time and size bounds (transport.BodyLimit).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import SamplingParams
from .generation import Generation, Piece
from .loop import EngineFailed, EngineLoop, Overloaded, ShuttingDown
from .metrics import fallback_metrics, pool_metrics, process_metrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, check_model, check_prompt,
                       send_error, validation_error)
from .tenancy import ANONYMOUS, Tenancy
from .tokenizer import TemplateError
from .transport import BodyLimit, HTTPLimits

__all__ = ["create_app", "NAMESPACE_HEADER"]

NAMESPACE_HEADER = "x-cache-namespace"
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
_SCRAPE_TIMEOUT_S = 5.0      # a scrape waits at most this long for the engine thread


@dataclass
class Serving:
    """What every route needs (app.state.serving)."""

    loop: EngineLoop
    tokenizer: object
    model_name: str
    tenancy: Tenancy
    fingerprint: str
    created: int
    started: float

    @property
    def max_context(self) -> int:
        return self.loop.engine.model.config.max_position_embeddings

    @property
    def vocab(self) -> int:
        return self.loop.engine.model.config.vocab_size


# ---- middleware -------------------------------------------------------------------------

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


class _Authenticate:
    """Every /v1/ request presents an API key when the server has any (401 otherwise,
    before its body is read); its tenant goes into the request's state. /health and
    /metrics stay open, for probes and scrapers (docs/serve.md, "Tenants")."""

    def __init__(self, app, tenancy: Tenancy):
        self.app, self.tenancy = app, tenancy

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = dict(scope["headers"]).get(b"authorization")
            try:
                tenant = self.tenancy.authenticate(auth.decode("latin-1") if auth is not None else None)
            except APIError as e:
                return await send_error(send, e, close=True)
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


# ---- errors -----------------------------------------------------------------------------

async def _api_error(_request, e: APIError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _invalid(_request, e: RequestValidationError):
    err = validation_error(list(e.errors()))
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _http_error(_request, e: StarletteHTTPException):
    err = APIError(e.status_code, str(e.detail))
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, ShuttingDown):
        return APIError(503, f"{e}; retry later", code="shutting_down")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, str(e), code="engine_error")


# ---- routes -----------------------------------------------------------------------------

async def completions(body: CompletionRequest, request: Request):
    sv: Serving = request.app.state.serving
    body.check()
    check_model(body.model, sv.model_name)
    p, tok = body.prompt, sv.tokenizer
    if isinstance(p, str):
        prompts = [tok.encode(p)]
    elif p and isinstance(p[0], int):
        prompts = [list(p)]
    else:
        prompts = [tok.encode(x) if isinstance(x, str) else list(x) for x in p]
    # max_tokens null: what the context leaves after the longest prompt
    max_new = min(check_prompt(ids, body.max_tokens, "prompt", vocab=sv.vocab, max_context=sv.max_context)
                  for ids in prompts)
    namespace, own = _namespace(sv, body, request)
    gen = _start(sv, body, namespace, prompts, _sampling(sv, body, max_new, body.logprobs), "cmpl")
    head = _head(sv, "cmpl", "text_completion")
    want_lp = body.logprobs is not None

    if body.stream:
        def make(piece: Piece | None) -> dict:
            if piece is None:
                return {**head, "choices": [], "usage": gen.usage(own)}
            ch = {"index": piece.index, "text": piece.text,
                  "logprobs": _completion_logprobs(tok, [piece]) if want_lp else None,
                  "finish_reason": piece.finish_reason}
            return {**head, "choices": [ch], **({"usage": None} if body.include_usage else {})}
        return _streamed(gen, [], body.include_usage, make)

    out = await _collect(gen, request)
    if out is None:
        return Response(status_code=499)      # client closed the request: nobody reads this
    choices = [{"index": i, "text": "".join(p.text for p in ps),
                "logprobs": _completion_logprobs(tok, ps) if want_lp else None,
                "finish_reason": ps[-1].finish_reason if ps else None} for i, ps in out.items()]
    return {**head, "choices": choices, "usage": gen.usage(own)}


async def chat_completions(body: ChatCompletionRequest, request: Request):
    sv: Serving = request.app.state.serving
    body.check()
    check_model(body.model, sv.model_name)
    tok = sv.tokenizer
    messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
    try:
        text = tok.render_chat(messages, add_generation_prompt=True)
    except TemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    ids = tok.encode(text, add_special_tokens=False)
    max_new = check_prompt(ids, body.max_new_tokens, "messages", vocab=sv.vocab, max_context=sv.max_context)
    top = body.top_logprobs or 0
    namespace, own = _namespace(sv, body, request)
    gen = _start(sv, body, namespace, [ids], _sampling(sv, body, max_new, top if body.logprobs else None),
                 "chatcmpl")
    head = _head(sv, "chatcmpl", "chat.completion")

    if body.stream:
        chunk = {**head, "object": "chat.completion.chunk"}
        extra = {"usage": None} if body.include_usage else {}
        first = [{**chunk, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], **extra}
                 for c in gen.choices]

        def make(piece: Piece | None) -> dict:
            if piece is None:
                return {**chunk, "choices": [], "usage": gen.usage(own)}
            ch = {"index": piece.index, "delta": {"content": piece.text} if piece.text else {},
                  "logprobs": _chat_logprobs(tok, [piece]) if body.logprobs else None,
                  "finish_reason": piece.finish_reason}
            return {**chunk, "choices": [ch], **extra}
        return _streamed(gen, first, body.include_usage, make)

    out = await _collect(gen, request)
    if out is None:
        return Response(status_code=499)
    choices = [{"index": i, "message": {"role": "assistant", "content": "".join(p.text for p in ps)},
                "logprobs": _chat_logprobs(tok, ps) if body.logprobs else None,
                "finish_reason": ps[-1].finish_reason if ps else None} for i, ps in out.items()]
    return {**head, "choices": choices, "usage": gen.usage(own)}


async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(request.app.state.serving)]}


async def get_model(name: str, request: Request):
    sv: Serving = request.app.state.serving
    check_model(name, sv.model_name)
    return _model_card(sv)


async def health(request: Request):
    loop = request.app.state.serving.loop
    if not loop.alive:
        raise APIError(503, "the server is shutting down" if loop.draining else "the engine loop is not running")
    return {"status": "ok"}


async def metrics(request: Request):
    sv: Serving = request.app.state.serving
    loop = sv.loop
    text = loop.metrics.to_prometheus()
    if loop.running:
        try:
            pools = await asyncio.wait_for(loop.call(lambda e: e.memory_stats()), _SCRAPE_TIMEOUT_S)
            text += pool_metrics(pools)
        except asyncio.TimeoutError:
            pass                              # a step longer than the scrape's patience: no pool lines
    text += process_metrics(sv.started)
    text += fallback_metrics()
    if loop.engine.cache is not None:
        text += loop.engine.cache.metrics.to_prometheus()
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


# ---- what the routes share --------------------------------------------------------------

def _namespace(sv: Serving, body, request: Request) -> tuple[str, bool]:
    """The request's cache namespace (its tenant's, salted by cache_salt or the header) and
    whether its usage may report cached_tokens (server/tenancy.py)."""
    header = request.headers.get(NAMESPACE_HEADER) or None
    if body.cache_salt is not None and header is not None and body.cache_salt != header:
        raise APIError(400, f"cache_salt and the {NAMESPACE_HEADER} header name different tenants",
                       param="cache_salt")
    salt = body.cache_salt if body.cache_salt is not None else header
    tenant = getattr(request.state, "tenant", ANONYMOUS)
    return sv.tenancy.namespace(tenant, salt)


def _sampling(sv: Serving, body, max_new: int, logprobs: int | None) -> SamplingParams:
    return SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                          max_new_tokens=max_new,
                          stop_token_ids=() if body.ignore_eos else sv.tokenizer.eos_token_ids,
                          logprobs=logprobs)


def _start(sv: Serving, body, namespace: str, prompts, params, prefix) -> Generation:
    try:
        return Generation(sv.loop, sv.tokenizer, prompts, params, n=body.n, stops=body.stop,
                          namespace=namespace, prefix=prefix)
    except Overloaded as e:
        raise APIError(503, f"The server is overloaded ({e}); retry later.", code="overloaded") from None
    except ShuttingDown as e:
        raise _engine_error(e) from None


def _head(sv: Serving, prefix: str, obj: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "object": obj, "created": int(time.time()),
            "model": sv.model_name, "system_fingerprint": sv.fingerprint}


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(gen: Generation, request: Request) -> dict[int, list[Piece]] | None:
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
    if work.exception() is not None:
        raise _engine_error(work.exception())
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _streamed(gen: Generation, first: list[dict], include_usage: bool, make) -> StreamingResponse:
    async def events():
        try:
            for c in first:
                yield _sse(c)
            async for p in gen.pieces():
                yield _sse(make(p))
            if include_usage:
                yield _sse(make(None))
            yield "data: [DONE]\n\n"
        except (EngineFailed, ValueError) as e:
            yield _sse(_engine_error(e).body())
        finally:
            gen.cancel()          # a client that went away aborts what is left
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _completion_logprobs(tok, pieces: list[Piece]) -> dict:
    lps = [lp for p in pieces for lp in p.logprobs]
    return {"tokens": [tok.token_text(lp.token) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{tok.token_text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": [o for p in pieces for o in p.text_offsets]}


def _chat_logprobs(tok, pieces: list[Piece]) -> dict:
    def entry(t, v):
        return {"token": tok.token_text(t), "logprob": v, "bytes": tok.token_bytes(t)}
    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for p in pieces for lp in p.logprobs]}


def _model_card(sv: Serving) -> dict:
    return {"id": sv.model_name, "object": "model", "created": sv.created, "owned_by": "dsv41",
            "max_model_len": sv.max_context}


# ---- the app ----------------------------------------------------------------------------

def create_app(loop: EngineLoop, tokenizer, *, model_name: str, tenancy: Tenancy | None = None,
               fingerprint: str = "", limits: HTTPLimits | None = None) -> FastAPI:
    app = FastAPI(title="dsv41", docs_url=None, redoc_url=None, openapi_url=None)
    now = time.time()
    app.state.serving = Serving(loop, tokenizer, model_name, tenancy or Tenancy(), fingerprint,
                                created=int(now), started=now)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{name:path}", get_model, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    # add_middleware wraps what is there: the last added runs first
    app.add_middleware(BodyLimit, limits=limits or HTTPLimits())
    app.add_middleware(_Authenticate, tenancy=app.state.serving.tenancy)
    app.add_middleware(_CountRequests, metrics=loop.metrics)
    return app
