"""One request's runtime state inside the engine: its KV (a per-sequence state, or a place
in the paged memory), plan, cache match, prefill progress, output so far and timings."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..model import SequenceState
from ..replay import ReplayConfig, ReplayPlan
from .request import Request, RequestOutput, RequestStats

__all__ = ["Status", "Sequence"]


class Status(enum.Enum):
    WAITING = "waiting"        # queued, no cache lookup yet, holds nothing
    PREFILLING = "prefilling"  # planned; its prompt runs in chunks
    RUNNING = "running"        # prefilled, decoding
    FINISHED = "finished"


@dataclass
class Sequence:
    request: Request
    replay: ReplayConfig
    arrival: float
    status: Status = Status.WAITING
    state: SequenceState | None = None        # the reference runtime's KV
    kv: object | None = None                  # the paged runtime's KV (paged_kv.SeqKV)
    plan: ReplayPlan | None = None
    # The tokens this sequence prefills (its prompt; after a preemption, the prompt and the
    # output so far) and how far it has come: positions [0, prefilled) are in its KV.
    prefill_tokens: list[int] = field(default_factory=list)
    prefilled: int = 0
    admitted_at: int = -1                     # admission order (preemption takes the newest)
    preemptions: int = 0
    all_logits: list[torch.Tensor] = field(default_factory=list)  # input logprobs, chunk by chunk
    match: object | None = None               # cache.PrefixMatch while running
    checkpointed_at: int = -1                 # position of its last SWA checkpoint on the SSD
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    logprobs: list = field(default_factory=list)    # TokenLogprob per output token
    stats: RequestStats = field(default_factory=RequestStats)
    finish_reason: str | None = None
    last_token_time: float = 0.0
    first_token_time: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=list(self.prompt), output_tokens=list(self.output),
            finished=self.status is Status.FINISHED, finish_reason=self.finish_reason,
            stats=self.stats, input_logprobs=self.input_logprobs,
            logits=list(self.logits) if self.request.sampling.return_logits else None,
            logprobs=list(self.logprobs) if self.request.sampling.logprobs is not None else None)
