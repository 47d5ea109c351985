"""Torch reference of the attention and indexer ops (docs/design.md#attention,
docs/design.md#indexer), the CPU implementation.

Every op is index based: the caller builds, per query, the list of SWA slots and global
entries it may see (-1 = empty), so one op serves prefill, decode, batching, ring buffers
and the replay start rule of docs/design.md#replay. The CUDA kernels issue replaces these with
kernels that must match them (see tests/ops/).

Determinism. The model needs every per-query result to be independent of how many queries
one call holds (chunked prefill must write the same bytes as one-shot prefill), but BLAS
picks different kernels and summation orders for different matrix shapes. So the math runs
in float64 and is rounded to float32 once at the end: shape-dependent float64 differences
(~1e-16 relative) flip a float32 rounding only with probability ~2^-29 per value. Indexer
scores are sums of products of FP4 values with power-of-two scales, which float64 holds
exactly, and the sum over heads runs in a fixed order.

Stored inputs are dequantized here (exactly: every FP4/FP8 value is a float32). The
reference dequantizes either only the gathered rows or the whole pool, whichever is
smaller; both give the same bits.
"""
from __future__ import annotations

import math

import torch

from .. import formats

__all__ = [
    "sparse_attention", "dense_attention", "indexer_scores", "indexer_scores_at",
    "topk_visible", "candidate_blocks", "apply_sink",
]

# Bound on the float64 working set of one query block (elements), to keep memory flat at
# long lengths. Blocking never changes a query's result (each query is independent).
_BLOCK_ELEMS = 1 << 22


def _query_block(per_query: int) -> int:
    return max(1, _BLOCK_ELEMS // max(1, per_query))


def _out_dtype(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The attention output in q's dtype: float32 stays, bf16 q gets out rounded to bf16."""
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _dequant_swa(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if values.shape[0] == 0:
        return values.new_zeros(values.shape, dtype=torch.float32)
    return formats.dequantize_fp8_swa(values, scales)


def _dequant_kv(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if codes.shape[0] == 0:
        return torch.zeros(0, codes.shape[1] * 2, dtype=torch.float32, device=codes.device)
    return formats.dequantize_nvfp4(codes, scales)


class _Rows:
    """Rows of a quantized pool as float64, dequantized all at once (when the gathers
    outnumber the rows) or on gather; both give the same values."""

    def __init__(self, dequant, codes, scales, gathers: int):
        self.dequant, self.codes, self.scales = dequant, codes, scales
        self.full = (dequant(codes, scales).double()
                     if 0 < codes.shape[0] <= gathers else None)

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """float64 rows at idx (any shape; -1 gives row 0, the caller masks it)."""
        flat = idx.reshape(-1).long().clamp(min=0)
        if self.codes.shape[0] == 0:
            d = self.codes.shape[1] * (2 if self.codes.dtype == torch.uint8 else 1)
            return torch.zeros(*idx.shape, d, dtype=torch.float64, device=idx.device)
        if self.full is not None:
            rows = self.full.index_select(0, flat)
        else:
            rows = self.dequant(self.codes.index_select(0, flat),
                                self.scales.index_select(0, flat)).double()
        return rows.reshape(*idx.shape, rows.shape[-1])


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink), per head.
    lse = -inf (no valid key) gives a factor of 0."""
    return out * torch.sigmoid(lse - sink.to(lse.dtype))[..., None]


def _softmax_out(scores: torch.Tensor, valid: torch.Tensor, values: torch.Tensor):
    """scores [t,H,K] f64, valid [t,K], values [t,K,D] f64 -> (out [t,H,D], lse [t,H]) f64.
    A query without any valid key gets out = 0, lse = -inf."""
    scores = scores.masked_fill(~valid[:, None, :], -math.inf)
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    denom = p.sum(-1)
    out = torch.bmm(p, values) / torch.where(denom > 0, denom, 1.0)[..., None]
    lse = torch.where(denom > 0, m[..., 0] + torch.log(denom), -math.inf)
    return out, lse


def sparse_attention(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink,
                     softmax_scale: float):
    """One softmax per query over its valid SWA slots and valid selected global entries.

    q [T,H,D] f32 or bf16; swa_values [Ns,D] float8_e4m3fn + swa_scales [Ns,D/32] UE8M0 (uint8);
    swa_idx [T,W] int32 rows of the SWA buffer (-1 = empty); kv_codes [Ng,D/2] uint8 +
    kv_scales [Ng,D/16] float8_e4m3fn (NVFP4); kv_idx [T,K] int32 rows of the global pool
    (-1 = empty); sink [H] f32. MQA: every head reads the same entry as key and value.

    Returns out [T,H,D] (already multiplied by the sink factor
    exp(lse) / (exp(lse) + exp(sink_h))) and lse [T,H] f32, the log-sum-exp of the scaled
    scores of the valid keys without the sink. A query with no valid key gets out = 0 and
    lse = -inf. out has q's dtype: a bf16 q is computed with like a float32 one (its values
    widened, float64 arithmetic) and only out is rounded to bf16 at the end; lse stays f32.
    """
    T, H, D = q.shape
    W, K = swa_idx.shape[1], kv_idx.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), -math.inf, dtype=torch.float32, device=q.device)
    if T == 0 or W + K == 0:
        return _out_dtype(out, q), lse
    swa = _Rows(_dequant_swa, swa_values, swa_scales, T * W)
    kv = _Rows(_dequant_kv, kv_codes, kv_scales, T * K)
    sink64 = sink.double()
    step = _query_block((W + K) * (D + H))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        keys = torch.cat((swa.gather(swa_idx[t0:t1]), kv.gather(kv_idx[t0:t1])), 1)
        valid = torch.cat((swa_idx[t0:t1] >= 0, kv_idx[t0:t1] >= 0), 1)
        scores = torch.bmm(q[t0:t1].double(), keys.transpose(1, 2)) * softmax_scale
        o, l = _softmax_out(scores, valid, keys)
        out[t0:t1] = apply_sink(o, l, sink64).float()
        lse[t0:t1] = l.float()
    return _out_dtype(out, q), lse


def dense_attention(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_visible, sink,
                    softmax_scale: float):
    """The dense baseline: like sparse_attention, but each query sees every global entry
    j < kv_visible[t] instead of a selected list. Same outputs and conventions."""
    T, H, D = q.shape
    W = swa_idx.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), -math.inf, dtype=torch.float32, device=q.device)
    n = int(kv_visible.max().clamp(min=0, max=kv_codes.shape[0])) if T else 0
    if T == 0 or W + n == 0:
        return _out_dtype(out, q), lse
    swa = _Rows(_dequant_swa, swa_values, swa_scales, T * W)
    kv = _dequant_kv(kv_codes[:n], kv_scales[:n]).double()
    cols = torch.arange(n, device=q.device)
    sink64 = sink.double()
    step = _query_block((W + D) * H + n * H)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        q64 = q[t0:t1].double()
        k_swa = swa.gather(swa_idx[t0:t1])
        s_swa = torch.bmm(q64, k_swa.transpose(1, 2)) * softmax_scale
        s_kv = torch.matmul(q64, kv.T) * softmax_scale
        scores = torch.cat((s_swa, s_kv), -1)
        valid = torch.cat((swa_idx[t0:t1] >= 0, cols[None, :] < kv_visible[t0:t1, None]), 1)
        scores = scores.masked_fill(~valid[:, None, :], -math.inf)
        m = scores.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m)
        denom = p.sum(-1)
        o = torch.bmm(p[..., :W], k_swa) + torch.matmul(p[..., W:], kv)
        o = o / torch.where(denom > 0, denom, 1.0)[..., None]
        l = torch.where(denom > 0, m[..., 0] + torch.log(denom), -math.inf)
        out[t0:t1] = apply_sink(o, l, sink64).float()
        lse[t0:t1] = l.float()
    return _out_dtype(out, q), lse


def _weighted_relu_sum(dots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_h w[t,h] * relu(dots[t,h,n]) with the heads added in a fixed order (float64)."""
    acc = dots[:, 0].clamp(min=0) * weights[:, 0, None]
    for h in range(1, dots.shape[1]):
        acc += dots[:, h].clamp(min=0) * weights[:, h, None]
    return acc


def indexer_scores(q_codes, q_scales, weights, k_codes, k_scales, keys=None):
    """I[t,j] = sum_h w[t,h] * ReLU(q[t,h] . k[j]) over every key j.

    q_codes [T,Hi,Di/2] uint8 + q_scales [T,Hi,Di/32] UE8M0 (MXFP4 queries), weights
    [T,Hi] f32, k_codes [N,Di/2] + k_scales [N,Di/32] (MXFP4 keys) -> scores [T,N] f32.
    keys: the keys already dequantized (float32 [N,Di], exactly dequantize_mxfp4's values:
    a cache of them), or None to dequantize k_codes here.
    """
    T, Hi = weights.shape
    N = k_codes.shape[0]
    scores = torch.zeros(T, N, dtype=torch.float32, device=weights.device)
    if T == 0 or N == 0:
        return scores
    keys = (formats.dequantize_mxfp4(k_codes, k_scales) if keys is None else keys).double()
    queries = formats.dequantize_mxfp4(q_codes, q_scales)
    step = _query_block(Hi * N)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        dots = torch.matmul(queries[t0:t1].double(), keys.T)  # [t,Hi,N]
        scores[t0:t1] = _weighted_relu_sum(dots, weights[t0:t1].double()).float()
    return scores


def indexer_scores_at(q_codes, q_scales, weights, k_codes, k_scales, idx):
    """indexer_scores at the keys idx [T,C] int32 only (-1 gives -inf) -> [T,C] f32."""
    T, Hi = weights.shape
    C = idx.shape[1]
    scores = torch.full((T, C), -math.inf, dtype=torch.float32, device=weights.device)
    if T == 0 or C == 0 or k_codes.shape[0] == 0:
        return scores
    Di = k_codes.shape[1] * 2
    keys = _Rows(formats.dequantize_mxfp4, k_codes, k_scales, T * C)
    queries = formats.dequantize_mxfp4(q_codes, q_scales)
    step = _query_block(C * (Di + Hi))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        k = keys.gather(idx[t0:t1])  # [t,C,Di] f64
        dots = torch.bmm(queries[t0:t1].double(), k.transpose(1, 2))  # [t,Hi,C]
        s = _weighted_relu_sum(dots, weights[t0:t1].double()).float()
        scores[t0:t1] = s.masked_fill(idx[t0:t1] < 0, -math.inf)
    return scores


def topk_visible(scores, visible, k: int):
    """The k best of scores[t, :visible[t]], exact, ties broken toward the lower index.

    scores [T,N] f32 (finite where visible), visible [T] int -> idx [T,k] int32: the chosen
    columns in ascending order, then -1 padding (a row with fewer than k visible columns
    selects all of them).
    """
    T, N = scores.shape
    out = torch.full((T, k), -1, dtype=torch.int32, device=scores.device)
    kk = min(k, N)
    if T == 0 or kk == 0:
        return out
    vis = visible.to(torch.int64).clamp(0, N)
    cols = torch.arange(N, device=scores.device)
    mask = cols[None, :] < vis[:, None]
    s = scores.masked_fill(~mask, -math.inf)
    kth = s.topk(kk, dim=1).values[:, -1:]  # values are exact whatever the tie order
    greater = (s > kth) & mask
    equal = (s == kth) & mask
    need = torch.minimum(vis, torch.tensor(k, device=vis.device)) - greater.sum(1)
    chosen = greater | (equal & (equal.cumsum(1) <= need[:, None]))
    # The chosen columns in ascending order without reading their count on the host: the
    # kk largest of -column among them (unchosen columns map to -N), a sorted top-k.
    picked = -torch.where(chosen, -cols, -N).topk(kk, dim=1).values
    out[:, :kk] = torch.where(picked < N, picked, -1).to(torch.int32)
    return out


def candidate_blocks(scores, visible, block: int, n_blocks: int):
    """Hierarchical candidates: the max score per block of `block` positions, the top
    `n_blocks` blocks (ties toward the lower block, the newest block - partial or
    complete - always kept), expanded to positions.

    scores [T,N] f32, visible [T] int -> positions [T, n_blocks*block] int32, ascending,
    -1 for positions past visible[t] and for unused block slots (so the valid candidates
    of a row are a prefix of it).
    """
    T, N = scores.shape
    if T == 0 or N == 0:
        return torch.full((T, n_blocks * block), -1, dtype=torch.int32, device=scores.device)
    nb = -(-N // block)
    vis = visible.to(torch.int64).clamp(0, N)
    cols = torch.arange(nb * block, device=scores.device)
    s = torch.full((T, nb * block), -math.inf, dtype=torch.float32, device=scores.device)
    s[:, :N] = scores
    s = s.masked_fill(cols[None, :] >= vis[:, None], -math.inf)
    best = s.view(T, nb, block).amax(-1)
    vis_blocks = -(-vis // block)
    newest = (vis_blocks - 1).clamp(min=0)
    best[torch.arange(T, device=scores.device), newest] = torch.where(
        vis_blocks > 0, math.inf, best[torch.arange(T, device=scores.device), newest])
    blocks = topk_visible(best, vis_blocks, n_blocks).to(torch.int64)
    pos = blocks[:, :, None] * block + torch.arange(block, device=scores.device)
    ok = (blocks[:, :, None] >= 0) & (pos < vis[:, None, None])
    return torch.where(ok, pos, -1).reshape(T, n_blocks * block).to(torch.int32)
