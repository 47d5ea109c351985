"""Which prefills and decodes go into one step.

Every step runs all running sequences' decodes (one token each, up to max_batch) and
admits waiting prompts first come, first served while the batch has room and their
prefill tokens fit max_prefill_tokens (the first waiting prompt is always admitted when
there is room, however long, so nothing starves). Prefills and decodes of a step run in
one model call (segments of different lengths).

Admission only decides: it asks a side-effect-free estimate of each waiting prompt's
prefill tokens and takes no cache reference. The engine then plans (cache lookup, pins)
exactly the sequences admitted, so a waiting sequence never holds cache blocks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .. import profiling
from .sequence import Sequence, Status

__all__ = ["Scheduler", "Step"]


@dataclass
class Step:
    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    def __init__(self, max_batch: int = 8, max_prefill_tokens: int = 8192):
        if max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch and max_prefill_tokens must be >= 1")
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @profiling.traced("engine.schedule",
                      lambda self, *a: {"waiting": len(self.waiting), "running": len(self.running)})
    def schedule(self, estimate: Callable[[Sequence], int]) -> Step:
        """estimate(seq) -> the prefill tokens a waiting sequence would compute; it must not
        change any state (it is asked again for a sequence refused this step)."""
        step = Step(decodes=self.running[: self.max_batch])
        budget = self.max_prefill_tokens
        while self.waiting and len(step.decodes) + len(step.prefills) < self.max_batch:
            seq = self.waiting[0]
            need = estimate(seq)
            if step.prefills and need > budget:
                break
            self.waiting.popleft()
            step.prefills.append(seq)
            budget -= need
        return step

    def start(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Takes a running or waiting sequence out of the schedule."""
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
