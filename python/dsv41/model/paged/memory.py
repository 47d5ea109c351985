"""The device memory a paged step reads and writes, besides the global-KV pages.

`SlotMemory` holds what each running sequence keeps of its own, in fixed slots: every
layer's SWA ring (the last W tokens' FP8 SWA KV, position p in row slot * W + p % W) and
each compressing KV source's partial block (the float32 kv and score projections of the
tokens of the unfinished block, row slot * m + p % m). A sequence takes one slot for its
whole life and gives it back when it ends: its ring is its SWA window, so nothing older
than W tokens is ever held. One extra slot is reserved for the padding segments of a
captured decode graph. After the slots come the scratch rows of one step (at most
`max_step_tokens` rows): a prefill chunk's SWA KV and projections live there while the
layer reads them, and the rows that stay are moved into the slot afterwards
(paged/batch.py).

`PagedKV` is what the forward is handed: for each KV-source layer its main-KV arrays, for
each indexer-key layer its key arrays (both rows of the page pool, which lives with the
prefix cache: cache/global_pool.py), and the SlotMemory tensors. The model never knows
where the arrays came from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config import ModelConfig
from ..kv_codec import KVCodec
from .batch import Batch

__all__ = ["PagedKV", "SlotMemory", "SlotsExhausted", "paged_support"]


# The most bytes of slot and scratch rows one SlotMemory may take: a step's budget large
# enough to need more is a mistake (e.g. "no limit" passed as a huge number), answered with
# an error that names the budget rather than an allocator failure.
MAX_SLOT_BYTES = 64 << 30


class SlotsExhausted(RuntimeError):
    """Every slot is held by a running sequence."""


def paged_support(config: ModelConfig, codec: KVCodec) -> str | None:
    """Why the paged step cannot run this model, or None when it can."""
    if not codec.ops_read_stored:
        return (f"the paged runtime reads the V4.1 stored formats (NVFP4 global KV, FP8 SWA, "
                f"MXFP4 indexer keys) through the fused ops; this model's KV is "
                f"{codec.name!r}")
    if not any(p.owns_kv for p in config.layer_plan()):
        return "a model without global KV (every layer SWA-only) has no pages to hold"
    if config.overlap_compress_ratios:
        return "overlapping compressor windows (V4's CSA) are not supported by the paged step"
    if config.indexer_compressor:
        return "an indexer with its own compressor (V4) is not supported by the paged step"
    return None


class SlotMemory:
    """SWA rings and compressor partial blocks of `num_slots` running sequences (plus one
    padding slot), with scratch rows for a step of up to `max_step_tokens` tokens."""

    def __init__(self, config: ModelConfig, codec: KVCodec, num_slots: int,
                 max_step_tokens: int, device: torch.device | str):
        if num_slots < 1 or max_step_tokens < 1:
            raise ValueError(f"num_slots={num_slots} and max_step_tokens={max_step_tokens} "
                             f"must be >= 1")
        c = config
        need = self.bytes_for(c, codec, num_slots, max_step_tokens)
        if need > MAX_SLOT_BYTES:
            raise ValueError(f"{num_slots} sequence slots with a step of {max_step_tokens} tokens "
                             f"need {need / 2**30:.1f} GiB of slot and scratch rows (every layer's "
                             f"SWA rows and compressor state are preallocated), more than "
                             f"{MAX_SLOT_BYTES / 2**30:.0f} GiB: lower the step's token budget "
                             f"(the engine's max_prefill_tokens) or max_batch")
        self.config, self.device = c, torch.device(device)
        self.num_slots = num_slots + 1              # the last one pads decode graphs
        self.pad_slot = num_slots
        self.max_step_tokens = int(max_step_tokens)
        W = c.sliding_window
        spec = codec.swa_spec()
        rows = Batch.swa_rows(self.num_slots, W, self.max_step_tokens)
        L = c.num_layers
        values = torch.zeros(L, rows, spec.code_cols, dtype=spec.code_dtype, device=device)
        scales = torch.zeros(L, rows, spec.scale_cols, dtype=spec.scale_dtype, device=device)
        self.swa = {layer: (values[layer], scales[layer]) for layer in range(L)}
        self.comp: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for p in c.layer_plan():
            if p.owns_kv and p.compress_ratio > 1:
                n = Batch.comp_rows(self.num_slots, p.compress_ratio, self.max_step_tokens)
                kv = torch.zeros(n, c.head_dim, dtype=torch.float32, device=device)
                self.comp[p.layer] = (kv, torch.zeros_like(kv))
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise SlotsExhausted(f"all {self.num_slots - 1} sequence slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.pad_slot or slot in self._free:
            raise ValueError(f"slot {slot} is not held")
        self._free.append(slot)

    @staticmethod
    def bytes_for(config: ModelConfig, codec: KVCodec, num_slots: int, max_step_tokens: int) -> int:
        """The bytes a SlotMemory of these sizes allocates (before allocating them)."""
        spec = codec.swa_spec()
        rows = Batch.swa_rows(num_slots + 1, config.sliding_window, int(max_step_tokens))
        per_row = (spec.code_cols * torch.empty(0, dtype=spec.code_dtype).element_size()
                   + spec.scale_cols * torch.empty(0, dtype=spec.scale_dtype).element_size())
        total = config.num_layers * rows * per_row
        for p in config.layer_plan():
            if p.owns_kv and p.compress_ratio > 1:
                n = Batch.comp_rows(num_slots + 1, p.compress_ratio, int(max_step_tokens))
                total += 2 * n * config.head_dim * 4
        return total

    def nbytes(self) -> int:
        ts = [t for pair in (*self.swa.values(), *self.comp.values()) for t in pair]
        return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class PagedKV:
    """The tensors a paged step reads and writes (see the module docstring)."""

    main: dict[int, tuple[torch.Tensor, torch.Tensor]]    # KV source -> (codes, scales) rows
    index: dict[int, tuple[torch.Tensor, torch.Tensor]]   # key source -> (codes, scales) rows
    swa: dict[int, tuple[torch.Tensor, torch.Tensor]]     # layer -> (values, scales) rows
    comp: dict[int, tuple[torch.Tensor, torch.Tensor]]    # compressing layer -> (kv, score)
    num_slots: int
    pad_slot: int
    max_step_tokens: int

    @classmethod
    def of(cls, arrays: dict[tuple[int, str], torch.Tensor], slots: SlotMemory) -> PagedKV:
        """From a page pool's arrays ({(layer, kind): rows}, GlobalKVPool.arrays) and the
        slot memory."""
        main, index = {}, {}
        for (layer, kind), t in arrays.items():
            if kind == "main_codes":
                main[layer] = (t, arrays[(layer, "main_scales")])
            elif kind == "index_codes":
                index[layer] = (t, arrays[(layer, "index_scales")])
        return cls(main, index, slots.swa, slots.comp, slots.num_slots, slots.pad_slot,
                   slots.max_step_tokens)
