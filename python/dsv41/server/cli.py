"""`dsv41 serve`: build the model, cache, engine and tokenizer, then run the app on uvicorn.

    dsv41 serve --preset v41-tiny --port 8000                  # synthetic weights, byte tokenizer
    dsv41 serve --model ./ckpt --cache-dir /ssd/dsv41 --port 8000   # a checkpoint; SSD tier
    dsv41 serve --model v41-tiny-tasks                         # a shipped checkpoint, by name
    dsv41 serve --api-key-file keys.txt --require-salt        # tenants (docs/serve.md)

The prefix cache has a GPU-pool tier (host memory without a GPU), the SWA snapshot tier and,
with --cache-dir, the persistent SSD tier; --no-prefix-cache runs without any. SIGTERM and
SIGINT drain for up to --drain-seconds, close the cache (committing queued SSD writes) and
exit 0.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ServeOptions", "Server", "build_server", "add_serve_parser", "options_from_args"]


@dataclass
class ServeOptions:
    model: str | None = None              # a checkpoint directory; None: `preset`
    preset: str = "v41-tiny"
    seed: int = 0                         # synthetic weights
    served_model_name: str | None = None
    device: str | None = None             # None: cuda when available, else cpu
    precision: str | None = None          # None: bf16 (production) on cuda, the reference on cpu
    prefix_cache: bool = True
    cache_dir: str | None = None          # the SSD tier's store; None: no SSD tier
    block_tokens: int = 64
    gpu_cache_mb: int = 1024
    swa_cache_mb: int = 1024
    swa_ttl_s: float = 300.0
    replay: str = "bounded"
    runtime: str = "auto"                 # the engine's runtime: auto (paged when it can), paged, reference
    max_batch: int = 32
    max_prefill_tokens: int = 8192
    max_pending: int = 256
    api_keys: tuple[str, ...] = field(default=(), repr=False)   # each its own tenant
    api_key_file: str | None = None       # KEY [TENANT] per line (server/tenancy.py)
    require_salt: bool = False
    cached_tokens: str = "own"            # "own": only in the caller's own namespace; "always"
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_request_bytes: int = 32 << 20
    max_connections: int = 512
    drain_s: float = 30.0

    def limits(self):
        from .transport import HTTPLimits
        return HTTPLimits(header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s,
                          max_request_bytes=self.max_request_bytes, max_connections=self.max_connections)


class Server:
    """The parts of a running server: engine loop, app, and what to close.

        server = Server(opts); server.serve(host, port)   # until SIGTERM / SIGINT, drained
        server.close()                                    # engine loop, then the cache
    """

    def __init__(self, opts: ServeOptions):
        import torch

        from ..cache import CacheConfig, PrefixCache
        from ..checkpoints import resolve
        from ..config import ModelConfig
        from ..engine import Engine, SamplingParams
        from ..model import Model
        from ..model.production import default_precision
        from .app import create_app
        from .fingerprint import SystemFingerprint
        from .loop import EngineLoop
        from .metrics import ServerMetrics
        from .tenancy import ApiKeys, Tenancy
        from .tokenizer import load_tokenizer

        self.opts = opts
        # before the model loads: a bad key file fails in a moment, not after a long load
        tenancy = Tenancy(ApiKeys.load(opts.api_keys, opts.api_key_file), require_salt=opts.require_salt,
                          cached_tokens=opts.cached_tokens)
        limits = opts.limits()
        device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        # The production path (weights as shipped, bf16 GEMMs) on CUDA; the float64 reference
        # on the CPU (docs/model.md, "Precision"). --precision overrides.
        precision = opts.precision or default_precision(device)
        checkpoint = None
        if opts.model is not None:
            checkpoint = resolve(opts.model)        # a directory, or a shipped checkpoint's name
            model = Model.from_pretrained(checkpoint, device=device, precision=precision)
            name = opts.served_model_name or Path(checkpoint).resolve().name
        else:
            model = Model.synthetic(ModelConfig.preset(opts.preset), seed=opts.seed, device=device,
                                    precision=precision)
            name = opts.served_model_name or opts.preset
        self.cache = None
        if opts.prefix_cache:
            cc = CacheConfig(block_tokens=opts.block_tokens, device=device,
                             gpu_capacity_bytes=opts.gpu_cache_mb << 20,
                             swa_capacity_bytes=opts.swa_cache_mb << 20, swa_ttl_s=opts.swa_ttl_s,
                             store_dir=opts.cache_dir)
            # Keys carry the model's config, KV options and weights identity (the checkpoint's
            # recorded digest, or config + seed for synthetic weights): never another model's KV.
            self.cache = PrefixCache.for_model(model, cc)
        self.engine = Engine(model, cache=self.cache, replay=opts.replay, max_batch=opts.max_batch,
                             max_prefill_tokens=opts.max_prefill_tokens, runtime=opts.runtime)
        # One forward before serving, on a throwaway engine without the cache, so that no
        # client's first request pays torch's one-time set-up.
        Engine(model, runtime=opts.runtime).generate([[0, 1]], SamplingParams(max_new_tokens=2))
        self.tokenizer = load_tokenizer(checkpoint, model.config.vocab_size)
        self.model_name = name
        self.fingerprint = SystemFingerprint.of(model, precision=precision, device=device)
        metrics = ServerMetrics()
        metrics.info.set(1, model=name, system_fingerprint=self.fingerprint.value,
                         version=self.fingerprint.parts["build"]["version"])
        self.loop = EngineLoop(self.engine, metrics, max_pending=opts.max_pending).start()
        self.app = create_app(self.loop, self.tokenizer, model_name=name, tenancy=tenancy,
                              fingerprint=self.fingerprint.value, limits=limits)
        self.http = None

    def http_server(self, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"):
        """The uvicorn server for this app, with the transport's limits and the drain."""
        from .transport import HTTPServer, uvicorn_config

        config = uvicorn_config(self.app, self.opts.limits(), host=host, port=port,
                                drain_s=self.opts.drain_s, log_level=log_level)
        self.http = HTTPServer(config, drain=self.loop.drain, stop=self.loop.stop, drain_s=self.opts.drain_s)
        return self.http

    def serve(self, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
        """Serves until SIGTERM or SIGINT, then drains (the caller closes)."""
        self.http_server(host, port, log_level).run()

    def close(self) -> None:
        """Stops the engine loop (failing what is left) and closes the cache, which
        commits its queued SSD writes."""
        self.loop.close()
        if self.cache is not None:
            self.cache.close()


def build_server(opts: ServeOptions) -> Server:
    return Server(opts)


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    keys = tuple(args.api_key or ())
    if not keys and not args.api_key_file and os.environ.get("DSV41_API_KEY"):
        keys = (os.environ["DSV41_API_KEY"],)
    return ServeOptions(model=args.model, preset=args.preset, seed=args.seed,
                        served_model_name=args.served_model_name, device=args.device,
                        precision=args.precision,
                        prefix_cache=not args.no_prefix_cache, cache_dir=args.cache_dir,
                        block_tokens=args.block_tokens, gpu_cache_mb=args.gpu_cache_mb,
                        swa_cache_mb=args.swa_cache_mb, swa_ttl_s=args.swa_ttl, replay=args.replay,
                        runtime=args.runtime, max_batch=args.max_batch, max_prefill_tokens=args.max_prefill_tokens,
                        max_pending=args.max_pending, api_keys=keys, api_key_file=args.api_key_file,
                        require_salt=args.require_salt, cached_tokens=args.cached_tokens,
                        header_timeout_s=args.timeout_header, body_timeout_s=args.timeout_body,
                        max_request_bytes=args.max_request_bytes, max_connections=args.max_connections,
                        drain_s=args.drain_seconds)


def _run(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    try:
        server = Server(opts)
    except (OSError, ValueError, KeyError) as e:
        print(f"dsv41 serve: {e}", file=sys.stderr)
        return 2
    fp = server.fingerprint
    print(f"dsv41 serve: model {server.model_name!r} ({server.tokenizer.name} tokenizer) on "
          f"http://{args.host}:{args.port}/v1; system_fingerprint {fp.value} (weights "
          f"{fp.parts['weights']['weights_id']}, dsv41 {fp.parts['build']['version']}); "
          f"{len(server.app.state.serving.tenancy.keys)} API keys", file=sys.stderr, flush=True)
    # What start-up built (torch, the model, the recovered SSD index) lives as long as the
    # server: moved out of the cyclic collector's reach, a full collection walks only what
    # came after, so it no longer stalls every thread for a pass over start-up's objects
    # (docs/serve.md, "How a request flows").
    gc.collect()
    gc.freeze()
    try:
        server.serve(args.host, args.port, args.log_level)
    finally:
        server.close()
    return 0


_DAY_S = 86400.0   # the longest timeout or drain --timeout-* and --drain-seconds take


def add_serve_parser(sub) -> None:
    from ..argcheck import FloatRange, IntRange, device, output_dir
    from ..config import preset_names

    d = ServeOptions()
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, prefix cache)")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="a checkpoint directory (config.json, safetensors, "
                     "and tokenizer.json for text) or a shipped checkpoint's name (v41-tiny-tasks)")
    src.add_argument("--preset", default=d.preset, choices=preset_names(),
                     help=f"a built-in config with synthetic weights (default: {d.preset})")
    s.add_argument("--seed", type=IntRange(0, (1 << 63) - 1), default=d.seed, help="synthetic weights' seed")
    s.add_argument("--served-model-name", help="the model id clients send (default: preset or dir name)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=IntRange(0, 65535), default=8000, help="0: any free port")
    s.add_argument("--device", type=device, help="cpu, cuda or cuda:N (default: cuda when available)")
    s.add_argument("--precision", choices=("reference", "bf16"),
                   help="model execution path (default: bf16 on cuda, the float64 reference on cpu)")
    s.add_argument("--cache-dir", metavar="DIR", type=output_dir,
                   help="persistent prefix store (SSD tier); default: none")
    s.add_argument("--no-prefix-cache", action="store_true", help="run without a prefix cache")
    s.add_argument("--block-tokens", type=IntRange(1, 1 << 16), default=d.block_tokens,
                   help="tokens per cache block")
    s.add_argument("--gpu-cache-mb", type=IntRange(1, 1 << 24), default=d.gpu_cache_mb, help="global KV pool size")
    s.add_argument("--swa-cache-mb", type=IntRange(1, 1 << 24), default=d.swa_cache_mb,
                   help="SWA snapshot pool (host RAM)")
    s.add_argument("--swa-ttl", type=FloatRange(0, 1e9), default=d.swa_ttl_s, help="SWA snapshot TTL (s)")
    s.add_argument("--replay", default=d.replay, choices=("bounded", "exact", "off"),
                   help="the path of a prompt whose SWA snapshot is gone (docs/replay.md)")
    s.add_argument("--runtime", default=d.runtime, choices=("auto", "paged", "reference"),
                   help="the engine's runtime: paged (one KV pool, batched steps, CUDA graphs; "
                        "docs/paged.md), reference (per-sequence states), auto (paged when the "
                        "model runs on it)")
    s.add_argument("--max-batch", type=IntRange(1, 1 << 16), default=d.max_batch, help="sequences per step")
    s.add_argument("--max-prefill-tokens", type=IntRange(1, 1 << 24), default=d.max_prefill_tokens,
                   help="prefill tokens per step")
    s.add_argument("--max-pending", type=IntRange(1, 1 << 20), default=d.max_pending,
                   help="requests accepted and unfinished at once; beyond it 503")
    t = s.add_argument_group("tenants (docs/serve.md)")
    t.add_argument("--api-key", nargs="+", action="extend", metavar="KEY",
                   help="accept these keys (Authorization: Bearer KEY), each its own cache namespace; "
                   "$DSV41_API_KEY when neither this nor --api-key-file is given")
    t.add_argument("--api-key-file", metavar="FILE",
                   help="one 'KEY [TENANT]' per line; keys with the same TENANT share a cache namespace")
    t.add_argument("--require-salt", action="store_true",
                   help="refuse requests without cache_salt (or the X-Cache-Namespace header)")
    t.add_argument("--cached-tokens", choices=("own", "always"), default=d.cached_tokens,
                   help="report usage.prompt_tokens_details.cached_tokens only in the caller's own "
                   "namespace (own: an API key's or a salted one), or always (a single-user server)")
    h = s.add_argument_group("HTTP limits")
    h.add_argument("--timeout-header", type=FloatRange(0, _DAY_S, lo_open=True), default=d.header_timeout_s, metavar="S",
                   help="a request head must arrive within S of the connection or its previous response")
    h.add_argument("--timeout-body", type=FloatRange(0, _DAY_S, lo_open=True), default=d.body_timeout_s, metavar="S",
                   help="the request body must arrive within S of its head (408 otherwise)")
    h.add_argument("--max-request-bytes", type=IntRange(1, 1 << 40), default=d.max_request_bytes, metavar="N",
                   help="larger bodies are refused with 413")
    h.add_argument("--max-connections", type=IntRange(1, 1 << 20), default=d.max_connections, metavar="N",
                   help="connections opened beyond N get 503 with Retry-After")
    h.add_argument("--drain-seconds", type=FloatRange(0, _DAY_S), default=d.drain_s, metavar="S",
                   help="on SIGTERM/SIGINT, requests in flight may finish for up to S")
    s.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug",
                                                              "trace"), help="uvicorn's log level")
    s.set_defaults(func=_run)
