"""The model on a GPU against the CPU reference: prefill and greedy decode, tokens compared,
ms per token and peak memory recorded (one step of scripts/gpu_check.sh per model).

    python scripts/gpu_model.py --preset v41-small --json small.json
    python scripts/gpu_model.py --flash-layers 4 --flash-experts 8 --json flash.json

Models: a preset, or a Flash-width model (v41-flash dimensions: hidden 5120, 64 heads of
512, vocab 129,280) cut to a few layers (one SWA-only layer, then CSA ratio-2 encoder
layers and ratio-1 decoder layers) and a few routed experts. Weights are synthetic and
device-independent (drawn on the CPU from per-parameter seeds), so every model below holds
the same weights.

1. The CPU reference (reference precision: float32 weights, float64 math) prefills a random
   prompt and decodes --steps greedy tokens.
2. Each path on the device gets the same prompt and is fed the CPU's tokens (teacher
   forcing), so every step compares the same position:
   - "reference": the reference precision on the device. Its greedy token must equal the
     CPU's at every step, except where the CPU's top two logits lie within --tie-margin
     (a near tie either side may break), and every logit must be finite.
   - "bf16": the production path (Model.to_production(): bf16 weights, the CUDA kernels).
     Logits must be finite; its top-1 agreement with the CPU reference is recorded, not
     required (bf16 and float64 math disagree by design on near ties).
   Each path then times a --timing-prompt prefill and --timing-steps greedy decode steps
   (median ms per token, CUDA-synchronized) with the peak memory of the path (weights
   included).
A new runtime path (the paged engine) is one more entry in PATHS: a function that builds
the path for the config and returns a factory of sessions, each an object with
prefill(tokens) and decode(token) returning host float32 logits, like Session.

Exit code 0 when every path is ok, 1 otherwise; the JSON report is written either way.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from dsv41 import Model, ModelConfig  # noqa: E402
from dsv41.config.flash_width import flash_width  # noqa: E402

SEED = 0


class Session:
    """One sequence on one model: prefill, then one token at a time. Logits come back as
    float32 on the CPU."""

    def __init__(self, model: Model):
        self.model, self.state = model, model.new_state()

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.prefill(tokens, self.state).float().cpu()

    def decode(self, token: int) -> torch.Tensor:
        return self.model.decode_step(token, self.state).float().cpu()


def _reference(cfg: ModelConfig, device: str):
    model = Model.synthetic(cfg, SEED, device=device)
    return lambda: Session(model)


def _bf16(cfg: ModelConfig, device: str):
    model = Model.synthetic(cfg, SEED, device=device).to_production()
    return lambda: Session(model)


# name -> (build the path on a device, returning a factory of fresh Sessions; must its
# greedy tokens equal the CPU reference's)
PATHS = {"reference": (_reference, True), "bf16": (_bf16, False)}


def greedy(session: Session, prompt: torch.Tensor, steps: int, forced: list[int] | None = None
           ) -> tuple[list[torch.Tensor], list[float]]:
    """Logits after the prompt and after each of `steps` tokens (its own greedy choice, or
    forced[i] at step i), and the seconds of each decode step."""
    logits = [session.prefill(prompt)]
    seconds = []
    for i in range(steps):
        token = forced[i] if forced is not None else int(logits[-1].argmax())
        t0 = time.perf_counter()
        logits.append(session.decode(token))
        seconds.append(time.perf_counter() - t0)
    return logits, seconds


def compare(cpu: list[torch.Tensor], dev: list[torch.Tensor], tie_margin: float) -> dict:
    """Step by step: the CPU's and the device's greedy tokens, where they differ and by how
    much the CPU preferred its own (a near tie below tie_margin excuses a difference)."""
    mismatches, agree = [], 0
    max_diff = 0.0
    for step, (c, d) in enumerate(zip(cpu, dev)):
        tc, td = int(c.argmax()), int(d.argmax())
        max_diff = max(max_diff, float((c - d).abs().max()))
        if tc == td:
            agree += 1
            continue
        margin = float(c[tc] - c[td])
        mismatches.append({"step": step, "cpu": tc, "device": td, "cpu_margin": margin,
                           "near_tie": margin < tie_margin})
    return {"steps": len(cpu), "top1_agree": agree / max(len(cpu), 1),
            "greedy_tokens_equal": not mismatches, "mismatches": mismatches[:20],
            "unexcused_mismatches": sum(not m["near_tie"] for m in mismatches),
            "max_abs_logit_diff": max_diff}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timing(session: Session, device: str, prompt: torch.Tensor, steps: int) -> dict:
    """A prefill of `prompt`, then `steps` greedy decode steps, each ending with its
    logits on the host (as a sampler would read them) and the device synchronized."""
    _sync(device)
    t0 = time.perf_counter()
    logits = session.prefill(prompt)
    _sync(device)
    prefill_s = time.perf_counter() - t0
    step_s = []
    for _ in range(steps):
        token = int(logits.argmax())
        t0 = time.perf_counter()
        logits = session.decode(token)
        _sync(device)
        step_s.append(time.perf_counter() - t0)
    return {"prompt_tokens": int(prompt.numel()), "prefill_s": prefill_s,
            "prefill_tokens_per_s": prompt.numel() / prefill_s, "decode_steps": steps,
            "decode_ms_per_token_median": 1e3 * statistics.median(step_s) if step_s else None,
            "decode_ms_per_token_min": 1e3 * min(step_s) if step_s else None}


def _gb(n: int) -> float:
    return round(n / 2**30, 3)


def run_path(name: str, cfg: ModelConfig, device: str, prompt: torch.Tensor, cpu_logits: list,
             cpu_tokens: list[int], args) -> dict:
    build, must_match = PATHS[name]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    new_session = build(cfg, device)
    out = {"build_s": time.perf_counter() - t0}
    if cuda:
        out["weights_GB"] = _gb(torch.cuda.memory_allocated())
    logits, _ = greedy(new_session(), prompt, args.steps, forced=cpu_tokens)
    out["finite"] = all(bool(torch.isfinite(x).all()) for x in logits)
    out["vs_cpu_reference"] = compare(cpu_logits, logits, args.tie_margin)
    if args.timing_steps and name in args.timing_paths.split(","):
        gen = torch.Generator().manual_seed(SEED + 1)
        long_prompt = torch.randint(0, cfg.vocab_size, (args.timing_prompt,), generator=gen)
        out["timing"] = timing(new_session(), device, long_prompt, args.timing_steps)
    if cuda:
        out["peak_GB"] = _gb(torch.cuda.max_memory_allocated())
    out["tokens_must_match"] = must_match
    out["ok"] = out["finite"] and (not must_match or out["vs_cpu_reference"]["unexcused_mismatches"] == 0)
    del new_session
    gc.collect()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--preset", help="a model preset, e.g. v41-small")
    which.add_argument("--flash-layers", type=int, help="a Flash-width model of this many layers")
    p.add_argument("--flash-experts", type=int, default=8, help="routed experts of the Flash-width model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {list(PATHS)}")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens of the CPU comparison")
    p.add_argument("--steps", type=int, default=8, help="greedy decode steps compared with the CPU")
    p.add_argument("--tie-margin", type=float, default=1e-3,
                   help="a CPU top-1 lead (logits) below which a different device token is a near tie")
    p.add_argument("--timing-prompt", type=int, default=4096)
    p.add_argument("--timing-steps", type=int, default=16, help="0: no timing")
    p.add_argument("--timing-paths", default=",".join(PATHS), help="the paths to time")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU visible")
    paths = [s for s in args.paths.split(",") if s]
    unknown = [s for s in paths if s not in PATHS]
    if unknown:
        raise SystemExit(f"unknown paths {unknown}; known: {list(PATHS)}")

    try:
        cfg = (ModelConfig.preset(args.preset) if args.preset
               else flash_width(args.flash_layers, args.flash_experts))
    except ValueError as e:
        raise SystemExit(f"gpu_model: {e}")
    t_start = time.perf_counter()
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen)
    t0 = time.perf_counter()
    cpu_model = Model.synthetic(cfg, SEED, device="cpu")
    n_params = sum(p.numel() for p in cpu_model.parameters())
    cpu_logits, cpu_step_s = greedy(Session(cpu_model), prompt, args.steps)
    del cpu_model
    gc.collect()
    cpu_tokens = [int(x.argmax()) for x in cpu_logits]
    report = {
        "model": cfg.name, "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "routed_experts": cfg.n_routed_experts, "compress_ratios": list(cfg.compress_ratios),
        "parameters": n_params, "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "seed": SEED, "prompt_tokens": args.prompt, "steps": args.steps,
        "cpu_reference": {"tokens": cpu_tokens, "seconds": time.perf_counter() - t0,
                          "decode_ms_per_token_median": 1e3 * statistics.median(cpu_step_s) if cpu_step_s else None,
                          "finite": all(bool(torch.isfinite(x).all()) for x in cpu_logits)},
        "paths": {},
    }
    for name in paths:
        try:
            report["paths"][name] = run_path(name, cfg, args.device, prompt, cpu_logits, cpu_tokens, args)
        except Exception as e:  # one broken path must not hide the others' numbers
            report["paths"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        r = report["paths"][name]
        t = r.get("timing") or {}
        print(f"{cfg.name} {name}: ok={r['ok']} finite={r.get('finite')} top1 vs cpu "
              f"{(r.get('vs_cpu_reference') or {}).get('top1_agree')} decode "
              f"{t.get('decode_ms_per_token_median')} ms/token peak {r.get('peak_GB')} GB"
              + (f" error {r['error']}" if "error" in r else ""), file=sys.stderr)
    report["seconds"] = time.perf_counter() - t_start
    report["ok"] = report["cpu_reference"]["finite"] and all(r["ok"] for r in report["paths"].values())
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
