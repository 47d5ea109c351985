"""Training sequences from the eval harness's own task generators and tokenizer.

One example is a task instance laid out exactly as `dsv41 eval` lays it out (eval/tasks:
the context with its evidence, then the suffix with the question), followed by the
answer a perfect model gives (`Task.reference_outputs`), EOS, the follow-up turn and its
answer, EOS: both turns of the matrix's `multi` output. The loss covers the answer tokens
and their EOS only.

Sizes, placements and suffix kinds are drawn at random around the harness's own (contexts
of 3-10 sliding windows, every evidence placement, every suffix kind), so the model
learns to answer from evidence anywhere in the context. Instance seeds are drawn from
[2^40, 2^41), far from the small seeds the eval matrix and the held-out sets use.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..eval.tasks import TASKS
from ..eval.tasks.base import PLACEMENTS, SUFFIX_KINDS, TaskError
from ..eval.tokenizer import EOS, CharTokenizer

__all__ = ["Example", "TASK_MIX", "HELD_OUT_SEED", "make_example", "held_out", "collate"]

# The share of each task in training batches: the retrieval tasks the targets name get
# the most; the structured ones are longer and learn their format quickly.
TASK_MIX = {"passkey": 0.3, "multihop": 0.25, "extraction": 0.2, "code_edit": 0.1,
            "tool_loop": 0.15}
TRAIN_SEEDS = (1 << 40, 1 << 41)
HELD_OUT_SEED = 1 << 20         # held-out sets: seeds from here on (the matrix uses 0, 1, ..)


@dataclass
class Example:
    task: str
    tokens: list[int]
    target: list[bool]           # token i is predicted (from i - 1) and counted in the loss
    answer: dict
    prompt_len: int
    context_len: int
    placement: str


def make_example(tok: CharTokenizer, *, task: str, seed: int, context_len: int, suffix: str,
                 hit: int, window: int, placement: str, long_tokens: int = 48) -> Example:
    t = TASKS[task]
    inst = t.make(tok, seed, context_len=context_len, suffix=suffix, hit=hit, window=window,
                  placement=placement, long_tokens=long_tokens)
    first, second = t.reference_outputs(inst.answer)
    tokens = list(inst.prompt)
    target = [False] * len(tokens)
    for turn, text in enumerate((first, second)):
        if turn:
            tokens += inst.followup
            target += [False] * len(inst.followup)
        ans = tok.encode(text) + [EOS]
        tokens += ans
        target += [True] * len(ans)
    return Example(task, tokens, target, inst.answer, len(inst.prompt), context_len, placement)


def random_example(rng: random.Random, tok: CharTokenizer, *, window: int, block: int,
                   contexts: tuple[int, int]) -> Example:
    """One training example with task, sizes and placement drawn from rng."""
    names = list(TASK_MIX)
    while True:
        task = rng.choices(names, weights=[TASK_MIX[n] for n in names])[0]
        context_len = rng.randrange(contexts[0], contexts[1] + 1)
        hit = block * rng.randrange(max(1, (window + block - 1) // block), context_len // block + 1)
        try:
            return make_example(tok, task=task, seed=rng.randrange(*TRAIN_SEEDS),
                                context_len=context_len,
                                suffix=rng.choices(SUFFIX_KINDS, weights=(1, 3, 1))[0],
                                hit=hit, window=window, placement=rng.choice(PLACEMENTS),
                                long_tokens=rng.randrange(16, 49))
        except TaskError:
            continue   # evidence that does not fit this context: draw again


def held_out(tok: CharTokenizer, task: str, n: int, *, context_len: int, window: int,
             placement: str = "before_boundary", suffix: str = "short",
             seed: int = HELD_OUT_SEED) -> list[Example]:
    """n held-out examples of one task: the hit at the context's end (aligned to 4 tokens),
    the evidence at `placement` relative to its replay boundary."""
    hit = context_len - context_len % 4
    return [make_example(tok, task=task, seed=seed + i, context_len=context_len, suffix=suffix,
                         hit=hit, window=window, placement=placement) for i in range(n)]


def collate(examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, T] (padding EOS) and the loss mask [B, T] (True where the
    token is a target)."""
    T = max(len(e.tokens) for e in examples)
    tokens = torch.full((len(examples), T), EOS, dtype=torch.int64)
    mask = torch.zeros(len(examples), T, dtype=torch.bool)
    for b, e in enumerate(examples):
        tokens[b, :len(e.tokens)] = torch.tensor(e.tokens)
        mask[b, :len(e.tokens)] = torch.tensor(e.target)
    return tokens, mask
