"""The paged forward: one step of many sequences through the layer stack, on pooled KV.

    logits = forward(model, batch, kv)      # [rows of batch.logit_rows, vocab] float32

Every layer runs once over all the step's rows: the projections, norms, RoPE, MoE and the
output projection are per-row math shared with the per-sequence model (the same modules,
so the same weights and precision); what differs is where the KV lives. Global KV and
indexer keys are read from and written to the page pool (kv.main, kv.index) through the
batch's entry tables, the SWA KV and the compressor's partial blocks from and to the
sequences' slots (kv.swa, kv.comp). The attention, indexer and top-k ops take index lists,
so one call per layer serves every sequence; no value of a device tensor is read on the
host, and with a decode-only batch every shape depends only on the batch's BatchShape
(the runner captures that step as a CUDA graph).

Order of writes inside a layer, which the equality with the per-sequence model rests on:
the step's SWA KV is written before attention (a query sees its own token and the step's
earlier ones), the entries the step completes are written into the pool before the
layer's indexer and attention read it (visibility masks the ones a query may not see yet),
and in a prefill step the SWA rows that stay are moved into the ring only after attention
has read the scratch rows.

Model state in a step is the per-sequence model's, laid out by page and slot: in reference
precision the pages receive the same bytes and the logits are the same values
(tests/model/test_paged_forward.py holds it to that, against SequenceState).
"""
from __future__ import annotations

import torch

from ... import ops
from ...config import MODE_FULL, MODE_REINDEX, PART_DECODER
from ...ops import cache_ops
from ...ops.paged import indexer_scores_paged
from .. import gemm
from ..mhc import hc_head
from .batch import Batch, View
from .memory import PagedKV, paged_support

__all__ = ["forward"]


class _Selections:
    """Per-step selections shared between layers: the pool rows each index source chose
    (Reuse layers read them), and the candidate source's candidate entry ids."""

    def __init__(self):
        self.rows: dict[int, torch.Tensor] = {}
        self.candidates: torch.Tensor | None = None


class _RopeTables:
    """The (cos, sin) rows of each rotation at each set of positions of the step, computed
    once and shared by every layer (production precision; the reference rotates in float64
    from the positions). Two rotations exist: compressed layers' (YaRN) and SWA-only
    layers' (Rope.for_layer)."""

    def __init__(self, production_path: bool):
        self.on = production_path
        self._t: dict[tuple[bool, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, attn, positions: torch.Tensor):
        if not self.on:
            return None
        key = (attn.plan.compress_ratio > 0, id(positions))
        if key not in self._t:
            self._t[key] = attn.rope.table(positions)
        return self._t[key]


def _rows_of(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Pool rows of entry ids [R, K] (int32, -1 = none) from a per-row table [R, E]."""
    picked = table.gather(1, ids.clamp(min=0).long())
    return torch.where(ids >= 0, picked, ids)         # ids < 0 are exactly -1


def _compress(attn, kv_input: torch.Tensor, batch: Batch, kv: PagedKV,
              tables: _RopeTables) -> None:
    """Write the global entries (and indexer keys) the step completes into the pool."""
    comp, layer = attn.compressor, attn.layer
    info = batch.comp[comp.ratio]
    m = comp.ratio
    proj = comp.wkv(kv_input)
    if m > 1:
        score = comp.wgate(kv_input)
        s_kv, s_score = kv.comp[layer]
        s_kv.index_copy_(0, info.kv_dst, proj)
        s_score.index_copy_(0, info.kv_dst, score)
        src = info.src.reshape(-1)
        blocks_kv, blocks_score = s_kv.index_select(0, src), s_score.index_select(0, src)
        if not batch.decode_only and info.keep_src.shape[0]:
            s_kv.index_copy_(0, info.keep_dst, s_kv.index_select(0, info.keep_src))
            s_score.index_copy_(0, info.keep_dst, s_score.index_select(0, info.keep_src))
        if info.src.shape[0] == 0:        # no block completes in this step (shapes: host)
            return
        latent = comp.pool(blocks_kv, blocks_score)
    else:
        latent = comp.pool(proj, None)
    fp32 = gemm.is_production(attn)
    table = tables(attn, info.pos)
    entry = attn.rope.rotate(latent, info.pos, fp32=fp32, table=table)
    codes, scales = kv.main[layer]
    cache_ops.quantize_scatter("nvfp4", entry, codes, scales, info.dst)
    if attn.plan.owns_indexer_keys:
        k_codes, k_scales = kv.index[layer]
        keys = attn.indexer.key_values(latent, info.pos, rope_table=table)
        cache_ops.quantize_scatter("mxfp4", keys, k_codes, k_scales, info.dst)


class AttentionPlans:
    """The attention plans of one step shape (ops.attention_plan: kernel, splits and
    workspace decided once), one per (queries, heads, head dim, SWA width, top-k width) the
    step's layers use, made on first use. A CUDA graph's step is run once eagerly before
    its capture, so every plan exists (and owns its workspace) before the capture starts;
    the captured calls then allocate and decide nothing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.made: dict[tuple[int, ...], ops.AttentionPlan] = {}

    def __call__(self, q: torch.Tensor, swa_idx: torch.Tensor, kv_idx: torch.Tensor
                 ) -> ops.AttentionPlan:
        key = (q.shape[0], q.shape[1], q.shape[2], swa_idx.shape[1], kv_idx.shape[1])
        plan = self.made.get(key)
        if plan is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"attention plan {key} made during a CUDA graph capture: "
                                   "run the step once eagerly first")
            plan = self.made[key] = ops.attention_plan(
                key[0], key[1], key[2], swa_width=key[3], topk=key[4], device=self.device)
        return plan


def _attention(attn, x: torch.Tensor, kv_input: torch.Tensor, v: View, batch: Batch,
               kv: PagedKV, sel: _Selections, dense: bool, tables: _RopeTables,
               plans: AttentionPlans | None = None) -> torch.Tensor:
    c, p, layer = attn.config, attn.plan, attn.layer
    pos = v.positions
    fp32 = gemm.is_production(attn)
    table = tables(attn, pos)
    qr, q = attn.queries(x, pos, rope_table=table)
    swa = attn.swa_values(x, pos, table)
    sv, ss = kv.swa[layer]
    cache_ops.quantize_scatter("fp8_swa", swa, sv, ss, v.swa_dst)
    if p.owns_kv:
        _compress(attn, kv_input, batch, kv, tables)
    R = x.shape[0]
    if p.compress_ratio:
        m = p.compress_ratio
        codes, scales = kv.main[p.kv_source]
        entries = batch.entry_rows[m]
        if entries.shape[0] != R:     # prefill: one row per query; decode: already so
            entries = entries.index_select(0, v.seg)
        if p.dense or dense:
            cols = torch.arange(entries.shape[1], device=entries.device)
            kv_rows = torch.where(cols[None, :] < v.visible[m][:, None], entries, -1)
        elif p.owns_index_query:
            iq_codes, iq_scales, iw = attn.indexer.queries(x, qr, pos, rope_table=table)
            k_codes, k_scales = kv.index[p.index_key_source]
            if p.mode == MODE_FULL:
                scores = indexer_scores_paged(iq_codes, iq_scales, iw, k_codes, k_scales,
                                              batch.entry_rows[m], v.seg)
                ids = ops.topk_visible(scores, v.visible[m], c.index_topk)
                if layer == c.candidate_source_layer_id:
                    sel.candidates = ops.candidate_blocks(
                        scores, v.visible[m], c.candidate_block_size, c.candidate_topk_blocks)
            elif p.mode == MODE_REINDEX and sel.candidates is not None:
                cands = sel.candidates
                scores = ops.indexer_scores_at(iq_codes, iq_scales, iw, k_codes, k_scales,
                                               _rows_of(entries, cands))
                chosen = ops.topk_visible(scores, (cands >= 0).sum(1), c.index_topk)
                ids = torch.where(chosen >= 0, cands.gather(1, chosen.clamp(min=0).long()), -1)
            else:
                raise RuntimeError(f"layer {layer}: no candidate pool for a {p.mode} layer")
            kv_rows = _rows_of(entries, ids)
            sel.rows[layer] = kv_rows
        else:
            kv_rows = sel.rows[p.index_source]
    else:
        main = next(iter(kv.main.values()))
        codes, scales = main[0][:0], main[1][:0]
        kv_rows = torch.zeros(R, 0, dtype=torch.int32, device=x.device)
    out, _ = ops.sparse_attention(q, sv, ss, v.swa_idx, codes, scales, kv_rows,
                                  attn.sink_f32(), attn.softmax_scale,
                                  plan=None if plans is None else plans(q, v.swa_idx, kv_rows))
    if not batch.decode_only and v.swa_move_src.shape[0]:
        for t in (sv.view(torch.uint8), ss.view(torch.uint8)):
            t.index_copy_(0, v.swa_move_dst, t.index_select(0, v.swa_move_src))
    o = attn.rope.rotate(out, pos, inverse=True, fp32=fp32, table=table,
                         dtype=torch.bfloat16 if fp32 else None)
    return attn.project_out(o)


@torch.no_grad()
def forward(model, batch: Batch, kv: PagedKV, plans: AttentionPlans | None = None
            ) -> torch.Tensor:
    """Run `batch` through `model`, reading and writing `kv`; returns the logits of
    batch.logit_rows [L, vocab] float32 (see the module docstring). plans: the attention
    plans of this step shape (a captured decode step passes its own; None: each attention
    call is planned alone)."""
    c = model.config
    why = paged_support(c, model.codec)
    if why is not None:
        raise NotImplementedError(why)
    if batch.window != c.sliding_window:
        raise ValueError(f"the batch was built for window {batch.window}, the model has "
                         f"{c.sliding_window}")
    tok = batch.tokens
    h = model.embed(tok)
    if c.hc_mult > 1:
        h = h[:, None, :].expand(-1, c.hc_mult, -1).contiguous()
    plan = c.layer_plan()
    decoder_full = model.decoder_full_layer
    h_enc = None
    sel = _Selections()
    tables = _RopeTables(gemm.is_production(model))
    for block in model.layers:
        layer = block.layer
        decoder = plan[layer].part == PART_DECODER
        if decoder and batch.dec is not None and h_enc is None:
            # decoder replay: the decoder runs on its rows only, with its own selections
            h_enc = h
            h, tok = h.index_select(0, batch.dec_rows), tok.index_select(0, batch.dec_rows)
            sel = _Selections()
        if h_enc is not None and batch.shape.decoder_rows == 0:
            # a chunk wholly before decoder_start: the decoder does not run, but its Full
            # layer still projects the chunk's global KV from H_enc
            if layer == decoder_full:
                _compress(block.attn, block.attn_input(h_enc)[0], batch, kv, tables)
            continue
        x, mix = block.attn_input(h)
        kv_input = x
        if layer == decoder_full and h_enc is not None:
            kv_input = block.attn_input(h_enc)[0]   # the decoder's KV: from H_enc, every row
        out = _attention(block.attn, x, kv_input, batch.view(decoder), batch, kv, sel,
                         model.dense_attention, tables, plans)
        h = block.residual(h, out, mix)
        h = block.ffn_step(h, tok)
    h = (h_enc if h_enc is not None and batch.shape.decoder_rows == 0 else h
         ).index_select(0, batch.logit_rows)
    if c.hc_mult > 1:
        h = hc_head(h, model.hc_head_fn, model.hc_head_base, model.hc_head_scale,
                    c.hc_eps, c.rms_norm_eps, fp32=gemm.is_production(model))
    return model.head(model.norm(h))
