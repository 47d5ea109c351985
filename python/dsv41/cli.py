"""The `dsv41` command line.

    dsv41 info                           what was built and what this process sees
    dsv41 kv-bytes --preset v41-flash    the KV byte budget of a model (table or --json)
    dsv41 kv-bytes --config config.json  ... of a Hugging Face or inference config file
    dsv41 plan --preset v41-flash --gpus 8   weights per GPU as stored, KV budget, sessions
    dsv41 cache stats|verify|gc DIR      look after a persistent prefix store
    dsv41 digest CKPT_DIR                record a checkpoint's weights digest (its cache identity)
    dsv41 demo [--json]                  an agent workload through the engine and cache
    dsv41 eval [--matrix M --contract C --out DIR --model CKPT]   the replay acceptance matrix
    dsv41 serve [--model DIR | --preset NAME] [--port N]     an OpenAI-compatible server
"""
from __future__ import annotations

import argparse
import json
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    from ._build import build_info

    info = build_info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, list):
            value = ", ".join(map(str, value)) or "-"
        print(f"{key:<{width}}  {value}")
    return 0


def _cmd_kv_bytes(args: argparse.Namespace) -> int:
    from .budget import format_budget_table, kv_budget
    from .config import ConfigError, ModelConfig

    try:
        config = ModelConfig.from_json(args.config) if args.config else ModelConfig.preset(args.preset)
        other = ModelConfig.preset(args.compare) if args.compare != "none" else None
    except (ConfigError, KeyError, OSError, ValueError) as e:
        print(f"dsv41 kv-bytes: {e}", file=sys.stderr)
        return 2
    budget = kv_budget(config)
    against = kv_budget(other) if other is not None and other.name != config.name else None
    if args.json:
        print(json.dumps(budget.to_dict(compare_to=against), indent=2))
    else:
        print(format_budget_table(budget, compare_to=against))
    return 0


class _ProgressBar:
    """A one-line progress bar on stderr, redrawn at most once per percent."""

    def __init__(self, label: str, stream=None):
        self.label, self.stream, self.shown = label, stream or sys.stderr, -1

    def __call__(self, done: int, total: int) -> None:
        pct = 100 if total == 0 else done * 100 // total
        if pct == self.shown:
            return
        self.shown = pct
        bar = "#" * (pct * 30 // 100)
        self.stream.write(f"\r{self.label} [{bar:<30}] {pct:3d}%  {done / 2**30:.2f}/{total / 2**30:.2f} GiB")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def _cmd_digest(args: argparse.Namespace) -> int:
    from .model.checkpoint import CheckpointError, digest_checkpoint

    try:
        bar = None if args.quiet else _ProgressBar(f"hashing {args.directory}")
        digest = digest_checkpoint(args.directory, progress=bar)
    except (CheckpointError, OSError, ValueError, RuntimeError) as e:
        print(f"dsv41 digest: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # safetensors' own errors (a damaged shard): a message, not a traceback
        print(f"dsv41 digest: {args.directory}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(digest)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from .config import ConfigError, ModelConfig
    from .gpu_plan import StoredFormat, format_plan, memory_plan
    from .model.weights import read_quantization

    try:
        if args.config:
            config = ModelConfig.from_json(args.config)
            with open(args.config) as f:
                raw = json.load(f)
            fmt = StoredFormat.for_config(config, read_quantization(raw) or {})
        else:
            config = ModelConfig.preset(args.preset)
            fmt = StoredFormat.for_config(config)
        plan = memory_plan(config, gpus=args.gpus, fmt=fmt,
                           gpu_memory_bytes=int(args.gpu_memory_gb * 1e9),
                           reserve_bytes=int(args.reserve_gb * 1e9),
                           context_tokens=args.context)
    except (ConfigError, KeyError, OSError, ValueError) as e:
        print(f"dsv41 plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .config import preset_names

    p = argparse.ArgumentParser(prog="dsv41", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="print build and runtime facts (CUDA, arch list, torch)")
    info.add_argument("--json", action="store_true", help="print a JSON object")
    info.set_defaults(func=_cmd_info)

    kv = sub.add_parser("kv-bytes", help="KV-cache bytes per token and per sequence of a model")
    src = kv.add_mutually_exclusive_group()
    src.add_argument("--preset", default="v41-flash", choices=preset_names(),
                     help="a built-in model config (default: v41-flash)")
    src.add_argument("--config", metavar="PATH", help="a config.json (HF nested or flat inference spelling)")
    kv.add_argument("--compare", default="v4-flash", choices=preset_names() + ["none"],
                    help="preset to state the ratios against (default: v4-flash)")
    kv.add_argument("--json", action="store_true", help="print a JSON object")
    kv.set_defaults(func=_cmd_kv_bytes)

    dg = sub.add_parser("digest", help="compute a checkpoint's weights digest and record it in "
                        "CKPT_DIR/weights_digest.json (the prefix cache's identity for the weights)")
    dg.add_argument("directory", metavar="CKPT_DIR", help="a checkpoint directory (config.json + safetensors)")
    dg.add_argument("--quiet", action="store_true", help="no progress bar")
    dg.set_defaults(func=_cmd_digest)
    plan = sub.add_parser("plan", help="GPU memory plan: weights per GPU as stored, KV budget, "
                                       "tokens and sessions that fit")
    src = plan.add_mutually_exclusive_group()
    src.add_argument("--preset", default="v41-flash", choices=preset_names(),
                     help="a built-in model config (default: v41-flash)")
    src.add_argument("--config", metavar="PATH",
                     help="a checkpoint's config.json (its quantization_config decides the "
                          "stored weight formats; none: bf16)")
    plan.add_argument("--gpus", type=int, default=1, help="GPUs the weights are split over")
    plan.add_argument("--gpu-memory-gb", type=float, default=141.0,
                      help="memory per GPU in GB (default: 141, an H200)")
    plan.add_argument("--reserve-gb", type=float, default=10.0,
                      help="per-GPU bytes kept for activations, workspace, CUDA context")
    plan.add_argument("--context", type=int, default=32768,
                      help="tokens per session for the sessions-at-context figure")
    plan.add_argument("--json", action="store_true", help="print a JSON object")
    plan.set_defaults(func=_cmd_plan)

    from .cache.cli import add_cache_parser
    add_cache_parser(sub)
    from .engine.demo import add_demo_parser
    add_demo_parser(sub)
    from .eval.cli import add_eval_parser
    add_eval_parser(sub)
    from .server.cli import add_serve_parser
    add_serve_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
