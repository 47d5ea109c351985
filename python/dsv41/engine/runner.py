"""Calls the model for one step: every scheduled prefill (plain, replay or resume, with or
without decoder replay) and every decode as one `extend_batch` call."""
from __future__ import annotations

from typing import Callable

import torch

from .. import profiling
from ..model import Extend, Model
from .sequence import Sequence

__all__ = ["ModelRunner"]


class ModelRunner:
    def __init__(self, model: Model):
        self.model = model

    def run(self, prefills: list[Sequence], decodes: list[Sequence],
            checkpoints: Callable[[Sequence], list[int]] | None = None,
            checkpoint: Callable[[Sequence], None] | None = None) -> list[torch.Tensor]:
        """Logits per sequence, prefills first: [vocab], or [T, vocab] for a prefill that
        asked for input logprobs. checkpoints(seq): the positions inside a prefill where
        V4's SWA checkpoints are due; the prefill runs up to each first (the engine's
        PrefixIO), then checkpoint(seq) writes it."""
        items = []
        for seq in prefills:
            p = seq.plan
            for b in (checkpoints(seq) if checkpoints is not None else ()):
                self.model.extend_batch([Extend(seq.prompt[seq.state.position:b], seq.state, swa_start=p.swa_start,
                                                cached_until=p.cached_until)])
                checkpoint(seq)
            items.append(Extend(seq.prompt[seq.state.position:], seq.state, swa_start=p.swa_start,
                                cached_until=p.cached_until,
                                decoder_start=p.decoder_start if p.decoder_replay else None,
                                all_logits=seq.request.sampling.input_logprobs))
        for seq in decodes:
            items.append(Extend([seq.output[-1]], seq.state))
        if not items:
            return []
        with _forward_range(prefills, decodes):
            return self.model.extend_batch(items)


def _forward_range(prefills: list[Sequence], decodes: list[Sequence]):
    """One NVTX range for the step's one model call, named after its heaviest part (a
    step's prefills, replays and decodes run batched together); counts in the payload."""
    if not profiling.enabled():
        return profiling.NULL
    replayed = sum(s.plan.replayed_tokens for s in prefills)
    name = ("engine.encoder_replay" if replayed else "engine.prefill") if prefills else "engine.decode"
    return profiling.scope(name, requests=len(prefills) + len(decodes), prefill_requests=len(prefills),
                           prefill_tokens=sum(s.plan.computed_tokens for s in prefills),
                           replayed_tokens=replayed,
                           decoder_tokens=sum(s.plan.decoder_tokens for s in prefills),
                           decode_tokens=len(decodes))
