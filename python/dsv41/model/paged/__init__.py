"""The paged step: many sequences per forward, KV in a shared page pool and per-sequence
slots (docs/paged.md). batch.py builds a step's index tensors on the host, memory.py holds
the slot memory and the view of the pool the forward reads, step.py runs the layers."""
from __future__ import annotations

from .batch import Batch, BatchShape, Compression, SeqChunk, View, build_batch
from .step import AttentionPlans, forward
from .memory import PagedKV, SlotMemory, SlotsExhausted, paged_support

__all__ = ["AttentionPlans", "Batch", "BatchShape", "Compression", "PagedKV", "SeqChunk", "SlotMemory",
           "SlotsExhausted", "View", "build_batch", "forward", "paged_support"]
