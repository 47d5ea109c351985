"""The CSA2 attention block of one layer (docs/design.md#attention).

Query path: q-lora (`wq_a`, `q_norm`, `wq_b`), a weightless per-head RMSNorm, RoPE on the
last rope_head_dim dims. SWA path: every layer projects its own SWA KV (`wkv`, `kv_norm`,
RoPE at the token's position) and stores it in FP8 before reading it. Global path (ratio
> 0): the Full layer's compressor appends NVFP4 entries (and indexer keys); the top-k
comes from this layer's indexer (Full, Reindex) or from its index source (Reuse). One
softmax per query over the SWA window and the selected entries, MQA with the 512-dim
entry as key and value, a per-head attention sink; inverse RoPE on the output's RoPE dims
at the query position; the grouped low-rank output projection (`wo_a` per group of
heads, then `wo_b`).

Mode by layer plan: SWA-only (ratio 0) has no global path; Full owns `compressor` and
`indexer` (with the key projection); Reindex owns `indexer` without keys; Reuse owns
neither and reads its sources' state. V4's dense (HCA) layers own a compressor and attend
to every visible entry without an indexer.

Where the KV is not V4.1's stored formats (V4's FP8 entry, or the float32 reference mode),
the rows are decoded to float32 and attended by `attend` below (float64 math, the same
softmax with sink as the ops).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .. import cpu_shortcuts, ops
from ..config import LayerPlan, ModelConfig
from . import gemm, production
from .compressor import Compressor
from .context import ForwardContext, swa_index
from .indexer import Indexer
from .kv_codec import KVCodec
from .layers import Linear, RMSNorm, as_f64, rms_normalize
from .rope import Rope

__all__ = ["Attention", "attend"]


def attend(q: torch.Tensor, swa: torch.Tensor, swa_idx: torch.Tensor, kv: torch.Tensor,
           kv_idx: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """One softmax per query and head over its valid SWA rows and selected global rows,
    plus the head's sink logit (which takes probability but gives no value).

    q [T,H,D] f32; swa [Ns,D] and kv [Ng,D] f32 rows; swa_idx [T,W] / kv_idx [T,K] int row
    ids (-1 = none); sink [H]. MQA: each row is key and value. Returns [T,H,D] f32."""
    if kv.shape[0] == 0:
        kv_idx = kv_idx[:, :0]
    keys = torch.cat((swa.double()[swa_idx.clamp(min=0).long()],
                      kv.double()[kv_idx.clamp(min=0).long()]), 1)        # [T, W+K, D]
    valid = torch.cat((swa_idx >= 0, kv_idx >= 0), 1)
    scores = torch.einsum("thd,tkd->thk", q.double(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], -math.inf)
    sink64 = sink.double()[None, :].expand(q.shape[0], -1)
    m = torch.maximum(scores.amax(-1), sink64)
    p = torch.exp(scores - m[..., None])
    denom = p.sum(-1) + torch.exp(sink64 - m)
    return (torch.einsum("thk,tkd->thd", p, keys) / denom[..., None]).float()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, plan: LayerPlan, *, indexer_rotation: bool = True,
                 codec: KVCodec):
        super().__init__()
        c = config
        self.config, self.plan, self.layer, self.codec = c, plan, plan.layer, codec
        H, D = c.num_heads, c.head_dim
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, H * D)
        self.wkv = Linear(c.hidden_size, D)
        self.kv_norm = RMSNorm(D, c.rms_norm_eps)
        self.wo_a = Linear(H * D // c.o_groups, c.o_groups * c.o_lora_rank)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(H), requires_grad=False)
        if plan.owns_kv:
            self.compressor = Compressor(c, plan.layer)
        if plan.owns_index_query:
            self.indexer = Indexer(c, plan, rotate=indexer_rotation, codec=codec)
        self.rope = Rope.for_layer(c, plan.compress_ratio)
        self.softmax_scale = D ** -0.5

    def swa_values(self, x: torch.Tensor, positions: torch.Tensor, rope_table=None
                   ) -> torch.Tensor:
        """This layer's SWA KV of x before quantization: RoPE(kv_norm(wkv x)), float32."""
        if gemm.is_production(self):
            kv = self.kv_norm(self.wkv(x, torch.bfloat16))
            return self.rope.rotate(kv, positions, fp32=True, table=rope_table)
        return self.rope.rotate(self.kv_norm(self.wkv(x)), positions)

    def sink_f32(self) -> torch.Tensor:
        """The per-head sink logits as the ops take them (float32; the parameter is)."""
        sink = self.attn_sink
        return sink if sink.dtype == torch.float32 else sink.float()

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output: heads split into o_groups groups, each projected by its
        own [o_lora_rank, heads/group * D] block of wo_a, then wo_b. o [T,H,D] -> [T,hidden]."""
        c = self.config
        G, R = c.o_groups, c.o_lora_rank
        if gemm.is_production(self):
            grouped = o.to(torch.bfloat16).reshape(o.shape[0], G, -1)
            wa = self.wo_a.weight
            if wa.dtype == torch.bfloat16:   # all groups in one bmm
                f32 = (gemm.cpu_f32(self.wo_a, "weight", wa)
                       if gemm.SMALL_ROWS >= o.shape[0] and o.device.type == "cpu"
                       else None)
                if f32 is not None:   # a decode step on the CPU (gemm.cpu_f32)
                    wa_t = gemm.transposed(gemm.grouped_view(f32, G))
                    mid = torch.bmm(grouped.transpose(0, 1).float(), wa_t).to(torch.bfloat16)
                    return self.wo_b(mid.transpose(0, 1).reshape(o.shape[0], G * R))
                wa_t = gemm.transposed(gemm.grouped_view(wa, G))
                mid = torch.bmm(grouped.transpose(0, 1), wa_t).transpose(0, 1)
                return self.wo_b(mid.reshape(o.shape[0], G * R))
            mid = torch.stack([   # quantized: group by group, one weight tile each
                grouped[:, g] @ gemm.dequantize_rows(self.wo_a, g * R, (g + 1) * R).T
                for g in range(G)], 1)                                   # [T, G, R]
            return self.wo_b(mid.reshape(o.shape[0], G * R))
        grouped = o.double().reshape(o.shape[0], G, -1).transpose(0, 1)  # [G, T, H*D/G]
        wa = as_f64(self.wo_a.weight).view(G, R, -1)                     # [G, R, H*D/G]
        mid = torch.bmm(grouped, wa.transpose(1, 2)).transpose(0, 1)     # [T, G, R]
        return self.wo_b(mid.reshape(o.shape[0], G * R).float())

    def queries(self, x: torch.Tensor, positions: torch.Tensor, rope_table=None):
        """(q-lora latent, queries [T, H, D] after RoPE). rope_table: this layer's (cos,
        sin) rows at `positions` when the caller has them (Rope.table; production only)."""
        c = self.config
        if gemm.is_production(self):   # bf16 between GEMMs and norms
            bf16 = torch.bfloat16
            qr = self.q_norm(self.wq_a(x, bf16), bf16)
            q = self.wq_b(qr, bf16).view(x.shape[0], c.num_heads, c.head_dim)
            q = gemm.rms_norm(q, None, c.rms_norm_eps)
            return qr, self.rope.rotate(q, positions, fp32=True, table=rope_table)
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b.forward_f64(qr).view(x.shape[0], c.num_heads, c.head_dim)
        q = rms_normalize(q, c.rms_norm_eps).float()
        return qr, self.rope.rotate(q, positions)

    def append_entries(self, kv_input: torch.Tensor, ctx: ForwardContext) -> None:
        """Stage the global entries (and indexer keys) the segments' new tokens complete."""
        layer = self.layer
        for seg, latent, pos in self.compressor.compress(
                kv_input, ctx, lambda s: s.state.main_kv[layer].n):
            entry = self.rope.rotate(latent, pos, fp32=gemm.is_production(self))
            self.codec.stage_main(seg.state.main_kv[layer], entry)
            if self.plan.owns_indexer_keys and not self.config.indexer_compressor:
                self.codec.stage_index(seg.state.index_keys[layer],
                                       self.indexer.key_values(latent, pos))
            ctx.record(layer, entry_positions=pos, latent=latent, entry=entry)
        if self.plan.owns_indexer_keys and self.config.indexer_compressor:
            for seg, latent, pos in self.indexer.compressor.compress(
                    kv_input, ctx, lambda s: s.state.index_keys[layer].n):
                self.codec.stage_index(seg.state.index_keys[layer],
                                       self.indexer.key_values(latent, pos))

    def forward(self, x: torch.Tensor, ctx: ForwardContext,
                kv_input: torch.Tensor | None = None,
                kv_ctx: ForwardContext | None = None) -> torch.Tensor:
        """x [total tokens, hidden] (the normalized layer input) -> [total tokens, hidden].

        kv_input: what the compressor projects (default x). The decoder's Full layer is
        given attn_norm(H_enc); both are the same tensor in a plain forward. kv_ctx: the
        segments kv_input belongs to (decoder replay: every token of the call, while x and
        ctx cover only the decoder's last tokens)."""
        c, p = self.config, self.plan
        pos = ctx.positions
        qr, q = self.queries(x, pos)
        fp32 = gemm.is_production(self)
        swa = self.swa_values(x, pos)
        swa_values, swa_scales = self.codec.encode_swa(swa)
        if p.owns_kv:
            self.append_entries(x if kv_input is None else kv_input, kv_ctx or ctx)
        use_index = p.owns_index_query and not ctx.dense
        if use_index:
            iq_codes, iq_scales, iw = self.indexer.queries(x, qr, pos)
        W = c.sliding_window
        sink = self.attn_sink.detach().float()
        outs = []
        for seg in ctx.segments:
            rows, st = seg.rows, seg.state
            seg.swa_new[self.layer] = (swa_values[rows], swa_scales[rows])
            buf_values = torch.cat((st.swa_values[self.layer], swa_values[rows]))
            buf_scales = torch.cat((st.swa_scales[self.layer], swa_scales[rows]))
            sidx = swa_index(seg.start, seg.length, W, seg.swa_start, device=x.device)
            kv_codes = kv_scales = None
            kidx = torch.zeros(seg.length, 0, dtype=torch.int32, device=x.device)
            if p.compress_ratio:
                kv_codes, kv_scales = st.main_kv[p.kv_source].rows()
                if p.dense or ctx.dense:
                    visible = (seg.positions + 1) // p.compress_ratio
                    ctx.record(self.layer, swa_idx=sidx, kv_visible=visible)
                    if self.codec.ops_read_stored:
                        out, _ = ops.dense_attention(q[rows], buf_values, buf_scales, sidx,
                                                     kv_codes, kv_scales, visible, sink,
                                                     self.softmax_scale)
                        outs.append(out)
                        continue
                    cols = torch.arange(kv_codes.shape[0], device=x.device)
                    kidx = torch.where(cols[None, :] < visible[:, None], cols[None, :],
                                       -1).to(torch.int32)
                elif use_index:
                    kidx = self.indexer.select(seg, iq_codes[rows], iq_scales[rows], iw[rows])
                    seg.topk[self.layer] = kidx
                    ctx.record(self.layer, index_q=(iq_codes[rows], iq_scales[rows]),
                               index_w=iw[rows], candidates=seg.candidates)
                else:
                    kidx = seg.topk[p.index_source]
            if self.codec.ops_read_stored:
                if kv_codes is None:
                    spec = self.codec.main_spec()
                    kv_codes = torch.zeros(0, spec.code_cols, dtype=spec.code_dtype,
                                           device=x.device)
                    kv_scales = torch.zeros(0, spec.scale_cols, dtype=spec.scale_dtype,
                                            device=x.device)
                out, _ = ops.sparse_attention(q[rows], buf_values, buf_scales, sidx, kv_codes,
                                              kv_scales, kidx, sink, self.softmax_scale)
            elif fp32 and seg.length == 1 and x.device.type == "cpu" \
                    and cpu_shortcuts.enabled():   # a decode step
                kv_dec = (None if kv_codes is None else
                          st.main_kv[p.kv_source].decoded("main", self.codec.decode_main))
                out = production.attend_one(q[rows], self.codec, buf_values, buf_scales, sidx,
                                            kv_codes, kv_scales, kidx, sink,
                                            self.softmax_scale, kv_decoded=kv_dec)
            else:
                kv = (torch.zeros(0, c.head_dim, device=x.device) if kv_codes is None
                      else self.codec.decode_main(kv_codes, kv_scales))
                attend_fn = production.attend if gemm.is_production(self) else attend
                out = attend_fn(q[rows], self.codec.decode_swa(buf_values, buf_scales), sidx,
                                kv, kidx, sink, self.softmax_scale)
            outs.append(out)
            ctx.record(self.layer, q=q[rows], swa_idx=sidx, kv_idx=kidx, attn=out)
        o = self.rope.rotate(torch.cat(outs), pos, inverse=True, fp32=fp32,
                             dtype=torch.bfloat16 if fp32 else None)
        return self.project_out(o)
