"""The training run: recipe, optimizer, schedule, logging, plot and checkpoint.

    python -m dsv41.train --out models/v41-tiny-tasks       (docs/train.md)

Reproducible from the recipe's seed: the initial weights (Model.synthetic(config, seed)),
the batches (one random.Random(seed) draws every example) and the optimizer are all
deterministic on one machine and thread count.

Stages (DeepSeek-V3.2's indexer recipe, scaled down): the first `dense_steps` steps run
the main attention over every visible global entry while the indexer learns to predict
that attention (its KL term); then the sparse stage runs the top-k the indexer selects,
the KL term still training the indexer; the last `fake_quant_steps` read the KV as the
stored formats round it (forward.py `fake_quant`). `init` starts from a checkpoint (a
fine-tuning stage; its recipe is kept as recipe.init.json). The loss is the cross-entropy of the answer
tokens (data.py) plus `kl_weight` times the mean indexer KL.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig
from ..eval.runner import Progress
from ..eval.tokenizer import CharTokenizer
from ..model import Model
from .data import HELD_OUT_SEED, Example, collate, held_out, random_example
from .forward import balance_bias, check_trainable, train_forward

__all__ = ["Recipe", "train", "answer_accuracy"]


@dataclass
class Recipe:
    preset: str = "v41-tiny"
    seed: int = 0
    steps: int = 1500
    batch: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    dense_steps: int = 250
    kl_weight: float = 1.0
    kl_stride: int = 4
    bias_rate: float = 1e-3
    contexts: tuple[int, int] = (48, 144)
    block: int = 4
    threads: int = 2
    eval_every: int = 100
    held_out_per_task: int = 32
    held_out_context: int = 96
    fake_quant_steps: int = 0       # the last N steps read the KV as stored (QAT)
    init: str = ""                  # start from this checkpoint instead of Model.synthetic
    notes: dict = field(default_factory=dict)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        t = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _trainable(model: Model) -> list[torch.nn.Parameter]:
    params = []
    for name, p in model.named_parameters():
        if name.endswith("gate.bias"):
            continue          # steered by balance_bias, not by gradient
        p.requires_grad_(True)
        params.append(p)
    return params


def answer_accuracy(model: Model, examples: list[Example], *, batch: int = 32) -> dict:
    """Teacher-forced answer accuracy with the training forward (unquantized KV, top-k):
    "exact" = every answer token (and EOS) is the argmax, which is exactly when greedy
    decoding reproduces the answers; "token" = the share of answer tokens that are."""
    exact = tokens_ok = tokens_all = 0
    with torch.no_grad():
        for i in range(0, len(examples), batch):
            ex = examples[i:i + batch]
            toks, mask = collate(ex)
            logits = train_forward(model, toks, index_loss=False).logits[:, :-1]
            ok = (logits.argmax(-1) == toks[:, 1:]) | ~mask[:, 1:]
            exact += int(ok.all(1).sum())
            tokens_ok += int((ok & mask[:, 1:]).sum())
            tokens_all += int(mask[:, 1:].sum())
    return {"exact": exact / len(examples), "token": tokens_ok / max(1, tokens_all)}


def _batches(recipe: Recipe, rng: random.Random, tok: CharTokenizer, window: int):
    """Batches of similar length (less padding): draw 8 batches' worth, sort, split."""
    while True:
        pool = [random_example(rng, tok, window=window, block=recipe.block,
                               contexts=recipe.contexts) for _ in range(8 * recipe.batch)]
        pool.sort(key=lambda e: len(e.tokens))
        chunks = [pool[i:i + recipe.batch] for i in range(0, len(pool), recipe.batch)]
        rng.shuffle(chunks)
        yield from chunks


def train(recipe: Recipe, out: str | Path, *, progress: bool = True) -> dict:
    """Train, then save the checkpoint (Model.save_pretrained), recipe.json,
    train_log.jsonl and training.png into out. Returns the final held-out accuracies."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    config = ModelConfig.preset(recipe.preset)
    check_trainable(config)
    if recipe.init:
        model = Model.from_pretrained(recipe.init, kv_dtype="float32")
        if model.config.fingerprint() != config.fingerprint():
            raise ValueError(f"init checkpoint {recipe.init} is not a {recipe.preset} model")
    else:
        model = Model.synthetic(config, seed=recipe.seed, kv_dtype="float32")
    tok = CharTokenizer(config.vocab_size)
    W = config.sliding_window
    params = _trainable(model)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=recipe.lr, betas=(0.9, 0.95))
    rng = random.Random(recipe.seed)
    held = {task: held_out(tok, task, recipe.held_out_per_task, context_len=recipe.held_out_context,
                           window=W, seed=HELD_OUT_SEED)
            for task in ("passkey", "multihop", "extraction")}
    (out / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2) + "\n")
    if recipe.init and (Path(recipe.init) / "recipe.json").is_file():   # the earlier stage
        (out / "recipe.init.json").write_text((Path(recipe.init) / "recipe.json").read_text())
    log_path = out / "train_log.jsonl"
    log = log_path.open("w")
    bar = Progress(recipe.steps, enabled=progress, unit="steps", label_width=80)
    t0 = time.time()
    batches = _batches(recipe, rng, tok, W)
    ema = None
    for step in range(recipe.steps):
        for g in opt.param_groups:
            g["lr"] = recipe.lr_at(step)
        toks, mask = collate(next(batches))
        dense = step < recipe.dense_steps
        fq = step >= recipe.steps - recipe.fake_quant_steps
        fwd = train_forward(model, toks, dense=dense, kl_stride=recipe.kl_stride, fake_quant=fq)
        logits = fwd.logits[:, :-1]
        target = toks[:, 1:]
        m = mask[:, 1:]
        lm = torch.nn.functional.cross_entropy(logits[m], target[m])
        kl = torch.stack(list(fwd.index_kl.values())).mean()
        loss = lm + recipe.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, recipe.grad_clip)
        opt.step()
        balance_bias(model, fwd.expert_load, recipe.bias_rate)
        with torch.no_grad():
            acc = float((logits[m].argmax(-1) == target[m]).float().mean())
        ema = (lm.item(), acc) if ema is None else (0.95 * ema[0] + 0.05 * lm.item(),
                                                     0.95 * ema[1] + 0.05 * acc)
        rec = {"step": step + 1, "loss": lm.item(), "index_kl": kl.item(),
               "index_kl_per_layer": {str(k): round(v.item(), 5) for k, v in fwd.index_kl.items()},
               "token_acc": acc, "lr": recipe.lr_at(step), "grad_norm": float(gnorm),
               "dense": dense, "fake_quant": fq, "tokens": int(toks.numel()), "elapsed_s": round(time.time() - t0, 2)}
        if (step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps:
            rec["held_out"] = {task: answer_accuracy(model, ex) for task, ex in held.items()}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        ho = rec.get("held_out")
        extra = "" if not ho else " held-out " + " ".join(
            f"{t[:4]} {v['exact']:.2f}" for t, v in ho.items())
        bar.advance(1, f"loss {ema[0]:.3f} acc {ema[1]:.3f} kl {kl.item():.3f}{extra}")
    bar.close()
    log.close()
    for p in params:
        p.requires_grad_(False)
    model.save_pretrained(out)
    final = {task: answer_accuracy(model, ex) for task, ex in held.items()}
    plot_log(log_path, out / "training.png")
    return final


def plot_log(log_path: Path, png: Path) -> None:
    """Loss, indexer KL and answer accuracy (train batches; held-out exact match)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line]
    steps = [r["step"] for r in recs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(steps, [r["loss"] for r in recs], lw=0.6, label="answer cross-entropy")
    a1.plot(steps, [r["index_kl"] for r in recs], lw=0.6, label="indexer KL (mean)")
    a1.set_yscale("log")
    a1.set_xlabel("step")
    a1.legend()
    a1.set_title("losses")
    a2.plot(steps, [r["token_acc"] for r in recs], lw=0.5, alpha=0.6, label="train answer tokens")
    ev = [r for r in recs if "held_out" in r]
    for task in (ev[0]["held_out"] if ev else {}):
        a2.plot([r["step"] for r in ev], [r["held_out"][task]["exact"] for r in ev], marker="o",
                ms=3, label=f"held-out {task} (exact)")
    a2.set_ylim(0, 1.02)
    a2.set_xlabel("step")
    a2.legend(fontsize=8)
    a2.set_title("accuracy")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
