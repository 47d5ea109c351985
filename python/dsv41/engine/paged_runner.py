"""Runs one step of the paged runtime: the batch on the host, the forward on the device,
decode steps as CUDA graphs.

    runner = PagedRunner(model, memory, graphs=True)
    logits = runner.run(chunks)        # SeqChunk per sequence -> logits of the rows asked

A decode-only step (every sequence one token) with at most `max(GRAPH_BATCHES)` sequences
is padded to the next batch bucket (1, 2, 4, 8, 16, 32, 64, 128, 256) and its entry tables
to the next context bucket (a power of two of tokens, at least MIN_CONTEXT_BUCKET), so its
shapes depend only on (batch bucket, context bucket). On a GPU that step is captured once
per key as a CUDA graph and replayed with the new batch copied into the graph's inputs;
the key's attention plans (model.paged.AttentionPlans: kernel, splits, workspace) are made
in the eager warm-up before the capture, so the captured step decides nothing;
every other step (prefill chunks, a batch past the largest bucket, graphs off, the CPU)
runs eagerly. The padded step is also what runs eagerly on the CPU when `pad_decode` is
set, so the bucketing is testable without a GPU; padding never changes a real row's result
(model/paged/batch.py).
"""
from __future__ import annotations

import logging

import torch

from .. import profiling
from ..model.paged import AttentionPlans, Batch, SeqChunk, build_batch, forward
from .paged_kv import PagedMemory

__all__ = ["GRAPH_BATCHES", "MIN_CONTEXT_BUCKET", "PagedRunner"]

log = logging.getLogger("dsv41.engine")

GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_CONTEXT_BUCKET = 256


def batch_bucket(n: int) -> int | None:
    return next((b for b in GRAPH_BATCHES if b >= n), None)


def context_bucket(tokens: int) -> int:
    return max(MIN_CONTEXT_BUCKET, 1 << max(0, tokens - 1).bit_length())


class _DecodeGraph:
    """One captured decode step: static device inputs (a Batch), the graph, its logits."""

    def __init__(self, model, memory: PagedMemory, example: Batch, pool, plans: AttentionPlans):
        self.static = example.to(memory.model.device)
        stream = torch.cuda.Stream(device=self.static.tokens.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm up off the capture: caches, plans, workspaces
            forward(model, self.static, memory.kv, plans)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = forward(model, self.static, memory.kv, plans)

    def run(self, batch: Batch) -> torch.Tensor:
        for dst, src in zip(self.static.tensors(), batch.tensors()):
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.logits


class PagedRunner:
    def __init__(self, model, memory: PagedMemory, *, graphs: bool = True,
                 pad_decode: bool | None = None):
        """graphs: capture decode steps as CUDA graphs on a GPU (ignored on the CPU).
        pad_decode: pad decode steps to their buckets when running eagerly too (default:
        only when graphs run)."""
        self.model, self.memory = model, memory
        on_gpu = model.device.type == "cuda"
        self.graphs = bool(graphs) and on_gpu
        self.pad_decode = self.graphs if pad_decode is None else bool(pad_decode)
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        # attention plans per (batch bucket, context bucket): what a padded decode step runs
        self._plans: dict[tuple[int, int], AttentionPlans] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.counters = {"steps": 0, "graph_steps": 0, "graphs_captured": 0}

    def _build(self, chunks: list[SeqChunk], **pad) -> Batch:
        c, mem = self.model.config, self.memory
        return build_batch(chunks, window=c.sliding_window, page_tokens=mem.page_tokens,
                           ratios=mem.ratios, num_slots=mem.kv.num_slots,
                           decoder=c.encoder_decoder, pad_slot=mem.kv.pad_slot, **pad)

    @profiling.traced("engine.paged_step", lambda self, chunks: {"requests": len(chunks)})
    def run(self, chunks: list[SeqChunk]) -> list[torch.Tensor | None]:
        """Each chunk's logits: [vocab] (its last token), [n, vocab] (all_logits), or None
        (logits=False)."""
        self.counters["steps"] += 1
        decode = all(len(ch.tokens) == 1 and ch.logits and not ch.all_logits for ch in chunks)
        bucket = batch_bucket(len(chunks)) if decode and self.pad_decode else None
        if bucket is None:
            batch = self._build(chunks)
            logits = forward(self.model, batch.to(self.model.device, non_blocking=True),
                             self.memory.kv)
        else:
            cap = context_bucket(max(ch.start + 1 for ch in chunks))
            batch = self._build(chunks, pad_to=bucket, context_cap=cap, pad_logits=True)
            if self.graphs:
                logits = self._graph(bucket, cap, batch).run(batch)
                self.counters["graph_steps"] += 1
            else:
                logits = forward(self.model, batch.to(self.model.device, non_blocking=True),
                                 self.memory.kv, self._plans_for(bucket, cap))
        out, at = [], 0
        for ch, n in zip(chunks, batch.logit_counts):
            out.append(None if n == 0 else logits[at] if n == 1 and not ch.all_logits
                       else logits[at:at + n])
            at += n
        return out

    def _plans_for(self, bucket: int, cap: int) -> AttentionPlans:
        key = (bucket, cap)
        plans = self._plans.get(key)
        if plans is None:
            plans = self._plans[key] = AttentionPlans(self.model.device)
        return plans

    def _graph(self, bucket: int, cap: int, batch: Batch) -> _DecodeGraph:
        key = (bucket, cap)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = _DecodeGraph(self.model, self.memory, batch, self._pool,
                                                 self._plans_for(bucket, cap))
            self.counters["graphs_captured"] += 1
            log.info("captured the decode step for batch %d, context %d as a CUDA graph",
                     bucket, cap)
        return g
