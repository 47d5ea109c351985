"""V4's persistence scheme beside V4.1's, on the same agent workload (engine/demo.py's).

    OMP_NUM_THREADS=1 PYTHONPATH=python python bench/bench_v4_scheme.py --json out.json

Schemes, each with its own empty store directory, synthetic weights:
  v4        v4-tiny, global KV + SWA checkpoints on the SSD (swa_checkpoint_tokens: the
            preset's persistent_swa_interval_tokens, 1024), replay off (V4 cannot replay)
  v4_nockpt v4-tiny, global KV only: the baseline V4 resume without checkpoints (recompute)
  v41       v41-tiny, global KV only, bounded encoder replay

The workload: a shared prefix warmed once, then conversations of several turns (user
messages, tool outputs, generated replies). Then the clock passes the host SWA pool's TTL
and every conversation takes one more turn: its resume TTFT is what a user sees coming back
after a break (V4: from the checkpoint; V4 without checkpoints: recompute; V4.1: bounded
replay). Reported per scheme: bytes written to disk per session token (global KV records +
SWA checkpoints; tokens = the distinct tokens of all sessions), bytes on disk after a flush,
and the resume TTFTs; ratios V4.1 / V4 from this run. The two models have different
dimensions (tiny presets), so the byte ratio is the tiny presets' measured one; the
computed Flash ratio (docs/config.md) is printed beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
from _meta import git_commit  # noqa: E402  (bench/ is on sys.path when run as a script)

from dsv41.budget import compare, kv_budget  # noqa: E402
from dsv41.cache import CacheConfig, PrefixCache  # noqa: E402
from dsv41.config import ModelConfig  # noqa: E402
from dsv41.engine import Engine, SamplingParams  # noqa: E402
from dsv41.engine.demo import _workload  # noqa: E402
from dsv41.model import Model  # noqa: E402


class _Clock:
    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def run_scheme(name: str, preset: str, checkpoints, replay: str, args, root: Path) -> dict:
    cfg = ModelConfig.preset(preset)
    model = Model.synthetic(cfg, seed=0)
    clock = _Clock()
    ttl = 300.0
    store = root / name
    cc = CacheConfig(block_tokens=args.block_tokens, device="cpu", gpu_capacity_bytes=256 << 20,
                     swa_capacity_bytes=256 << 20, swa_ttl_s=ttl, store_dir=str(store),
                     store_durability="fsync", swa_checkpoint_tokens=checkpoints)
    cache = PrefixCache.for_model(model, cc, clock=clock)
    eng = Engine(model, cache=cache, replay=replay, max_batch=1)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    shared, convs = _workload(args, cfg.vocab_size)
    eng.generate([shared], SamplingParams(max_new_tokens=1), namespace="bench")
    history = [list(shared) for _ in convs]
    turns = []
    for r in range(args.turns):
        for c in range(len(convs)):
            prompt = history[c] + convs[c][r][1]
            o = eng.generate([prompt], sp, namespace="bench")[0]
            turns.append({"conv": c, "turn": r, "path": o.stats.path, "ttft_ms": o.stats.ttft_s * 1e3})
            history[c] = prompt + o.output_tokens
    cache.flush()
    clock.offset += ttl + 1.0           # the host SWA snapshots expire
    g = torch.Generator().manual_seed(args.seed + 1)
    resume = []
    for c in range(len(convs)):
        prompt = history[c] + torch.randint(0, cfg.vocab_size, (args.user_tokens,), generator=g).tolist()
        o = eng.generate([prompt], SamplingParams(max_new_tokens=1), namespace="bench")[0]
        s = o.stats
        resume.append({"conv": c, "prompt_tokens": s.prompt_tokens, "path": s.path, "ttft_ms": s.ttft_s * 1e3,
                       "global_hit_tokens": s.global_hit_tokens, "swa_hit_tokens": s.swa_hit_tokens,
                       "prefill_tokens": s.prefill_tokens, "replayed_tokens": s.replayed_tokens})
    st = cache.stats()
    ck = st["swa_checkpoints"]
    cache.close()
    session_tokens = len(shared) + sum(len(h) - len(shared) for h in history)
    global_written = int(cache.metrics.bytes_written.value(tier="ssd"))
    ck_written = ck["bytes_written"] if ck else 0
    global_disk = st["ssd"]["file_bytes"]
    ck_disk = ck["bytes_on_disk"] if ck else 0
    return {
        "preset": preset, "replay": replay, "swa_checkpoint_tokens": cache.checkpoint_tokens,
        "session_tokens": session_tokens,
        "bytes_written": {"global_kv": global_written, "swa_checkpoints": ck_written,
                          "total": global_written + ck_written,
                          "per_token": (global_written + ck_written) / session_tokens},
        "bytes_on_disk": {"global_kv": global_disk, "swa_checkpoints": ck_disk, "total": global_disk + ck_disk},
        "checkpoints_written": ck["written"] if ck else 0,
        "resume_after_ttl": resume,
        "resume_ttft_ms_median": statistics.median(r["ttft_ms"] for r in resume),
        "turns": turns,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--tools-tokens", type=int, default=512)
    ap.add_argument("--repo-tokens", type=int, default=1024)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=96)
    ap.add_argument("--tool-tokens", type=int, default=384)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dsv41-v4-scheme-"))
    t0 = time.perf_counter()
    try:
        schemes = {
            "v4": run_scheme("v4", "v4-tiny", "auto", "off", args, root),
            "v4_nockpt": run_scheme("v4_nockpt", "v4-tiny", None, "off", args, root),
            "v41": run_scheme("v41", "v41-tiny", "auto", "bounded", args, root),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    v4, v41 = schemes["v4"], schemes["v41"]
    def computed(a: str, b: str) -> dict:
        c = compare(kv_budget(ModelConfig.preset(a)), kv_budget(ModelConfig.preset(b)))
        return {"global_ratio": c.global_ratio, "persistent_ratio": c.persistent_ratio}

    flash = computed("v41-flash", "v4-flash")
    commit = git_commit() or ""
    out = {
        "bench": "bench_v4_scheme", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": commit, "command": "OMP_NUM_THREADS=1 PYTHONPATH=python python " + " ".join(sys.argv),
        "machine": "shared CPU host (2 cores for ~7 agents: noisy timings), torch threads "
                   f"{torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
        "args": vars(args), "schemes": schemes,
        "ratios_v41_over_v4": {
            "bytes_written_per_token": v41["bytes_written"]["per_token"] / v4["bytes_written"]["per_token"],
            "bytes_on_disk": v41["bytes_on_disk"]["total"] / v4["bytes_on_disk"]["total"],
            "resume_ttft": v41["resume_ttft_ms_median"] / v4["resume_ttft_ms_median"],
        },
        "v4_checkpoints_vs_recompute_resume_ttft": (schemes["v4_nockpt"]["resume_ttft_ms_median"]
                                                    / v4["resume_ttft_ms_median"]),
        "computed_ratios_v41_over_v4": {"tiny": computed("v41-tiny", "v4-tiny"), "flash": flash},
        "wall_s": time.perf_counter() - t0,
    }
    text = json.dumps(out, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text + "\n")
    r = out["ratios_v41_over_v4"]
    for k, s in schemes.items():
        print(f"{k:10s} {s['preset']:9s} written {s['bytes_written']['per_token']:9.1f} B/token "
              f"(global {s['bytes_written']['global_kv']:,} + ckpt {s['bytes_written']['swa_checkpoints']:,}); "
              f"on disk {s['bytes_on_disk']['total']:,} B; resume TTFT median {s['resume_ttft_ms_median']:.1f} ms "
              f"({', '.join(x['path'] for x in s['resume_after_ttl'])})")
    print(f"V4.1 / V4: written per token {r['bytes_written_per_token']:.3f}, on disk {r['bytes_on_disk']:.3f}, "
          f"resume TTFT {r['resume_ttft']:.2f}; computed persistent ratio: tiny "
          f"{out['computed_ratios_v41_over_v4']['tiny']['persistent_ratio']:.3f}, flash {flash['persistent_ratio']:.3f}")


if __name__ == "__main__":
    main()
