"""`dsv41 serve`: build the model, cache, engine and tokenizer, then run the app on uvicorn.

    dsv41 serve --preset v41-tiny --port 8000                  # synthetic weights, byte tokenizer
    dsv41 serve --model ./ckpt --cache-dir /ssd/dsv41 --port 8000   # a checkpoint; SSD tier

The prefix cache has a GPU-pool tier (host memory without a GPU), the SWA snapshot tier and,
with --cache-dir, the persistent SSD tier; --no-prefix-cache runs without any.
"""
from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import dataclass
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
    max_batch: int = 32
    max_prefill_tokens: int = 8192
    max_pending: int = 256


class Server:
    """The parts of a running server: engine loop, app, and what to close."""

    def __init__(self, opts: ServeOptions):
        import torch

        from ..cache import CacheConfig, PrefixCache
        from ..config import ModelConfig
        from ..engine import Engine, SamplingParams
        from ..model import Model
        from ..model.production import default_precision
        from .app import create_app
        from .loop import EngineLoop
        from .metrics import ServerMetrics
        from .tokenizer import load_tokenizer

        device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        # The production path (weights as shipped, bf16 GEMMs) on CUDA; the float64 reference
        # on the CPU (docs/model.md, "Precision"). --precision overrides.
        precision = opts.precision or default_precision(device)
        if opts.model is not None:
            model = Model.from_pretrained(opts.model, device=device, precision=precision)
            name = opts.served_model_name or Path(opts.model).resolve().name
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
                             max_prefill_tokens=opts.max_prefill_tokens)
        # One forward before serving, on a throwaway engine without the cache, so that no
        # client's first request pays torch's one-time set-up (seconds on a CPU).
        Engine(model).generate([[0, 1]], SamplingParams(max_new_tokens=2))
        self.tokenizer = load_tokenizer(opts.model, model.config.vocab_size)
        self.model_name = name
        self.loop = EngineLoop(self.engine, ServerMetrics(), max_pending=opts.max_pending).start()
        self.app = create_app(self.loop, self.tokenizer, model_name=name)

    def close(self) -> None:
        self.loop.close()
        if self.cache is not None:
            self.cache.close()


def build_server(opts: ServeOptions) -> Server:
    return Server(opts)


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(model=args.model, preset=args.preset, seed=args.seed,
                        served_model_name=args.served_model_name, device=args.device,
                        precision=args.precision,
                        prefix_cache=not args.no_prefix_cache, cache_dir=args.cache_dir,
                        block_tokens=args.block_tokens, gpu_cache_mb=args.gpu_cache_mb,
                        swa_cache_mb=args.swa_cache_mb, swa_ttl_s=args.swa_ttl, replay=args.replay,
                        max_batch=args.max_batch, max_prefill_tokens=args.max_prefill_tokens,
                        max_pending=args.max_pending)


def _run(args: argparse.Namespace) -> int:
    import uvicorn

    opts = options_from_args(args)
    try:
        server = Server(opts)
    except (OSError, ValueError, KeyError) as e:
        print(f"dsv41 serve: {e}", file=sys.stderr)
        return 2
    print(f"dsv41 serve: model {server.model_name!r} ({server.tokenizer.name} tokenizer) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # What start-up built (torch, the model, the recovered SSD index) lives as long as the
    # server: moved out of the cyclic collector's reach, a full collection then walks only
    # what came after, not the ~363K objects of a tiny-preset start-up (213 ms a pass on
    # the development VM, every thread stalled; docs/serve.md).
    gc.collect()
    gc.freeze()
    try:
        uvicorn.run(server.app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        server.close()
    return 0


def add_serve_parser(sub) -> None:
    from ..argcheck import FloatRange, IntRange, device, output_dir
    from ..config import preset_names

    d = ServeOptions()
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, prefix cache)")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="DIR", help="a checkpoint directory (config.json, safetensors, "
                     "and tokenizer.json for text)")
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
    s.add_argument("--max-batch", type=IntRange(1, 1 << 16), default=d.max_batch, help="sequences per step")
    s.add_argument("--max-prefill-tokens", type=IntRange(1, 1 << 24), default=d.max_prefill_tokens,
                   help="prefill tokens per step")
    s.add_argument("--max-pending", type=IntRange(1, 1 << 20), default=d.max_pending,
                   help="requests accepted and unfinished at once; beyond it 503")
    s.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug",
                                                              "trace"), help="uvicorn's log level")
    s.set_defaults(func=_run)
