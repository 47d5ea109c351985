"""A minimal driver of the paged step for tests: sequences with page tables and slots over
a real page pool (cache.GlobalKVPool) and SlotMemory, stepped with build_batch + forward.
It is not the engine (engine/ schedules, caches and samples); it only feeds the step."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.cache.global_pool import GlobalKVPool
from dsv41.cache.layout import BlockLayout
from dsv41.engine.cache_adapter import export_blocks
from dsv41.model.paged import PagedKV, SeqChunk, SlotMemory, build_batch, forward


@dataclass
class PSeq:
    slot: int
    pages: list[int] = field(default_factory=list)
    position: int = 0
    tokens: list[int] = field(default_factory=list)


class Driver:
    def __init__(self, model, *, pages: int = 64, slots: int = 6, page_tokens: int = 16,
                 max_step: int = 512):
        self.model = model
        c = model.config
        self.layout = BlockLayout(c, page_tokens)
        self.pool = GlobalKVPool(self.layout, pages * self.layout.block_bytes, device=model.device)
        self.slots = SlotMemory(c, model.codec, slots, max_step, model.device)
        self.kv = PagedKV.of(self.pool.arrays, self.slots)
        self.P = page_tokens
        self.ratios = sorted({p.compress_ratio for p in c.layer_plan() if p.owns_kv})

    def new(self) -> PSeq:
        return PSeq(self.slots.acquire())

    def free(self, s: PSeq) -> None:
        self.pool.release(s.pages)
        self.slots.release(s.slot)

    def _cover(self, s: PSeq, end: int) -> None:
        need = -(-end // self.P) - len(s.pages)
        if need > 0:
            s.pages += self.pool.allocate(need)

    def decode_batch(self, seqs: list[PSeq], token: int, **pad):
        """The Batch of one decode step (token at each sequence's next position), built
        but not run: pages are allocated, positions are not advanced."""
        chunks = []
        for s in seqs:
            self._cover(s, s.position + 1)
            chunks.append(SeqChunk([token], s.position, s.slot, list(s.pages)))
        return self._build(chunks, **pad)

    def _build(self, chunks: list[SeqChunk], **pad):
        return build_batch(chunks, window=self.model.config.sliding_window, page_tokens=self.P,
                           ratios=self.ratios, num_slots=self.kv.num_slots,
                           decoder=self.model.config.encoder_decoder,
                           pad_slot=self.kv.pad_slot, **pad)

    def step(self, work: list[tuple[PSeq, list[int]]], *, pad_to: int | None = None,
             context_cap: int | None = None, **extra) -> list[torch.Tensor]:
        """Run each (sequence, tokens) for one step; extra: per-chunk SeqChunk fields given
        as {field: [value per item]}. Returns each item's logits ([vocab], or [n, vocab]
        with all_logits)."""
        chunks = []
        for i, (s, toks) in enumerate(work):
            self._cover(s, s.position + len(toks))
            kw = {k: v[i] for k, v in extra.items()}
            chunks.append(SeqChunk(toks, s.position, s.slot, list(s.pages), **kw))
        batch = self._build(chunks, pad_to=pad_to, context_cap=context_cap)
        logits = forward(self.model, batch.to(self.model.device), self.kv)
        out, at = [], 0
        for (s, toks), n in zip(work, batch.logit_counts[:len(work)]):
            s.position += len(toks)
            s.tokens += list(toks)
            out.append(logits[at] if n == 1 else logits[at:at + n])
            at += n
        return out

    # ---- what the pool and slots hold, in the per-sequence model's terms -------------------

    def page_bytes(self, s: PSeq, n_pages: int) -> torch.Tensor:
        return self.pool.read(s.pages[:n_pages], device="cpu")

    def swa_rows(self, s: PSeq, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring rows of `layer` in position order p % W (like SequenceState's rings)."""
        W = self.model.config.sliding_window
        v, sc = self.kv.swa[layer]
        return v[s.slot * W:(s.slot + 1) * W].cpu(), sc[s.slot * W:(s.slot + 1) * W].cpu()

    def pending(self, s: PSeq, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model.config.compress_ratios[layer]
        n = s.position % m
        kv, score = self.kv.comp[layer]
        return kv[s.slot * m: s.slot * m + n].cpu(), score[s.slot * m: s.slot * m + n].cpu()


def state_pages(layout: BlockLayout, state, n_pages: int) -> torch.Tensor:
    return export_blocks(layout, state, 0, n_pages).cpu()


def assert_state_equal(drv: Driver, s: PSeq, state) -> None:
    """The paged sequence holds, byte for byte, what `state` (a SequenceState) holds: its
    full pages, its partial page's written entries, its SWA rings at the positions the
    window covers, and its compressors' partial blocks."""
    assert s.position == state.position and s.tokens == state.tokens
    full = s.position // drv.P
    if full:
        assert torch.equal(drv.page_bytes(s, full), state_pages(drv.layout, state, full)), \
            "full pages differ"
    layout = drv.layout
    for a in layout.arrays:
        e = a.entries
        n = (s.position % drv.P) // a.ratio            # entries of the partial page
        if not n:
            continue
        rows = drv.pool.array(a.layer, a.kind)
        base = s.pages[full] * e
        got = rows[base: base + n].cpu().view(torch.uint8)
        store = (state.main_kv if a.kind.startswith("main") else state.index_keys)[a.layer]
        codes, scales = store.committed()
        want = (codes if a.kind.endswith("codes") else scales)[full * e: full * e + n]
        assert torch.equal(got, want.cpu().contiguous().view(torch.uint8)), \
            f"partial page of layer {a.layer} {a.kind} differs"
    W = drv.model.config.sliding_window
    slots = torch.tensor([p % W for p in state.swa_positions()], dtype=torch.long)
    for layer in state.swa_values:
        v, sc = drv.swa_rows(s, layer)
        assert torch.equal(v[slots].view(torch.uint8), state.swa_values[layer].cpu()[slots].view(torch.uint8)), \
            f"SWA values of layer {layer} differ"
        assert torch.equal(sc[slots].view(torch.uint8), state.swa_scales[layer].cpu()[slots].view(torch.uint8)), \
            f"SWA scales of layer {layer} differ"
    for layer, (kv, score) in state.pending.items():
        pk, ps = drv.pending(s, layer)
        assert torch.equal(pk, kv.cpu()) and torch.equal(ps, score.cpu()), \
            f"compressor state of layer {layer} differs"
