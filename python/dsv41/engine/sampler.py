"""Greedy, temperature and top-p sampling with a per-request seeded generator."""
from __future__ import annotations

import torch

from .. import profiling
from .request import SamplingParams

__all__ = ["make_generator", "sample", "sample_rows"]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from logits [vocab] (float32)."""
    logits = logits.detach().float().cpu()
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, 0) - sorted_p   # mass of the strictly better tokens
        keep = before < params.top_p                     # always keeps the best token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@profiling.traced("engine.sample", lambda rows, *a: {"requests": len(rows)})
def sample_rows(rows: list[torch.Tensor], params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
    """One token id per logits row. The greedy rows are decided together on the rows'
    device (one argmax, one transfer of their ids); the others one by one (sample)."""
    out: list[int | None] = [None] * len(rows)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        ids = torch.stack([rows[i].detach() for i in greedy]).argmax(-1).tolist()
        for i, t in zip(greedy, ids):
            out[i] = int(t)
    for i, (lg, p, g) in enumerate(zip(rows, params, generators)):
        if out[i] is None:
            out[i] = sample(lg, p, g)
    return out
