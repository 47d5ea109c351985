"""Which prefill chunks and decodes go into one step.

A sequence is waiting (queued, holding nothing), prefilling (admitted: its prompt runs in
chunks over one or more steps) or running (decoding one token a step). Every step runs
each running sequence's decode, then gives the step's prefill budget (max_prefill_tokens)
to the prefilling sequences first come, first served, each a chunk of at most what is
left, then admits waiting prompts while the batch has room (max_batch sequences) and
budget is left. The first waiting prompt is admitted whenever there is room, however long:
its prompt runs in chunks, so nothing starves and one step's activations stay bounded by
the budget whatever the prompt length.

Admission only decides: the engine then plans (cache lookup, pins) exactly the sequences
admitted, so a waiting sequence never holds cache blocks or KV memory. `preempt` puts a
sequence back at the head of the queue when the KV memory runs out (the engine frees what
it held; it resumes by recomputing its tokens so far).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .. import profiling
from .sequence import Sequence, Status

__all__ = ["Chunk", "Scheduler", "Step"]


@dataclass
class Chunk:
    """The prompt tokens [start, start + tokens) of one prefilling sequence in this step."""

    seq: Sequence
    start: int
    tokens: int

    @property
    def last(self) -> bool:
        """This chunk ends the prompt: its logits give the first output token."""
        return self.start + self.tokens == len(self.seq.prefill_tokens)


@dataclass
class Step:
    prefills: list[Chunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    def __init__(self, max_batch: int = 8, max_prefill_tokens: int = 8192):
        if max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch and max_prefill_tokens must be >= 1")
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def active(self) -> int:
        return len(self.prefilling) + len(self.running)

    @profiling.traced("engine.schedule",
                      lambda self, *a: {"waiting": len(self.waiting), "running": len(self.running)})
    def admit(self, estimate: Callable[[Sequence], int],
              can_admit: Callable[[Sequence], bool] = lambda seq: True) -> list[Sequence]:
        """Waiting sequences to admit this step, in order. estimate(seq): the prefill tokens
        it would compute (side-effect free: it is asked again for a sequence refused now);
        can_admit(seq): the KV memory can take it (a free slot, pages for a first chunk)."""
        budget = self.max_prefill_tokens - sum(
            len(s.prefill_tokens) - s.prefilled for s in self.prefilling)
        out: list[Sequence] = []
        while self.waiting and self.active + len(out) < self.max_batch:
            seq = self.waiting[0]
            if out and estimate(seq) > budget:
                break
            if budget <= 0 and (out or self.prefilling):
                break
            if not can_admit(seq):
                break
            self.waiting.popleft()
            out.append(seq)
            budget -= estimate(seq)
        return out

    def plan(self, admitted: list[Sequence], *, chunked: bool = True) -> Step:
        """The step: every running decode, then prefill chunks (sequences already
        prefilling first, then the admitted ones, which must be planned by now: their
        prefill_tokens and prefilled are set) within max_prefill_tokens. chunked=False
        (the reference runtime): each prefilling sequence runs its whole prompt at once."""
        for seq in admitted:
            seq.status = Status.PREFILLING
            self.prefilling.append(seq)
        step = Step(decodes=list(self.running[: self.max_batch]), admitted=list(admitted))
        budget = self.max_prefill_tokens
        for seq in self.prefilling:
            left = len(seq.prefill_tokens) - seq.prefilled
            n = min(left, budget) if chunked else left
            if n <= 0:
                break
            step.prefills.append(Chunk(seq, seq.prefilled, n))
            budget -= n
        return step

    def prefilled(self, seq: Sequence) -> None:
        """The sequence's prompt is done: it decodes from the next step on."""
        seq.status = Status.RUNNING
        self.prefilling.remove(seq)
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Takes a sequence out of the schedule, wherever it is."""
        seq.status = Status.FINISHED
        for queue in (self.running, self.prefilling):
            if seq in queue:
                queue.remove(seq)
                return
        if seq in self.waiting:
            self.waiting.remove(seq)

    def preempt(self, seq: Sequence) -> None:
        """Back to the head of the queue (the engine has released what it held)."""
        for queue in (self.running, self.prefilling):
            if seq in queue:
                queue.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def newest(self) -> Sequence | None:
        """The most recently admitted active sequence (the first to preempt)."""
        active = self.prefilling + self.running
        return max(active, key=lambda s: s.admitted_at) if active else None
