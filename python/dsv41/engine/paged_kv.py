"""The engine's KV memory on the paged runtime: one page pool, per-sequence slots.

    mem = PagedMemory(model, pool, max_seqs=64, max_step_tokens=8256)
    kv = mem.open()                      # a slot for a new sequence
    kv.map_pages(match.block_ids[:n])    # a cached prefix: its pages, read in place
    mem.ensure(kv, end)                  # private pages for positions [.., end)
    ... steps write into the pages and the slot (model.paged.forward) ...
    snap = mem.snapshot(kv)              # SWA state for the host tier (SwaSnapshot format)
    mem.close(kv)                        # private pages and the slot go back

The page pool is the prefix cache's GPU tier (cache.GlobalKVPool) when the engine has a
cache: global KV lives once, and a hit maps its pages instead of copying them. Without a
cache the engine owns a pool of its own. A sequence's page table lists the pages of its
tokens in order: the first `shared` come from the cache (a hit, or pages the cache adopted
from this sequence) and are referenced through its PrefixMatch; the rest are private
(referenced by the sequence, written in place, freed at close).

Snapshots use the per-sequence model's layout (engine/cache_adapter.py's TensorSnapshot
format of model.SwaSnapshot), so the SWA tier holds the same bytes whichever runtime wrote
them: each layer's W ring rows (position p in row p % W), each compressor's pending rows,
the global entries of the tokens past the last page boundary, and the token ids.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..cache.global_pool import GlobalKVPool
from ..cache.swa_pool import TensorSnapshot
from ..model.paged import PagedKV, SlotMemory, paged_support
from .cache_adapter import SNAPSHOT_FORMAT

__all__ = ["PagedMemory", "SeqKV"]


@dataclass
class SeqKV:
    """One running sequence's place in the paged memory."""

    slot: int
    pages: list[int] = field(default_factory=list)
    shared: int = 0               # pages[:shared] are held through the cache's match
    position: int = 0
    tokens: list[int] = field(default_factory=list)

    def map_pages(self, pages: list[int]) -> None:
        """Start from cached pages (their references belong to the cache match)."""
        if self.pages:
            raise RuntimeError("map_pages: the sequence already has pages")
        self.pages = list(pages)
        self.shared = len(pages)


class PagedMemory:
    """The page pool and the slot memory of a paged engine (see the module docstring)."""

    def __init__(self, model, pool: GlobalKVPool, *, max_seqs: int, max_step_tokens: int):
        why = paged_support(model.config, model.codec)
        if why is not None:
            raise ValueError(f"the paged runtime cannot run this model: {why}")
        if pool.device != model.device:
            raise ValueError(f"the page pool is on {pool.device}, the model on {model.device}")
        if pool.layout.config.fingerprint() != model.config.fingerprint():
            raise ValueError("the page pool's layout belongs to another model config")
        self.model, self.pool = model, pool
        self.config = model.config
        self.page_tokens = pool.layout.block_tokens
        self.slots = SlotMemory(model.config, model.codec, max_seqs, max_step_tokens, model.device)
        self.kv = PagedKV.of(pool.arrays, self.slots)
        self.ratios = sorted({p.compress_ratio for p in model.config.layer_plan() if p.owns_kv})

    # ---- sequences ----------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return self.slots.free_slots

    def open(self) -> SeqKV:
        return SeqKV(self.slots.acquire())

    def pages_for(self, kv: SeqKV, end: int) -> int:
        """Pages the sequence still needs to hold positions [0, end)."""
        return max(0, -(-end // self.page_tokens) - len(kv.pages))

    def ensure(self, kv: SeqKV, end: int) -> None:
        """Private pages for positions up to `end` (raises cache.PoolFullError, taking
        none, when the pool cannot supply them)."""
        need = self.pages_for(kv, end)
        if need:
            kv.pages += self.pool.allocate(need)

    def close(self, kv: SeqKV) -> None:
        """Release the private pages and the slot (shared pages belong to the match)."""
        self.pool.release(kv.pages[kv.shared:])
        del kv.pages[kv.shared:]
        self.slots.release(kv.slot)
        kv.slot = -1

    def adopted(self, kv: SeqKV, block_ids: list[int], handed_from: int) -> None:
        """The cache adopted the sequence's pages [handed_from, n) into its match, which now
        covers the first n = len(block_ids) blocks (their references moved into the match;
        the cache may have kept an identical cached page in place of a sequence's copy).
        Private pages [shared, handed_from) duplicate blocks the match already held (a path
        that recomputed them): they are released, and the match's pages read instead."""
        n = len(block_ids)
        if not kv.shared <= handed_from <= n <= len(kv.pages):
            raise ValueError(f"adopted: blocks [{handed_from}, {n}) of a sequence with "
                             f"{kv.shared} shared and {len(kv.pages)} pages")
        self.pool.release(kv.pages[kv.shared:handed_from])
        kv.pages[:n] = block_ids
        kv.shared = n

    # ---- SWA snapshots (the host tier) ----------------------------------------------------

    def snapshot(self, kv: SeqKV) -> TensorSnapshot:
        """The sequence's SWA state after its tokens so far, for the SWA tier (tail from
        the last page boundary)."""
        c, pos = self.config, kv.position
        aligned = pos // self.page_tokens * self.page_tokens
        tensors = {name: rows.clone() for name, rows in self._views(kv, pos, aligned)}
        tensors["tokens"] = torch.tensor(kv.tokens, dtype=torch.int64)
        meta = {"format": SNAPSHOT_FORMAT, "config_fingerprint": c.fingerprint(),
                "aligned_to": aligned, "tail_kinds": ["index", "main"]}
        return TensorSnapshot(pos, tensors, meta)

    def restore(self, kv: SeqKV, snap: TensorSnapshot) -> None:
        """Resume from a snapshot: the sequence holds the pages of [0, aligned_to) (mapped
        from the cache); the tail's entries go to a fresh private page, the rings and
        pending rows to its slot."""
        c, P = self.config, self.page_tokens
        if snap.meta.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"not a model snapshot (format {snap.meta.get('format')!r})")
        if snap.meta.get("config_fingerprint") != c.fingerprint():
            raise ValueError("restore: the snapshot comes from another model config")
        aligned, pos = int(snap.meta["aligned_to"]), snap.num_tokens
        if aligned != pos // P * P or len(kv.pages) != aligned // P or kv.position:
            raise ValueError(f"restore: a snapshot of {pos} tokens (tail from {aligned}) on a "
                             f"sequence holding {len(kv.pages)} pages of {P} at position "
                             f"{kv.position}")
        self.ensure(kv, pos)                      # the tail's page, when there is a tail
        for name, rows in self._views(kv, pos, aligned):
            rows.copy_(snap.tensors[name].to(self.model.device).view(rows.dtype))
        kv.position = pos
        kv.tokens = snap.tensors["tokens"].tolist()

    def _views(self, kv: SeqKV, pos: int, aligned: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Each snapshot tensor's name and the memory rows it holds, as a view: every
        layer's W ring rows (position p in row p % W), each compressor's pending rows, and
        the global entries of tokens [aligned, pos) in the pool's pages. The one place that
        maps a snapshot onto the slot and the pages, for both directions."""
        W = self.config.sliding_window
        ring = slice(kv.slot * W, (kv.slot + 1) * W)
        for layer, (values, scales) in self.kv.swa.items():
            yield f"swa_values.{layer}", values[ring]
            yield f"swa_scales.{layer}", scales[ring]
        for layer, (kvs, score) in self.kv.comp.items():
            m = self.config.compress_ratios[layer]
            rows = slice(kv.slot * m, kv.slot * m + pos % m)
            yield f"pending.{layer}.kv", kvs[rows]
            yield f"pending.{layer}.score", score[rows]
        for kind, arrays in (("main", self.kv.main), ("index", self.kv.index)):
            for layer, (codes, scales) in arrays.items():
                rows = self._tail_rows(kv, layer, pos, aligned)
                yield f"tail.{kind}.{layer}.codes", codes[rows]
                yield f"tail.{kind}.{layer}.scales", scales[rows]

    def _tail_rows(self, kv: SeqKV, layer: int, pos: int, aligned: int) -> slice:
        """Pool rows of `layer`'s entries of tokens [aligned, pos)."""
        m = self.config.compress_ratios[layer]
        n = (pos - aligned) // m
        if not n:
            return slice(0, 0)
        e = self.pool.entries_per_block(layer)
        base = kv.pages[aligned // self.page_tokens] * e
        return slice(base, base + n)

    def stats(self) -> dict[str, dict]:
        """What memory_stats reports for the pools this memory owns."""
        held = self.slots.num_slots - 1 - self.slots.free_slots
        return {"sequence_slots": {"used": held, "free": self.slots.free_slots,
                                   "total": self.slots.num_slots - 1, "unit": "slots",
                                   "bytes": self.slots.nbytes()}}
