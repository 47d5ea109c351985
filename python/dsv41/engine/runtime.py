"""Where a sequence's KV lives and how a step runs: the two runtimes behind the engine.

    runtime = PagedRuntime(model, cache, max_batch=64, max_prefill_tokens=8192)   # default
    runtime = ReferenceRuntime(model, cache)                      # the per-sequence oracle

Both answer the engine through the same calls, in this order for a sequence:
estimate (admission cost, no side effect), can_admit, plan (cache lookup, pins, replay plan,
KV to prefill from), then per step prepare (memory for the step; may name a sequence to
preempt) and run (logits of the chunks and decodes), after_prefill (the prompt's blocks and
SWA snapshot to the cache), finish (the output's too, then release) or abort / preempt
(release only).

PagedRuntime: the KV memory is one page pool - the prefix cache's GPU tier when there is a
cache - and per-sequence slots (engine/paged_kv.py); a step is one batched forward over all
sequences (model/paged), decode steps replayed as CUDA graphs on a GPU
(engine/paged_runner.py); a prefix hit maps the cached pages, and the cache adopts a
sequence's full pages in place (no copy either way). Prompts run in chunks of the step's
prefill budget. When the pool cannot supply pages, the newest sequence is preempted: its
memory is released and it is recomputed later from its prompt and output so far.

ReferenceRuntime: one SequenceState per sequence (model/state.py), imported from and
exported to the cache by copies (engine/prefix.py), each step one extend_batch call; a
prompt runs in one piece. It is exact and chunk-invariant, and it is what the paged runtime
is tested against.
"""
from __future__ import annotations

import logging

import torch

from .. import profiling
from ..budget import kv_budget
from ..cache import PrefixCache
from ..cache.errors import PoolFullError
from ..cache.global_pool import GlobalKVPool
from ..cache.layout import DEFAULT_BLOCK_TOKENS, BlockLayout
from ..model import Extend, Model
from ..model.paged import SeqChunk, paged_support
from .paged_kv import PagedMemory
from .paged_runner import PagedRunner
from .prefix import PrefixIO
from .scheduler import Chunk, Step
from .sequence import Sequence

__all__ = ["RUNTIMES", "PagedRuntime", "ReferenceRuntime", "make_runtime", "page_pool_usage"]

log = logging.getLogger("dsv41.engine")

RUNTIMES = ("auto", "paged", "reference")


class ReferenceRuntime:
    """Per-sequence states (see the module docstring)."""

    name = "reference"
    chunked = False

    def __init__(self, model: Model, cache: PrefixCache | None, *, write_approximate: bool = True):
        self.model, self.cache = model, cache
        self.prefix = PrefixIO(model, cache, write_approximate)

    def estimate(self, seq: Sequence) -> int:
        return self.prefix.estimate(seq)

    def can_admit(self, seq: Sequence) -> bool:
        return True

    def check_request(self, n_tokens: int) -> None:
        return None

    def plan(self, seq: Sequence) -> None:
        self.prefix.plan(seq)

    def prepare(self, step: Step) -> Sequence | None:
        return None

    @profiling.traced("engine.reference_step",
                      lambda self, step: {"prefills": len(step.prefills),
                                          "decodes": len(step.decodes)})
    def run(self, step: Step) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        every = self.prefix.checkpoint_tokens
        items = []
        for ch in step.prefills:
            seq, p = ch.seq, ch.seq.plan
            end = ch.start + ch.tokens
            for b in (self.prefix.prefill_checkpoints(seq) if every else ()):
                if ch.start < b < end:        # V4's SWA checkpoints inside this chunk
                    self.model.extend_batch([Extend(seq.prefill_tokens[seq.state.position:b],
                                                    seq.state, swa_start=p.swa_start,
                                                    cached_until=_cached(p, seq.state.position))])
                    self.prefix.checkpoint(seq)
            pos = seq.state.position
            items.append(Extend(seq.prefill_tokens[pos:end], seq.state, swa_start=p.swa_start,
                                cached_until=_cached(p, pos),
                                decoder_start=p.decoder_start if p.decoder_replay else None,
                                all_logits=seq.request.sampling.input_logprobs))
        for seq in step.decodes:
            items.append(Extend([seq.output[-1]], seq.state))
        if not items:
            return [], []
        logits = self.model.extend_batch(items)
        n = len(step.prefills)
        return logits[:n], logits[n:]

    def advance(self, chunk: Chunk | None, seq: Sequence) -> None:
        """The step ran (the state moved itself); V4's checkpoint cadence on decodes."""
        if chunk is None and self.prefix.checkpoint_tokens \
                and self.prefix.decode_checkpoint_due(seq):
            self.prefix.checkpoint(seq)

    def after_prefill(self, seq: Sequence) -> None:
        self.prefix.write_back(seq)

    def finish(self, seq: Sequence) -> dict[str, int]:
        """Cache the output's blocks and snapshot, release, and return the KV bytes the
        sequence held per ledger."""
        self.prefix.write_back(seq)
        held = seq.state.nbytes()
        self.release(seq)
        return held

    def release(self, seq: Sequence) -> None:
        self.prefix.release(seq)
        seq.state = None

    preempt = release

    def position(self, seq: Sequence) -> int:
        return seq.state.position

    def memory_stats(self) -> dict[str, dict]:
        return {}


class PagedRuntime:
    """One page pool, per-sequence slots, a batched step (see the module docstring)."""

    name = "paged"
    chunked = True

    def __init__(self, model: Model, cache: PrefixCache | None, *, max_batch: int,
                 max_prefill_tokens: int, write_approximate: bool = True,
                 kv_memory_bytes: int | None = None, graphs: bool = True):
        self.model, self.cache = model, cache
        self.prefix = PrefixIO(model, cache, write_approximate)     # lookups, write-back rule
        if cache is not None:
            pool = cache.pool
        else:
            layout = BlockLayout(model.config, DEFAULT_BLOCK_TOKENS)
            pool = GlobalKVPool(layout, kv_memory_bytes or default_kv_memory(model),
                                device=model.device)
        self.memory = PagedMemory(model, pool, max_seqs=max_batch,
                                  max_step_tokens=max_prefill_tokens + max_batch)
        self.runner = PagedRunner(model, self.memory, graphs=graphs)
        self.page_tokens = self.memory.page_tokens

    # ---- admission and planning ---------------------------------------------------------

    def estimate(self, seq: Sequence) -> int:
        return self.prefix.estimate(seq)

    def can_admit(self, seq: Sequence) -> bool:
        return self.memory.free_slots > 0 and self.memory.pool.num_free() > 0

    def check_request(self, n_tokens: int) -> None:
        """Refuse a request the KV memory could never hold, however empty."""
        need = -(-n_tokens // self.page_tokens)
        if need > self.memory.pool.num_blocks:
            raise ValueError(f"the request needs {need} KV pages of {self.page_tokens} tokens "
                             f"for {n_tokens} tokens; the KV memory holds "
                             f"{self.memory.pool.num_blocks} (raise the cache's "
                             f"gpu_capacity_bytes or the engine's kv_memory_bytes)")

    @profiling.traced("engine.plan",
                      lambda self, seq: {"requests": 1, "tokens": len(seq.prefill_tokens)})
    def plan(self, seq: Sequence) -> None:
        snap = self.prefix.lookup(seq)
        plan, st = seq.plan, seq.stats
        kv = seq.kv = self.memory.open()
        nb = plan.import_tokens // self.page_tokens
        if nb:
            kv.map_pages(seq.match.block_ids[:nb])        # read in place, no copy
            st.bytes["global_read"] = 0
        if plan.path == "both_hit":
            self.memory.restore(kv, snap)
            st.bytes["swa_read"] = snap.nbytes
        elif plan.path == "encoder_replay":
            kv.position, kv.tokens = plan.start, list(seq.prefill_tokens[:plan.start])
        seq.prefilled = kv.position

    # ---- a step ---------------------------------------------------------------------------

    def prepare(self, step: Step) -> Sequence | None:
        """Pages for every token of the step; None, or a sequence that could not get its
        pages (the engine preempts the newest sequence and asks again)."""
        for ch in step.prefills:
            if not self._ensure(ch.seq, ch.start + ch.tokens):
                return ch.seq
        for seq in step.decodes:
            if not self._ensure(seq, seq.kv.position + 1):
                return seq
        return None

    def _ensure(self, seq: Sequence, end: int) -> bool:
        try:
            self.memory.ensure(seq.kv, end)
            return True
        except PoolFullError:
            return False

    def run(self, step: Step) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        chunks = []
        for ch in step.prefills:
            seq, p, kv = ch.seq, ch.seq.plan, ch.seq.kv
            d = p.decoder_start if p.decoder_replay else None
            all_logits = seq.request.sampling.input_logprobs
            chunks.append(SeqChunk(
                seq.prefill_tokens[ch.start: ch.start + ch.tokens], kv.position, kv.slot,
                kv.pages, swa_start=p.swa_start, cached_until=_cached(p, kv.position),
                decoder_start=d,
                decoder_swa_start=(d if d is not None and d > p.start else p.swa_start),
                all_logits=all_logits, logits=ch.last or all_logits))
        for seq in step.decodes:
            kv = seq.kv
            chunks.append(SeqChunk([seq.output[-1]], kv.position, kv.slot, kv.pages))
        if not chunks:
            return [], []
        out = self.runner.run(chunks)
        n = len(step.prefills)
        return out[:n], out[n:]

    def advance(self, chunk: Chunk | None, seq: Sequence) -> None:
        kv = seq.kv
        if chunk is None:
            kv.tokens.append(seq.output[-1])
            kv.position += 1
        else:
            kv.tokens += seq.prefill_tokens[chunk.start: chunk.start + chunk.tokens]
            kv.position += chunk.tokens

    # ---- write-back and release -----------------------------------------------------------

    def after_prefill(self, seq: Sequence) -> None:
        self._write_back(seq)

    def finish(self, seq: Sequence) -> dict[str, int]:
        self._write_back(seq)
        held = kv_budget(self.model.config).bytes_for(seq.kv.position)
        self.release(seq)
        return held

    @profiling.traced("engine.write_back",
                      lambda self, seq: {"requests": 1, "tokens": seq.kv.position})
    def _write_back(self, seq: Sequence) -> None:
        """The cache adopts the sequence's full pages (published in place) and takes its
        SWA snapshot, by the write-back rule of engine/prefix.py."""
        cache, plan, kv = self.cache, seq.plan, seq.kv
        if cache is None or not (plan.global_exact or self.prefix.write_approximate):
            return
        nb = kv.position // self.page_tokens
        m = seq.match
        have = m.num_blocks if m is not None else 0
        if nb > have:
            seq.match = cache.adopt(kv.tokens, kv.pages[have:nb],
                                    namespace=seq.request.namespace, match=m)
            self.memory.adopted(kv, seq.match.block_ids[:nb], handed_from=have)
            written = (nb - have) * cache.layout.block_bytes
            seq.stats.bytes["global_written"] = seq.stats.bytes.get("global_written", 0) + written
        if self.prefix.swa_ok(seq) and cache.swa is not None:
            snap = self.memory.snapshot(kv)
            if cache.put_snapshot(kv.tokens, snap, namespace=seq.request.namespace):
                seq.stats.bytes["swa_written"] = seq.stats.bytes.get("swa_written", 0) + snap.nbytes

    def release(self, seq: Sequence) -> None:
        if seq.kv is not None:
            self.memory.close(seq.kv)
            seq.kv = None
        self.prefix.release(seq)
        seq.match = None

    def preempt(self, seq: Sequence) -> None:
        self.release(seq)

    def position(self, seq: Sequence) -> int:
        return seq.kv.position

    def memory_stats(self) -> dict[str, dict]:
        out = self.memory.stats()
        if self.cache is None:                   # the engine's own pool (else the cache's)
            out["global_kv"] = page_pool_usage(self.memory.pool.stats())
        return out


def page_pool_usage(stats: dict) -> dict:
    """memory_stats' "global_kv" entry from a page pool's GlobalKVPool.stats(): cached
    pages count as used until evicted."""
    return {"used": stats["cached_blocks"], "free": stats["free_blocks"],
            "total": stats["num_blocks"], "referenced": stats["referenced_blocks"],
            "unit": "pages"}


def _cached(plan, position: int) -> int | None:
    """The plan's cached_until for a chunk starting at `position` (None once past it)."""
    H = plan.cached_until
    return H if H is not None and H >= position else None


def default_kv_memory(model: Model) -> int:
    """The page pool of an engine without a cache: half the GPU memory free now, or
    512 MiB on the CPU."""
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        return int(free * 0.5)
    return 512 << 20


def make_runtime(kind: str, model: Model, cache: PrefixCache | None, *, max_batch: int,
                 max_prefill_tokens: int, write_approximate: bool, kv_memory_bytes: int | None,
                 graphs: bool):
    """The engine's runtime: "paged", "reference", or "auto" (paged when the model can run
    on it, else the reference runtime, saying why once)."""
    if kind not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {kind!r}")
    why = paged_support(model.config, model.codec)
    if kind == "auto":
        if why is not None:
            log.warning("this model runs on the reference runtime: %s", why)
        kind = "paged" if why is None else "reference"
    if kind == "reference":
        return ReferenceRuntime(model, cache, write_approximate=write_approximate)
    if why is not None:
        raise ValueError(f"runtime='paged' cannot run this model: {why}")
    return PagedRuntime(model, cache, max_batch=max_batch, max_prefill_tokens=max_prefill_tokens,
                        write_approximate=write_approximate, kv_memory_bytes=kv_memory_bytes,
                        graphs=graphs)

