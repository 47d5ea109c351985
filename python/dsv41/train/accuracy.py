"""Task accuracy of a model on held-out prompts: full prefill, greedy, through the engine
with no cache (the serving forward, so with the stored KV formats unless the model was
loaded with kv_dtype="float32"), scored by the task's own scorer.

    python -m dsv41.train.accuracy [--model v41-tiny-tasks] [--n 100] [--json OUT]

Prompts are `data.held_out` sets (seeds from HELD_OUT_SEED, never drawn in training and
not the eval matrix's), one per task x context x placement; intervals are Wilson 95%.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from ..eval.runner import Progress
from ..eval.tasks import TASKS
from ..eval.tokenizer import EOS, CharTokenizer
from .data import held_out

__all__ = ["greedy", "task_accuracy", "wilson"]


def greedy(model, prompt: list[int], max_new_tokens: int, engine=None) -> list[int]:
    """Greedy output of a full prefill of prompt, stopping after EOS: `Engine.generate`
    with no cache (pass `engine` to reuse one)."""
    from ..engine import Engine, SamplingParams
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=(EOS,))
    return (engine or Engine(model)).generate([prompt], sp)[0].output_tokens


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, mid - half), min(1.0, mid + half))


def task_accuracy(model, task: str, n: int, *, context_len: int, placement: str,
                  suffix: str = "short", max_new_tokens: int = 48, seed: int | None = None,
                  progress=None) -> dict:
    """Greedy success rate on n held-out prompts of one task; the first turn is scored."""
    tok = CharTokenizer(model.config.vocab_size)
    kw = {} if seed is None else {"seed": seed}
    examples = held_out(tok, task, n, context_len=context_len, window=model.config.sliding_window,
                        placement=placement, suffix=suffix, **kw)
    from ..engine import Engine
    engine = Engine(model)
    ok = 0
    for i, ex in enumerate(examples):
        out = greedy(model, ex.tokens[:ex.prompt_len], max_new_tokens, engine)
        ok += bool(TASKS[task].score(ex.answer, [tok.decode(out)])["success"])
        if progress:
            progress(i + 1, n)
    lo, hi = wilson(ok, n)
    return {"task": task, "context": context_len, "placement": placement, "suffix": suffix,
            "n": n, "success": ok, "rate": ok / n, "ci95": [round(lo, 4), round(hi, 4)]}


def main(argv=None) -> int:
    from ..checkpoints import resolve
    from ..model import Model

    ap = argparse.ArgumentParser(prog="python -m dsv41.train.accuracy", description=__doc__)
    ap.add_argument("--model", default="v41-tiny-tasks", help="checkpoint dir or shipped name")
    ap.add_argument("--kv-dtype", default="stored", choices=("stored", "float32"))
    ap.add_argument("--n", type=int, default=100, help="prompts per (task, context, placement)")
    ap.add_argument("--tasks", default="passkey,multihop,extraction")
    ap.add_argument("--contexts", default="64,128", help="context lengths (4 and 8 windows of v41-tiny)")
    ap.add_argument("--placements", default="before_boundary,across_boundary,far_behind")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", metavar="OUT", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = Model.from_pretrained(resolve(args.model), kv_dtype=args.kv_dtype)
    rows = []
    t0 = time.time()
    combos = [(t, int(c), p) for t in args.tasks.split(",") for c in args.contexts.split(",")
              for p in args.placements.split(",")]
    bar = Progress(len(combos) * args.n, unit="prompts")
    for task, ctx, place in combos:
        r = task_accuracy(model, task, args.n, context_len=ctx, placement=place,
                          progress=lambda i, n, label=f"{task} ctx {ctx} {place}": bar.advance(1, label))
        rows.append(r)
    bar.close()
    for r in rows:
        sys.stderr.write(f"{r['task']} ctx {r['context']} {r['placement']}: {r['success']}/{r['n']} "
                         f"-> {r['rate']:.3f} {r['ci95']}\n")
    per_task = {}
    for task in args.tasks.split(","):
        k = sum(r["success"] for r in rows if r["task"] == task)
        n = sum(r["n"] for r in rows if r["task"] == task)
        lo, hi = wilson(k, n)
        per_task[task] = {"n": n, "success": k, "rate": k / n, "ci95": [round(lo, 4), round(hi, 4)]}
    result = {"model": str(args.model), "kv_dtype": args.kv_dtype, "greedy": True,
              "prefill": "full", "rows": rows, "per_task": per_task,
              "wall_s": round(time.time() - t0, 1), "threads": args.threads}
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(json.dumps(per_task, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
