"""What the stored KV formats cost: the same model with the stored formats vs the float32
reference mode (`kv_dtype="float32"`, unquantized main/SWA KV and indexer keys), on the
same tokens, V4 (FP8 main/SWA entry + MXFP4 indexer keys) and V4.1 (NVFP4 main, FP8 SWA,
MXFP4 indexer keys). Per token of a prefill: KL(reference || stored) of the next-token
distributions, top-1 agreement, max |logit diff|. Both models run in this process on the
same inputs; the weights are synthetic (Model.synthetic), so the numbers say how much the
formats perturb these models, not a trained model's quality.

    PYTHONPATH=python python bench/bench_kv_formats.py --presets v4-tiny v41-tiny \\
        --length 512 --prompts 4 --json bench/results/kv-formats-cpu-DATE.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from _meta import git_commit  # noqa: E402  (bench/ is on sys.path when run as a script)

from dsv41 import Model, ModelConfig  # noqa: E402


def measure(preset: str, length: int, prompts: int, seed: int) -> dict:
    cfg = ModelConfig.preset(preset)
    stored = Model.synthetic(cfg, seed=seed)
    ref = Model.synthetic(cfg, seed=seed, kv_dtype="float32")
    g = torch.Generator().manual_seed(seed + 1)
    kls, top1, diffs = [], [], []
    t0 = time.perf_counter()
    for _ in range(prompts):
        ids = torch.randint(0, cfg.vocab_size, (length,), generator=g)
        a = stored.prefill(ids, stored.new_state(), return_all_logits=True).double()
        b = ref.prefill(ids, ref.new_state(), return_all_logits=True).double()
        lp_ref, lp_st = torch.log_softmax(b, -1), torch.log_softmax(a, -1)
        kls.append((lp_ref.exp() * (lp_ref - lp_st)).sum(-1))
        top1.append((a.argmax(-1) == b.argmax(-1)).double())
        diffs.append((a - b).abs().amax(-1))
    kl, agree, diff = torch.cat(kls), torch.cat(top1), torch.cat(diffs)
    return {
        "preset": preset, "main_kv_format": cfg.main_kv_format, "tokens": int(kl.numel()),
        "kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(), "kl_max": kl.max().item(),
        "top1_agreement": agree.mean().item(), "max_abs_logit_diff": diff.max().item(),
        "mean_max_abs_logit_diff": diff.mean().item(), "wall_s": time.perf_counter() - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["v4-tiny", "v41-tiny"])
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for preset in args.presets:
        row = measure(preset, args.length, args.prompts, args.seed)
        rows.append(row)
        print(f"{preset:<9} {row['main_kv_format']:<7} tokens {row['tokens']:>5}  KL mean "
              f"{row['kl_mean']:.2e} p99 {row['kl_p99']:.2e} max {row['kl_max']:.2e}  top-1 "
              f"{row['top1_agreement']:.4f}  max|dlogit| {row['max_abs_logit_diff']:.3f}",
              flush=True)
    out = {"benchmark": "kv_formats", "date": datetime.date.today().isoformat(),
           "commit": git_commit() or "unknown", "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "machine": platform.platform(), "torch_threads": torch.get_num_threads(),
           "load_average_1m": os.getloadavg()[0], "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
