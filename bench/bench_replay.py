"""Replay benchmarks, measured in one run (ratios), JSON out.

1. Prefill throughput with decoder replay on vs off: a batch of B prompts of each length in
   one extend_batch call, decoder layers on every token (off) or on the last W (on). Beside
   the measured ratio, the ratio of the architecture's FLOP counts (`prefill_flops`) for the
   same shapes. SGLang's figure, whose public source is not located: 1.56x on 8xH200,
   batch 8, 8K (docs/design.md#replay-in-other-runtimes).
2. Time to first token through the engine and the cache: cold vs global hit with encoder
   replay (SWA snapshot expired) vs both hit (snapshot present), across prefix lengths, a
   short uncached suffix each time.

    PYTHONPATH=python python bench/bench_replay.py --preset v41-small --batch 8 \\
        --lengths 2048 8192 --prefixes 256 1024 4096 --json out.json

The CPU model is a float64-exact reference: absolute times are slow, and on a shared
machine the load average before/after each measurement is recorded. Progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from dsv41 import Model, ModelConfig  # noqa: E402
from dsv41.config import MODE_FULL, MODE_REINDEX, PART_ENCODER  # noqa: E402
from dsv41.model import Extend  # noqa: E402

from _meta import git_commit  # noqa: E402  (bench/ is on sys.path when run as a script)


def log(msg: str) -> None:
    print(f"[bench_replay] {msg}", file=sys.stderr, flush=True)


# ---- FLOP model -------------------------------------------------------------------------

def _layer_flops(c: ModelConfig, plan, pos: int) -> float:
    """Multiply-add FLOPs (2 per MAC) of one token at position `pos` in one layer: the
    projections, attention over its SWA window and top-k entries, its indexer, its MoE."""
    H, D, h = c.num_heads, c.head_dim, c.hidden_size
    f = 2 * (h * c.q_lora_rank + c.q_lora_rank * H * D + h * D)          # wq_a, wq_b, wkv
    f += 2 * (H * D * c.o_lora_rank + c.o_groups * c.o_lora_rank * h)   # grouped wo_a, wo_b
    keys = min(c.sliding_window, pos + 1)
    m = plan.compress_ratio
    if m:
        visible = (pos + 1) // m
        keys += min(c.index_topk, visible)
        if plan.owns_index_query:
            Hi, Di = c.index_n_heads, c.index_head_dim
            f += 2 * (c.q_lora_rank * Hi * Di + h * Hi)                  # indexer q, weights
            scored = visible if plan.mode == MODE_FULL else min(
                visible, c.candidate_topk_blocks * c.candidate_block_size)
            f += 2 * Hi * Di * scored
        if plan.owns_kv:
            f += 2 * h * D * (2 if m > 1 else 1)                         # compressor kv, gate
    f += 2 * 2 * H * D * keys                                            # QK^T and PV
    inter = c.moe_intermediate_size
    f += 2 * (h * c.n_routed_experts + (c.num_experts_per_tok + c.n_shared_experts) * 3 * h * inter)
    return float(f)


def prefill_flops(c: ModelConfig, n: int, decoder_start: int = 0) -> float:
    """FLOPs of a prefill of n tokens from position 0; decoder layers from decoder_start
    (the decoder's Full-layer compressor still runs on every token)."""
    total = 0.0
    for plan in c.layer_plan():
        first = 0 if plan.part == PART_ENCODER else decoder_start
        step = max(1, (n - first) // 256)          # sample positions, exact enough for a ratio
        pts = list(range(first, n, step))
        total += sum(_layer_flops(c, plan, p) for p in pts) * (n - first) / len(pts)
        if plan.part != PART_ENCODER and plan.owns_kv:
            total += 2 * c.hidden_size * c.head_dim * first                # compressor on [0, d)
    return total + 2 * c.hidden_size * c.vocab_size                      # head, last token


# ---- measurements -----------------------------------------------------------------------

def bench_decoder_replay(model: Model, batch: int, lengths: list[int], seed: int) -> list[dict]:
    c = model.config
    W = c.sliding_window
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        prompts = [torch.randint(0, c.vocab_size, (n,), generator=g) for _ in range(batch)]
        row = {"prompt_tokens": n, "batch": batch}
        # "encoder_only": the decoder on the last token only - how the time splits between
        # the encoder and the decoder layers on this implementation.
        starts = {"off": None, "on": (n - W) if n > W else None, "encoder_only": n - 1}
        for mode in ("off", "on", "encoder_only"):
            load = os.getloadavg()[0]
            log(f"decoder replay {mode}: batch {batch} x {n} tokens ...")
            t0 = time.perf_counter()
            model.extend_batch([Extend(p, model.new_state(), decoder_start=starts[mode])
                                for p in prompts])
            dt = time.perf_counter() - t0
            row[f"decoder_replay_{mode}"] = {"seconds": dt, "tokens_per_s": batch * n / dt,
                                             "loadavg_before": load, "loadavg_after": os.getloadavg()[0]}
            log(f"  {dt:.1f} s ({batch * n / dt:.0f} tok/s)")
        row["measured_speedup"] = row["decoder_replay_off"]["seconds"] / row["decoder_replay_on"]["seconds"]
        row["flop_ratio"] = prefill_flops(c, n) / prefill_flops(c, n, max(0, n - W))
        enc = row["decoder_replay_encoder_only"]["seconds"]
        row["measured_decoder_share_off"] = (row["decoder_replay_off"]["seconds"] - enc) / row["decoder_replay_off"]["seconds"]
        row["flop_decoder_share_off"] = 1 - prefill_flops(c, n, n - 1) / prefill_flops(c, n)
        out.append(row)
    return out


def bench_ttft(model: Model, prefixes: list[int], suffix: int, block: int, seed: int) -> list[dict]:
    from dsv41.cache import CacheConfig, PrefixCache
    from dsv41.engine import Engine, SamplingParams
    c = model.config
    g = torch.Generator().manual_seed(seed + 1)
    t = [0.0]
    out = []
    sp = SamplingParams(max_new_tokens=1)
    for n in prefixes:
        prefix = torch.randint(0, c.vocab_size, (n,), generator=g).tolist()
        tail = torch.randint(0, c.vocab_size, (suffix,), generator=g).tolist()
        cache = PrefixCache.for_model(model, CacheConfig(block_tokens=block, device="cpu",
                                                         gpu_capacity_bytes=1 << 26, swa_capacity_bytes=1 << 26,
                                                         swa_ttl_s=10.0),
                                      clock=lambda: t[0])
        eng = Engine(model, cache=cache, replay="bounded", write_approximate=False)
        row = {"prefix_tokens": n, "suffix_tokens": suffix}
        log(f"TTFT, prefix {n}: cold ...")
        cold = eng.generate([prefix + tail], sp)[0]          # also caches the prefix + snapshot
        # Both hit: the snapshot is at the end of the first request's prompt (+0 outputs fed),
        # i.e. prefix + tail; ask for prefix + tail + a new suffix.
        tail2 = torch.randint(0, c.vocab_size, (suffix,), generator=g).tolist()
        log(f"TTFT, prefix {n}: both hit ...")
        both = eng.generate([prefix + tail + tail2], sp)[0]
        t[0] += 100.0                                         # snapshots expire
        log(f"TTFT, prefix {n}: global hit + encoder replay ...")
        rep = eng.generate([prefix + tail + tail2], sp)[0]
        for name, o in (("cold", cold), ("both_hit", both), ("encoder_replay", rep)):
            s = o.stats
            row[name] = {"path": s.path, "ttft_s": s.ttft_s, "prompt_tokens": s.prompt_tokens,
                         "prefill_tokens": s.prefill_tokens, "replayed_tokens": s.replayed_tokens,
                         "global_hit_tokens": s.global_hit_tokens}
        row["cold_over_replay"] = cold.stats.ttft_s / rep.stats.ttft_s
        row["cold_over_both_hit"] = cold.stats.ttft_s / both.stats.ttft_s
        cache.close()
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="v41-small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--prefixes", type=int, nargs="*", default=[256, 1024, 4096])
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--block-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="write the results here ('-' for stdout)")
    args = ap.parse_args(argv)
    config = ModelConfig.preset(args.preset)
    model = Model.synthetic(config, seed=args.seed, device=args.device)
    # Warm-up: enough tokens that every expert is routed once (their float64 weight copies
    # are made on first use), so no measurement pays for it.
    model.prefill(torch.randint(0, config.vocab_size, (256,), generator=torch.Generator().manual_seed(99)),
                  model.new_state())
    res = {"preset": config.name, "device": args.device, "torch": torch.__version__,
           "host": platform.node(), "cpu_count": os.cpu_count(), "window": config.sliding_window,
           "published": {"sglang_decoder_replay_speedup_8xH200_batch8_8K": 1.56},
           "command": "python bench/bench_replay.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if not args.skip_throughput:
        res["decoder_replay_prefill"] = bench_decoder_replay(model, args.batch, args.lengths, args.seed)
    if not args.skip_ttft:
        res["ttft"] = bench_ttft(model, args.prefixes, args.suffix, args.block_tokens, args.seed)
    text = json.dumps(res, indent=2)
    if args.json == "-":
        print(text)
    elif args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
        log(f"wrote {args.json}")
    for r in res.get("decoder_replay_prefill", []):
        print(f"decoder replay, batch {r['batch']} x {r['prompt_tokens']}: measured "
              f"{r['measured_speedup']:.2f}x, FLOP ratio {r['flop_ratio']:.2f}x "
              f"(SGLang 8xH200 8K: 1.56x)", file=sys.stderr if args.json == "-" else sys.stdout)
    for r in res.get("ttft", []):
        print(f"TTFT prefix {r['prefix_tokens']} + {r['suffix_tokens']}: cold {r['cold']['ttft_s']:.2f} s, "
              f"replay {r['encoder_replay']['ttft_s']:.2f} s, both hit {r['both_hit']['ttft_s']:.2f} s",
              file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
