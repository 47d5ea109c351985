"""Prefill and decode throughput of the CSA2 model against a dense-attention baseline.

The baseline is the same model (same weights, same SWA window, same stored state) with the
top-k disabled: every compressing layer attends to all of its visible global entries
(`Model.dense_attention = True`; the indexer is not consulted). Both run in this process,
on the same inputs, one after the other, so their ratio is meaningful on a shared machine.

    PYTHONPATH=python python bench/bench_model.py --lengths 1024 4096 16384 --json out.json

Reports per length: prefill tokens/s (one prefill call over the whole prompt), decode
tokens/s (greedy decode steps after it, median step), the sparse/dense speedups, and how prefill time
grows with length (the exponent k in time ~ length^k between consecutive lengths: CSA2
should stay near 1, dense attention tends to 2 as attention dominates).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from dsv41 import Model, ModelConfig  # noqa: E402


def _run(model: Model, ids: torch.Tensor, decode_steps: int) -> dict:
    """One prefill over the whole prompt, then greedy decode steps. Decode speed is taken
    from the median step (robust to other processes on a shared machine); the load
    average before and after tells how busy the machine was."""
    load_before = os.getloadavg()[0]
    state = model.new_state()
    t0 = time.perf_counter()
    logits = model.prefill(ids, state)
    prefill_s = time.perf_counter() - t0
    steps = []
    for _ in range(decode_steps):
        t0 = time.perf_counter()
        logits = model.decode_step(int(logits.argmax()), state)
        steps.append(time.perf_counter() - t0)
    median = statistics.median(steps) if steps else None
    return {
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": ids.shape[0] / prefill_s,
        "decode_steps": decode_steps,
        "decode_s": sum(steps),
        "decode_step_median_s": median,
        "decode_tokens_per_s": 1.0 / median if median else None,
        "global_kv_bytes": state.nbytes()["global"],
        "finite": bool(torch.isfinite(logits).all()),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg()[0],
    }


def _growth(results: list[dict], mode: str) -> list[dict]:
    out = []
    for a, b in zip(results, results[1:]):
        ratio = b[mode]["prefill_s"] / a[mode]["prefill_s"]
        out.append({"from": a["length"], "to": b["length"], "time_ratio": ratio,
                    "exponent": math.log(ratio) / math.log(b["length"] / a["length"])})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="v41-small")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--modes", nargs="+", choices=("sparse", "dense"), default=["sparse", "dense"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ModelConfig.preset(args.preset)
    too_long = [n for n in args.lengths if n + args.decode_steps > config.max_position_embeddings]
    if too_long:
        ap.error(f"lengths {too_long} (+ decode steps) exceed {config.name}'s maximum "
                 f"{config.max_position_embeddings}")
    model = Model.synthetic(config, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model.prefill(torch.randint(0, config.vocab_size, (64,), generator=gen), model.new_state())
    print(f"{config.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"top-k {config.index_topk}, window {config.sliding_window}, "
          f"{torch.get_num_threads()} threads", flush=True)
    results = []
    for n in args.lengths:
        ids = torch.randint(0, config.vocab_size, (n,), generator=gen)
        row = {"length": n}
        for mode in args.modes:
            model.dense_attention = mode == "dense"
            r = _run(model, ids, args.decode_steps)
            row[mode] = r
            print(f"  {n:>6} {mode:<6} prefill {r['prefill_s']:8.2f} s "
                  f"{r['prefill_tokens_per_s']:8.1f} tok/s   decode "
                  f"{r['decode_tokens_per_s'] or 0:6.2f} tok/s (median step)   load "
                  f"{r['loadavg_before']:.1f}->{r['loadavg_after']:.1f}", flush=True)
        model.dense_attention = False
        if "sparse" in row and "dense" in row:
            row["prefill_speedup"] = row["dense"]["prefill_s"] / row["sparse"]["prefill_s"]
            if args.decode_steps:
                row["decode_speedup"] = (row["dense"]["decode_step_median_s"]
                                         / row["sparse"]["decode_step_median_s"])
            print(f"  {n:>6} sparse vs dense: prefill {row['prefill_speedup']:.2f}x, decode "
                  f"{row.get('decode_speedup', float('nan')):.2f}x", flush=True)
        results.append(row)
    growth = {mode: _growth(results, mode) for mode in args.modes}
    for mode, steps in growth.items():
        for g in steps:
            print(f"  {mode:<6} prefill time {g['from']} -> {g['to']}: x{g['time_ratio']:.2f} "
                  f"(~ length^{g['exponent']:.2f})")
    report = {
        "benchmark": "bench_model",
        "preset": config.name,
        "config_fingerprint": config.fingerprint(),
        "seed": args.seed,
        "decode_steps": args.decode_steps,
        "baseline": "same model, dense_attention=True (all visible global entries, no top-k)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "results": results,
        "prefill_growth": growth,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
