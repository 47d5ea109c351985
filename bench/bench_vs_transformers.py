"""dsv41 against transformers 5.23.0's DeepseekV4ForCausalLM at equal shapes: one prefill
forward (fp32 on the CPU) of the same random V4 model (saved by transformers, loaded by
dsv41) over the same tokens, both in this process one after the other, so the ratio is
meaningful on a shared machine. dsv41 runs in its stored-format mode (the float64 reference
precision), in the float32 reference mode (kv_dtype="float32") and on the production path
(precision="bf16": bf16 weights and GEMMs, stored KV formats; model/production.py); transformers' forward uses its DynamicCache (what generate's
prefill runs). Each forward records wall time (`*_s`, what the ratios use) and this
thread's CPU time (`*_cpu_s`, `*_cpu_speed`: the same ratio with the time other processes
took the core away left out, for a loaded machine; one thread, so CPU time bounds wall
time from below).

    OMP_NUM_THREADS=1 PYTHONPATH=python python bench/bench_vs_transformers.py \\
        --lengths 256 1024 4096 [--warm-each] [--repeat 3] --json bench/results/vs-transformers-cpu-DATE.json

--decode N adds decode: after a prefill of each length, N single-token steps on each side's
own cache (transformers' DynamicCache, dsv41's per-sequence state), the models interleaved
step by step; tokens/s from the median step (wall and this thread's CPU time).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from _meta import git_commit  # noqa: E402  (bench/ is on sys.path when run as a script)

from dsv41 import Model  # noqa: E402


def hf_model(seed: int):
    """The benchmark's random V4 model: transformers' DeepseekV4ForCausalLM drawn by the
    factory the oracle tests use (dsv41.model.oracle.random_deepseek_v4)."""
    import transformers
    from transformers import DeepseekV4Config

    from dsv41.model.oracle import random_deepseek_v4
    n = 8
    cfg = DeepseekV4Config(
        vocab_size=1024, hidden_size=256, num_hidden_layers=n, num_attention_heads=8,
        head_dim=128, partial_rotary_factor=0.5, q_lora_rank=128, o_groups=4, o_lora_rank=128,
        moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
        index_n_heads=4, index_head_dim=128, index_topk=128, sliding_window=128,
        max_position_embeddings=65536,
        layer_types=["sliding_attention"] * 2 + ["compressed_sparse_attention",
                                                  "heavily_compressed_attention"] * 3,
        mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1),
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 16384, "beta_fast": 32,
                         "beta_slow": 1})
    return transformers, random_deepseek_v4(cfg, seed)


def _decode(transformers, hf, ours: dict, ids: torch.Tensor, steps: int) -> dict:
    """Median decode step after a prefill of ids, transformers against dsv41's production
    and float32 modes, interleaved step by step (the same next token for all: the
    transformers model's greedy choice, so every side decodes the same sequence)."""
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        logits = hf(input_ids=ids[None], use_cache=True, past_key_values=cache).logits[0, -1]
    states = {}
    for mode in ("production", "float32"):
        states[mode] = ours[mode].new_state()
        ours[mode].prefill(ids, states[mode])
    times = {k: ([], []) for k in ("transformers", "dsv41_production", "dsv41_float32")}
    for _ in range(steps):
        tok = int(logits.argmax())
        t0, c0 = time.perf_counter(), time.thread_time()
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([[tok]]), use_cache=True,
                        past_key_values=cache).logits[0, -1]
        times["transformers"][0].append(time.perf_counter() - t0)
        times["transformers"][1].append(time.thread_time() - c0)
        for mode in ("production", "float32"):
            t0, c0 = time.perf_counter(), time.thread_time()
            ours[mode].decode_step(tok, states[mode])
            times[f"dsv41_{mode}"][0].append(time.perf_counter() - t0)
            times[f"dsv41_{mode}"][1].append(time.thread_time() - c0)
    out = {"decode_steps": steps}
    for k, (wall, cpu) in times.items():
        out[f"decode_{k}_ms"] = statistics.median(wall) * 1e3
        out[f"decode_{k}_cpu_ms"] = statistics.median(cpu) * 1e3
        out[f"decode_{k}_tokens_per_s"] = 1e3 / out[f"decode_{k}_ms"]
    for mode in ("production", "float32"):
        out[f"decode_dsv41_{mode}_vs_transformers_speed"] = (
            out["decode_transformers_ms"] / out[f"decode_dsv41_{mode}_ms"])
        out[f"decode_dsv41_{mode}_vs_transformers_cpu_speed"] = (
            out["decode_transformers_cpu_ms"] / out[f"decode_dsv41_{mode}_cpu_ms"])
    print(f"  decode after {ids.numel()}: transformers {out['decode_transformers_ms']:.1f} ms, "
          f"dsv41 production {out['decode_dsv41_production_ms']:.1f} ms "
          f"({out['decode_dsv41_production_vs_transformers_speed']:.2f}x wall, "
          f"{out['decode_dsv41_production_vs_transformers_cpu_speed']:.2f}x CPU), float32 "
          f"{out['decode_dsv41_float32_ms']:.1f} ms", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 4096])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--warm-each", action="store_true",
                    help="run every model once, untimed, at each length before timing it "
                         "(steady state: oneDNN creates a bf16 kernel per new GEMM shape)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time every forward this many times, the models interleaved, and "
                         "report the fastest (wall and CPU time separately; all samples are "
                         "kept in the JSON): on a loaded machine one sample mostly measures "
                         "the other tenants")
    ap.add_argument("--decode", type=int, default=0,
                    help="also time this many decode steps after each length's prefill")
    ap.add_argument("--skip-prefill", action="store_true",
                    help="with --decode: time decode only")
    args = ap.parse_args()
    transformers, hf = hf_model(args.seed)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = {"stored": Model.from_pretrained(d), "float32": Model.from_pretrained(
            d, kv_dtype="float32"),
                "production": Model.from_pretrained(d, precision="bf16")}
    g = torch.Generator().manual_seed(args.seed + 1)
    warm = torch.randint(0, 1024, (16,), generator=g)
    with torch.no_grad():
        hf(input_ids=warm[None], past_key_values=transformers.DynamicCache(config=hf.config))
    for m in ours.values():
        m.prefill(warm, m.new_state())
    rows = []
    for n in args.lengths:
        ids = torch.randint(0, 1024, (n,), generator=g)
        if args.warm_each:
            other = torch.randint(0, 1024, (n,), generator=g)
            with torch.no_grad():
                hf(input_ids=other[None], past_key_values=transformers.DynamicCache(
                    config=hf.config))
            for m in ours.values():
                m.prefill(other, m.new_state())
        row = {"tokens": n, "warm_at_length": args.warm_each,
               "load_average_1m_before": os.getloadavg()[0]}
        def run_hf():
            with torch.no_grad():
                return hf(input_ids=ids[None], use_cache=True,
                          past_key_values=transformers.DynamicCache(
                              config=hf.config)).logits[0, -1]
        runs = {"transformers": run_hf}
        runs.update({f"dsv41_{mode}": (lambda m=m: m.prefill(ids, m.new_state()))
                     for mode, m in ours.items()})
        samples = {k: ([], []) for k in runs}
        outs = {}
        if args.decode:
            row.update(_decode(transformers, hf, ours, ids, args.decode))
        if args.skip_prefill:
            rows.append(row)
            continue
        for _ in range(args.repeat):
            for k, fn in runs.items():
                t0, c0 = time.perf_counter(), time.thread_time()
                outs[k] = fn()
                samples[k][0].append(time.perf_counter() - t0)
                samples[k][1].append(time.thread_time() - c0)
        for k, (wall, cpu) in samples.items():
            row[f"{k}_s"], row[f"{k}_cpu_s"] = min(wall), min(cpu)
            if args.repeat > 1:
                row[f"{k}_s_samples"], row[f"{k}_cpu_s_samples"] = wall, cpu
        want = outs["transformers"]
        for mode in ours:
            k = f"dsv41_{mode}"
            row[f"{k}_vs_transformers_speed"] = row["transformers_s"] / row[f"{k}_s"]
            row[f"{k}_vs_transformers_cpu_speed"] = (row["transformers_cpu_s"]
                                                     / row[f"{k}_cpu_s"])
            row[f"{k}_last_logits_max_abs_diff"] = (want - outs[k]).abs().max().item()
        for k in ("transformers", "dsv41_stored", "dsv41_float32", "dsv41_production"):
            row[f"{k}_tokens_per_s"] = n / row[f"{k}_s"]
        # the production path against the float64 reference it replaces (same stored KV)
        row["dsv41_production_vs_reference_speed"] = row["dsv41_stored_s"] / row["dsv41_production_s"]
        rows.append(row)
        print(f"{n:>6} tokens: transformers {row['transformers_tokens_per_s']:8.1f} tok/s, dsv41 "
              f"stored {row['dsv41_stored_tokens_per_s']:8.1f} tok/s "
              f"({row['dsv41_stored_vs_transformers_speed']:.2f}x), float32 "
              f"{row['dsv41_float32_tokens_per_s']:8.1f} tok/s "
              f"({row['dsv41_float32_vs_transformers_speed']:.2f}x), production "
              f"{row['dsv41_production_tokens_per_s']:8.1f} tok/s "
              f"({row['dsv41_production_vs_transformers_speed']:.2f}x transformers wall, "
              f"{row['dsv41_production_vs_transformers_cpu_speed']:.2f}x CPU time, "
              f"{row['dsv41_production_vs_reference_speed']:.2f}x reference); last-token logits "
              f"float32 diff {row['dsv41_float32_last_logits_max_abs_diff']:.1e}", flush=True)
    out = {"benchmark": "vs_transformers", "date": datetime.date.today().isoformat(),
           "commit": git_commit() or "unknown", "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "machine": platform.platform(), "torch_threads": torch.get_num_threads(),
           "transformers_version": transformers.__version__, "repeat": args.repeat,
           "model": hf.config.to_dict(),
           "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
