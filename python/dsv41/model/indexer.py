"""The lightning indexer: which global entries each query attends to (docs/design.md#indexer).

Keys (owned by the Full layer): V4.1: k = RMSNorm(W_k latent) from the compressor's
normalized entry (Linear head_dim -> index_head_dim, `k_norm`); V4 (`indexer_compressor`):
the indexer's own compressor over the layer input (`compressor.{wkv, wgate, ape, norm}` at
index_head_dim, the main compressor's windows). Then RoPE at the entry's first position,
the optional Hadamard rotation and MXFP4 (float32 and no rotation in the kv_dtype
"float32" reference mode, where scores are computed on the unquantized q and k). Queries (every Full and Reindex layer):
q = W_q' qr (from the layer's q-lora latent, `index_n_heads` heads), RoPE at the query
position, the optional rotation, MXFP4; head weights w = W_w x * (Di * Hi)^-1/2.
Score I_j = sum_h w_h ReLU(q_h . k_j) over MXFP4-dequantized q and k.

Selection: a Full layer takes the top-k over every visible entry (a query at position i
sees floor((i+1)/m) entries); the candidate source layer also keeps the top blocks of 8
positions (max score per block, the newest block always kept) as the candidate pool;
a Reindex layer scores only that pool and takes its own top-k. Reuse layers use the top-k
of their index source.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from .. import cpu_shortcuts, formats, ops
from ..config import MODE_FULL, MODE_REINDEX, LayerPlan, ModelConfig
from .compressor import Compressor
from .context import Segment
from .kv_codec import KVCodec
from .layers import Linear, RMSNorm
from .gemm import is_production
from .rope import Rope

__all__ = ["Indexer", "hadamard"]

# Query rows per scoring call: bounds the [rows, entries] score matrix at long lengths.
_SCORE_ELEMS = 1 << 23


def _dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return formats.dequantize_mxfp4(codes, scales.view(torch.uint8))


@functools.cache
def _hadamard_matrix(n: int) -> torch.Tensor:
    if n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two dim, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / n ** 0.5


@functools.cache
def _hadamard_matrix_on(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _hadamard_matrix(n).to(device=device, dtype=dtype)


def hadamard(x: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """x @ H / sqrt(n) over the last dim (Sylvester order; orthonormal), float32 out: in
    float64 (the reference), or in float32 (fp32=True: the production path, one GEMM)."""
    if fp32:
        return torch.matmul(x.float(), _hadamard_matrix_on(x.shape[-1], torch.float32, x.device))
    return torch.matmul(x.double(), _hadamard_matrix_on(x.shape[-1], torch.float64, x.device)).float()


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, plan: LayerPlan, *, rotate: bool, codec: KVCodec):
        super().__init__()
        c = config
        self.config, self.plan, self.codec = c, plan, codec
        # The rotation only serves the quantization; the float reference scores q.k as is.
        self.rotate = rotate and codec.quantized_index
        self.wq_b = Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim)
        self.weights_proj = Linear(c.hidden_size, c.index_n_heads)
        if plan.owns_indexer_keys:
            if c.indexer_compressor:
                self.compressor = Compressor(c, plan.layer, dim=c.index_head_dim,
                                             state_key=f"index.{plan.layer}")
            else:
                self.wk = Linear(c.head_dim, c.index_head_dim)
                self.k_norm = RMSNorm(c.index_head_dim, c.rms_norm_eps)
        self.rope = Rope.for_layer(c, plan.compress_ratio)
        self.weight_scale = (c.index_head_dim * c.index_n_heads) ** -0.5

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor, rope_table=None) -> torch.Tensor:
        fp32 = is_production(self)
        x = self.rope.rotate(x, pos, fp32=fp32, table=rope_table)
        return hadamard(x, fp32) if self.rotate else x

    def _finish(self, x: torch.Tensor, pos: torch.Tensor, rope_table=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codec.encode_index(self._rotate(x, pos, rope_table))

    def key_values(self, latent: torch.Tensor, pos: torch.Tensor, rope_table=None
                   ) -> torch.Tensor:
        """The float32 keys [n, Di] that the codec stores (before encoding, so the cache
        write can quantize in place: KVCodec.stage_index / RowStore.stage_quantized). latent
        [n, D] is the main compressor's normalized entry (V4.1) or the indexer compressor's
        (V4)."""
        if hasattr(self, "compressor"):
            return self._rotate(latent, pos, rope_table)
        bf16 = torch.bfloat16 if is_production(self) else None
        return self._rotate(self.k_norm(self.wk(latent, bf16)), pos, rope_table)

    def keys(self, latent: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored keys (codes, scales) of entries latent at positions pos (see key_values)."""
        return self.codec.encode_index(self.key_values(latent, pos))

    def queries(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, rope_table=None):
        """Stored-format queries (MXFP4 codes [T,Hi,Di/2], scales [T,Hi,Di/32]; float32
        [T,Hi,Di] and empty scales in the reference mode) and head weights [T,Hi].
        rope_table: the layer's (cos, sin) at pos, when the caller has them."""
        c = self.config
        prod = is_production(self)
        q = self.wq_b(qr, torch.bfloat16 if prod else None).view(-1, c.index_n_heads,
                                                                 c.index_head_dim)
        codes, scales = self._finish(q, pos, rope_table)
        if prod:
            w = self.weights_proj(x) * self.weight_scale
        else:
            w = (self.weights_proj.forward_f64(x) * self.weight_scale).float()
        return codes, scales, w

    def select(self, seg: Segment, q_codes, q_scales, w) -> torch.Tensor:
        """This layer's top-k entry ids [T, index_topk] int32 (ascending, -1 padded) for
        one segment; the candidate source also stores the segment's candidate pool."""
        c, p = self.config, self.plan
        store = seg.state.index_keys[p.index_key_source]
        k_codes, k_scales = store.rows()
        visible = (seg.positions + 1) // p.compress_ratio
        T = seg.length
        if p.mode == MODE_FULL:
            is_source = p.layer == c.candidate_source_layer_id
            step = max(1, _SCORE_ELEMS // max(1, k_codes.shape[0]))
            idx, cands = [], []
            for t0 in range(0, T, step):
                rows = slice(t0, min(T, t0 + step))
                scores = self._scores(q_codes[rows], q_scales[rows], w[rows], k_codes,
                                      k_scales, store)
                idx.append(ops.topk_visible(scores, visible[rows], c.index_topk))
                if is_source:
                    cands.append(ops.candidate_blocks(scores, visible[rows],
                                                      c.candidate_block_size,
                                                      c.candidate_topk_blocks))
            if is_source:
                seg.candidates = torch.cat(cands)
            return torch.cat(idx)
        if p.mode != MODE_REINDEX or seg.candidates is None:
            raise RuntimeError(f"layer {p.layer}: no candidate pool for a {p.mode} layer")
        cands = seg.candidates
        if self.codec.quantized_index:
            scores = ops.indexer_scores_at(q_codes, q_scales, w, k_codes, k_scales, cands)
        elif k_codes.shape[0] == 0:
            scores = torch.full(cands.shape, float("-inf"), device=cands.device)
        else:  # float reference: the candidates' keys, scored as in _scores
            keys = k_codes.double()[cands.clamp(min=0).long()]          # [T, C, Di]
            dots = torch.einsum("thd,tcd->thc", q_codes.double(), keys)
            scores = self._weighted(dots, w).masked_fill(cands < 0, float("-inf"))
        chosen = ops.topk_visible(scores, (cands >= 0).sum(1), c.index_topk)
        picked = cands.gather(1, chosen.clamp(min=0).long())
        return torch.where(chosen >= 0, picked, -1)

    def _scores(self, q, q_scales, w, k, k_scales, store=None) -> torch.Tensor:
        """I[t, j] = sum_h w[t,h] relu(q[t,h] . k[j]) [T, N] float32. store: the keys'
        RowStore; on the CPU (cpu_shortcuts) the scores read its dequantized copy
        (RowStore.decoded: only the keys written since the last step are dequantized)."""
        if self.codec.quantized_index:
            keys = None
            if (store is not None and k.device.type == "cpu" and cpu_shortcuts.enabled()
                    and not torch.compiler.is_compiling()):
                keys = store.decoded("index.mxfp4", _dequantize_mxfp4)
            return ops.indexer_scores(q, q_scales, w, k, k_scales, keys=keys)
        return self._weighted(torch.einsum("thd,nd->thn", q.double(), k.double()), w)

    @staticmethod
    def _weighted(dots: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        acc = dots[:, 0].clamp(min=0) * w[:, 0, None].double()
        for h in range(1, dots.shape[1]):  # fixed head order
            acc = acc + dots[:, h].clamp(min=0) * w[:, h, None].double()
        return acc.float()
