"""dsv41's torch ops (namespace `torch.ops.dsv41`).

Where each op lives (docs/kernels.md has the table):
- the attention ops (`attention.py`) and the indexer and top-k ops (`selection.py`): schema,
  CPU reference (`reference.py`), CUDA kernels (after the checks of `_checks.py`, their only
  copy) and fake kernel, each in its module; the CUDA kernels are `dsv41._C.kernels`;
- the format codecs (csrc/bindings/torch_ops.cpp, fakes in `_fake.py`, wrapped with checks
  in `dsv41.formats`) and the cache-write and block-copy ops (csrc/bindings/kernels.cpp,
  Python API in `cache_ops.py`).

    plan = attention_plan(num_queries, num_heads, head_dim, swa_width=W, topk=K, device=dev)
    out, lse = sparse_attention(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales,
                                kv_idx, sink, softmax_scale, plan=plan)   # plan optional
    out, lse = dense_attention(..., kv_visible, sink, softmax_scale)   # the dense baseline
    scores = indexer_scores(q_codes, q_scales, weights, k_codes, k_scales)       # [T, N]
    scores = indexer_scores_at(q_codes, q_scales, weights, k_codes, k_scales, idx)  # [T, C]
    scores = indexer_scores_paged(q_codes, ..., k_codes, k_scales, seg_rows, query_seg)  # [T, E]
    idx = topk_visible(scores, visible, k)                      # [T, k] int32, -1 padded
    pos = candidate_blocks(scores, visible, block, n_blocks)    # [T, n_blocks*block] int32
    y = rms_norm(x, weight, eps); y = rope(x, cos, sin)          # per-row layer math (layer.py)
    fallbacks.total(), fallbacks.counts()    # CUDA calls that ran a generic kernel, and why
"""
from __future__ import annotations

import torch

from .._ext import _C  # noqa: F401  (registers torch.ops.dsv41.* codecs and cache ops)
from . import _fake  # noqa: F401
from . import attention, reference, selection  # noqa: F401  (define the attention/selection ops)
from .attention import AttentionPlan, attention_plan, dense_attention, sparse_attention
from .fallbacks import fallbacks
from .selection import candidate_blocks, indexer_scores, indexer_scores_at, topk_visible
from . import cache_ops  # noqa: F401  (cache writes, block copies: kernels in csrc/)
from .paged import indexer_scores_paged  # the paged step's indexer (ops/paged.py)
from .layer import hc_collapse, hc_expand, hc_weights, rms_norm, rope  # per-row math (ops/layer.py)

ops = torch.ops.dsv41

__all__ = ["ops", "reference", "sparse_attention", "dense_attention", "indexer_scores",
           "indexer_scores_at", "indexer_scores_paged", "topk_visible", "candidate_blocks",
           "AttentionPlan", "attention_plan", "fallbacks", "rms_norm", "rope", "hc_weights",
           "hc_collapse", "hc_expand"]
