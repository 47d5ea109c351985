"""`dsv41 demo`: an agent-shaped workload through the engine and the tiered cache.

A shared system prompt and tool schema, a repository context, several conversations of
several turns (user messages, tool outputs); some conversations come back after a break
longer than the SWA snapshot TTL (the injectable clock jumps), so their turn resumes by
encoder bounded replay. Per turn: the path taken, hit tokens, replayed tokens, prefill
tokens, TTFT. Then a summary: hit rate per tier, bytes per ledger, prefill tokens saved,
and the expired turns run again with replay off (recompute) to compare. The model is an
embedded preset with synthetic weights; the persistent store lives under --cache-dir, so a
second run starts with SSD hits. With --remote-blocks / --remote-snapshots (a Mooncake
master and a Redis server, e.g. from scripts/remote-servers.sh) the cache also has the
remote tier: a run with --fresh (empty local SSD) then resumes from what an earlier run
wrote there. Progress goes to stderr; --json prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

__all__ = ["add_demo_parser", "run_demo"]


class _Clock:
    """Wall time plus an offset the demo advances to let SWA snapshots expire."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def _tokens(g: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _workload(args, vocab: int) -> tuple[list[int], list[list[tuple[str, list[int]]]]]:
    """The shared prefix and, per conversation, its turns' new content (kind, tokens)."""
    g = torch.Generator().manual_seed(args.seed)
    shared = _tokens(g, args.system_tokens, vocab) + _tokens(g, args.tools_tokens, vocab) \
        + _tokens(g, args.repo_tokens, vocab)
    convs = []
    for c in range(args.conversations):
        turns = []
        for t in range(args.turns):
            kind = "tool" if t % 2 else "user"
            n = args.tool_tokens if kind == "tool" else args.user_tokens
            turns.append((kind, _tokens(g, n, vocab)))
        convs.append(turns)
    return shared, convs


def run_demo(args, out=None, err=None) -> dict:
    from ..cache import CacheConfig, PrefixCache
    from ..config import ModelConfig
    from ..model import Model
    from ..model.production import default_precision
    from .engine import Engine
    from .request import SamplingParams

    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr

    def progress(msg: str) -> None:
        if not args.quiet:
            print(msg, file=err, flush=True)

    t_start = time.perf_counter()
    device = "cpu"
    if args.model:
        from ..checkpoints import resolve
        model = Model.from_pretrained(resolve(args.model), device=device,
                                      precision=default_precision(device))
        config = model.config
        what = f"checkpoint {args.model}"
    else:
        config = ModelConfig.preset(args.preset)
        model = Model.synthetic(config, seed=args.seed, device=device,
                                precision=default_precision(device))
        what = f"synthetic weights, seed {args.seed}"
    progress(f"[demo] model {config.name} ({what}), window {config.sliding_window}")
    root = Path(args.cache_dir) / config.name
    if args.fresh and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    clock = _Clock()
    ttl = args.swa_ttl
    if args.block_tokens is None:  # a block must hold whole compressed entries (V4: 128)
        args.block_tokens = max([16] + [r for r in config.compress_ratios if r])
    cc = CacheConfig(block_tokens=args.block_tokens, device="cpu", gpu_capacity_bytes=64 << 20,
                     swa_capacity_bytes=256 << 20, swa_ttl_s=ttl, store_dir=str(root / "store"),
                     store_durability="none", store_direct_io=False,
                     remote_blocks=args.remote_blocks, remote_snapshots=args.remote_snapshots,
                     remote_lookup_timeout_s=args.remote_timeout_ms / 1e3, remote_snapshot_ttl_s=ttl)
    # Closed on every way out (an error included): its queued SSD writes are committed and
    # its threads stopped, so the process exits with its own status.
    with PrefixCache.for_model(model, cc, clock=clock) as cache:
        if cache.remote is not None:
            ok = cache.remote.wait_connected(10.0)
            progress(f"[demo] remote tier: blocks {args.remote_blocks}, snapshots {args.remote_snapshots}"
                     f"{'' if ok else ' (not reachable yet: lookups miss until it is)'}")
        # Encoder replay over cached global KV needs every compressor's state at a block
        # boundary to be a function of the cached entries; V4's overlapping windows carry the
        # previous block's projections, so V4 models resume from SWA snapshots (after the TTL
        # from their SWA checkpoints on the SSD, cache/swa_checkpoints.py) or recompute.
        replay = "off" if config.overlap_compress_ratios else "bounded"
        engine = Engine(model, cache=cache, replay=replay, max_batch=args.conversations,
                        runtime=args.runtime)
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
        shared, convs = _workload(args, config.vocab_size)
        progress(f"[demo] cache dir {root} (block {args.block_tokens} tokens, SWA TTL {ttl:g} s); "
                 f"{len(convs)} conversations x {args.turns} turns, shared prefix {len(shared)} tokens")

        # The agent framework warms the shared prefix once: its blocks and the SWA snapshot at
        # its end let every conversation's first turn resume exactly.
        warm = engine.generate([shared], SamplingParams(max_new_tokens=1), namespace="demo")[0]
        progress(f"[demo] shared prefix warm-up: {warm.stats.path}, prefill "
                 f"{warm.stats.prefill_tokens} tokens, TTFT {warm.stats.ttft_s * 1e3:.1f} ms")

        # Timeline: every round, each conversation takes a turn; conversations with an odd index
        # take a break longer than the TTL before their last turn (their snapshots expire).
        history = [list(shared) for _ in convs]
        turns_out: list[dict] = []
        expired_prompts: list[tuple[int, list[int]]] = []
        for r in range(args.turns):
            late = r == args.turns - 1 and args.turns > 1
            batch = [c for c in range(len(convs)) if not (late and c % 2)]
            groups = [batch]
            if late:
                groups.append([c for c in range(len(convs)) if c % 2])
            for gi, group in enumerate(groups):
                if not group:
                    continue
                if gi == 1:
                    clock.offset += ttl + 1.0
                    progress(f"[demo] {ttl + 1:g} s pass (clock): SWA snapshots expire")
                prompts = [history[c] + convs[c][r][1] for c in group]
                outs = engine.generate(prompts, sp, namespace="demo")
                for c, prompt, o in zip(group, prompts, outs):
                    s = o.stats
                    rec = {"conversation": c, "turn": r, "kind": convs[c][r][0],
                           "after_break": gi == 1, "prompt_tokens": s.prompt_tokens, "path": s.path,
                           "gpu_hit_tokens": s.gpu_hit_tokens, "ssd_hit_tokens": s.ssd_hit_tokens,
                           "swa_hit_tokens": s.swa_hit_tokens, "replayed_tokens": s.replayed_tokens,
                           "prefill_tokens": s.prefill_tokens, "ttft_ms": s.ttft_s * 1e3,
                           "decode_tok_s": s.decode_tokens_per_s, "output_tokens": o.output_tokens}
                    turns_out.append(rec)
                    if s.path == "encoder_replay":
                        expired_prompts.append((c, prompt))
                    history[c] = prompt + o.output_tokens
                    progress(f"[demo] conv {c} turn {r} ({rec['kind']}{', after break' if gi else ''}): "
                             f"{s.path:<14} prompt {s.prompt_tokens:>4}  hit gpu/ssd/swa "
                             f"{s.gpu_hit_tokens}/{s.ssd_hit_tokens}/{s.swa_hit_tokens}  replayed "
                             f"{s.replayed_tokens:>3}  prefill {s.prefill_tokens:>4}  TTFT "
                             f"{s.ttft_s * 1e3:7.1f} ms")

        # Replay on vs off: the replayed turns again, recomputing the prefix instead (the
        # snapshots they wrote are dropped first by letting the clock pass the TTL again).
        compare = []
        if expired_prompts:
            clock.offset += ttl + 1.0
            progress(f"[demo] replay off: {len(expired_prompts)} replayed turns again, recomputed")
            off = Engine(model, cache=cache, replay="off", runtime=args.runtime)
            for c, prompt in expired_prompts:
                on_rec = next(t for t in turns_out if t["conversation"] == c and t["path"] == "encoder_replay"
                              and t["prompt_tokens"] == len(prompt))
                o = off.generate([prompt], sp, namespace="demo")[0]
                compare.append({"conversation": c, "prompt_tokens": len(prompt),
                                "replay_on": {"prefill_tokens": on_rec["prefill_tokens"], "ttft_ms": on_rec["ttft_ms"]},
                                "replay_off": {"path": o.stats.path, "prefill_tokens": o.stats.prefill_tokens,
                                               "ttft_ms": o.stats.ttft_s * 1e3},
                                "same_first_token": o.output_tokens[:1] == on_rec["output_tokens"][:1]})

        if cache.remote is not None:
            cache.remote.flush(10.0)  # the next run (or server) should find this run's writes
        stats = cache.stats()
        m = stats["metrics"]
        prompt_total = sum(t["prompt_tokens"] for t in turns_out)
        prefill_total = sum(t["prefill_tokens"] for t in turns_out)
        paths: dict[str, int] = {}
        for t in turns_out:
            paths[t["path"]] = paths.get(t["path"], 0) + 1
        summary = {
            "model": config.name, "cache_dir": str(root), "turns": len(turns_out), "paths": paths,
            "hit_rate": stats["hit_rate"],
            "prompt_tokens": prompt_total, "prefill_tokens": prefill_total,
            "prefill_tokens_saved": prompt_total - prefill_total,
            "replayed_tokens": sum(t["replayed_tokens"] for t in turns_out),
            "warmup": {"path": warm.stats.path, "prefill_tokens": warm.stats.prefill_tokens,
                       "ssd_hit_tokens": warm.stats.ssd_hit_tokens, "ttft_ms": warm.stats.ttft_s * 1e3},
            "bytes": {"global_kv_gpu_pool": stats["gpu"]["cached_blocks"] * stats["gpu"]["block_bytes"],
                      "swa_snapshots_host": stats["swa"]["used_bytes"] if stats["swa"] else 0,
                      "global_kv_ssd": stats["ssd"]["live_bytes"] if stats["ssd"] else 0,
                      "swa_checkpoints_ssd": (stats["swa_checkpoints"]["bytes_on_disk"]
                                              if stats["swa_checkpoints"] else 0),
                      "global_kv_per_token": cache.layout.block_bytes // cache.block_tokens,
                      "read": {k: v for k, v in m.get("bytes_read", {}).items()} if isinstance(m, dict) else {},
                      "written": {k: v for k, v in m.get("bytes_written", {}).items()} if isinstance(m, dict) else {}},
            "metrics": m, "replay_on_vs_off": compare,
            "wall_s": time.perf_counter() - t_start,
        }
    result = {"turns": turns_out, "summary": summary}
    if args.json:
        print(json.dumps(result, indent=2, default=str), file=out)
    else:
        _print_text(result, out)
    return result


def _print_text(result: dict, out) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"{'conv':>4} {'turn':>4} {'kind':<5} {'path':<15} {'prompt':>6} {'gpu':>5} {'ssd':>5} "
      f"{'swa':>5} {'replay':>6} {'prefill':>7} {'TTFT ms':>8}")
    for t in result["turns"]:
        p(f"{t['conversation']:>4} {t['turn']:>4} {t['kind']:<5} "
          f"{t['path'] + ('*' if t['after_break'] else ''):<15} {t['prompt_tokens']:>6} "
          f"{t['gpu_hit_tokens']:>5} {t['ssd_hit_tokens']:>5} {t['swa_hit_tokens']:>5} "
          f"{t['replayed_tokens']:>6} {t['prefill_tokens']:>7} {t['ttft_ms']:>8.1f}")
    s = result["summary"]
    p("(* after a break longer than the SWA TTL)")
    p("")
    p(f"paths: {s['paths']}")
    p("hit rate per tier (of looked-up tokens): " +
      ", ".join(f"{k} {v:.1%}" for k, v in s["hit_rate"].items()))
    p(f"prefill tokens: {s['prefill_tokens']} computed of {s['prompt_tokens']} prompt tokens "
      f"(saved {s['prefill_tokens_saved']}); replayed {s['replayed_tokens']}")
    b = s["bytes"]
    p(f"bytes per ledger: global KV {b['global_kv_per_token']} B/token; GPU pool "
      f"{b['global_kv_gpu_pool']:,} B; SWA snapshots (host) {b['swa_snapshots_host']:,} B; "
      f"SSD store {b['global_kv_ssd']:,} B; SWA checkpoints (SSD) {b['swa_checkpoints_ssd']:,} B")
    w = s["warmup"]
    p(f"shared prefix warm-up: {w['path']}, prefill {w['prefill_tokens']} tokens "
      f"(SSD hit {w['ssd_hit_tokens']}), TTFT {w['ttft_ms']:.1f} ms")
    for c in s["replay_on_vs_off"]:
        on, off = c["replay_on"], c["replay_off"]
        p(f"replay on vs off, conv {c['conversation']} ({c['prompt_tokens']} tokens): prefill "
          f"{on['prefill_tokens']} vs {off['prefill_tokens']} tokens, TTFT {on['ttft_ms']:.1f} vs "
          f"{off['ttft_ms']:.1f} ms, same first token: {c['same_first_token']}")
    p(f"wall time {s['wall_s']:.1f} s; cache dir {s['cache_dir']}")


def add_demo_parser(sub) -> None:
    from ..argcheck import FloatRange, IntRange, output_dir
    from ..config import preset_names

    count, tokens = IntRange(1, 10_000), IntRange(0, 1 << 20)
    d = sub.add_parser("demo", help="an agent workload through the engine and the tiered cache")
    d.add_argument("--preset", default="v41-tiny", choices=preset_names(),
                   help="embedded model preset (synthetic weights)")
    d.add_argument("--model", default=None, metavar="DIR|NAME",
                   help="a checkpoint directory or a shipped checkpoint (v41-tiny-tasks: the "
                        "trained task model) instead of the synthetic preset")
    d.add_argument("--cache-dir", type=output_dir, default="./dsv41-demo-cache",
                   help="where the persistent store lives")
    d.add_argument("--fresh", action="store_true", help="empty the cache dir first")
    d.add_argument("--conversations", type=count, default=3)
    d.add_argument("--runtime", default="auto", choices=("auto", "paged", "reference"),
                   help="the engine's runtime (docs/paged.md): auto is paged when the model runs on it")
    d.add_argument("--turns", type=count, default=3)
    d.add_argument("--system-tokens", type=tokens, default=64)
    d.add_argument("--tools-tokens", type=tokens, default=64)
    d.add_argument("--repo-tokens", type=tokens, default=192)
    d.add_argument("--user-tokens", type=tokens, default=24)
    d.add_argument("--tool-tokens", type=tokens, default=48)
    d.add_argument("--max-new-tokens", type=IntRange(1, 1 << 20), default=6)
    d.add_argument("--block-tokens", type=IntRange(1, 1 << 16), default=None,
                   help="cache block size (default: 16, or the largest compress ratio if larger)")
    d.add_argument("--swa-ttl", type=FloatRange(0, 1e9), default=300.0, help="SWA snapshot TTL (s)")
    d.add_argument("--seed", type=IntRange(0, (1 << 63) - 1), default=0)
    d.add_argument("--remote-blocks", default=None, metavar="URL",
                   help="remote tier for global KV blocks, e.g. mooncake://127.0.0.1:50051")
    d.add_argument("--remote-snapshots", default=None, metavar="URL",
                   help="remote tier for SWA snapshots, e.g. redis://127.0.0.1:6379/0")
    d.add_argument("--remote-timeout-ms", type=FloatRange(0, 1e7, lo_open=True), default=50.0,
                   help="deadline of one remote lookup call")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--quiet", action="store_true", help="no progress on stderr")
    d.set_defaults(func=lambda a: (run_demo(a), 0)[1])
