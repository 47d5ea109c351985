"""Greedy, temperature and top-p sampling with a per-request seeded generator."""
from __future__ import annotations

import torch

from .. import profiling
from .request import SamplingParams

__all__ = ["make_generator", "sample"]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


@profiling.traced("engine.sample")
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
