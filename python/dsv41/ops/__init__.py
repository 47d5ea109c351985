"""dsv41's torch ops (namespace `torch.ops.dsv41`).

Loading this package loads the compiled extension (which registers the CPU and CUDA
kernels of the KV-format codecs, and the CUDA kernels of the attention, indexer and top-k
ops: csrc/bindings/kernels.cpp, docs/kernels.md), the attention and indexer ops
(`attention.py`, torch custom ops whose CPU implementation is the torch reference in
`reference.py`; CUDA tensors run the kernels), the cache-write and block-copy ops
(`cache_ops.py`), and the fake kernels that let all ops run under torch.compile /
FakeTensor. The format ops are wrapped with argument checks in `dsv41.formats`; the
attention and indexer ops are exported here:

    out, lse = sparse_attention(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales,
                                kv_idx, sink, softmax_scale)
    out, lse = dense_attention(..., kv_visible, sink, softmax_scale)   # the dense baseline
    scores = indexer_scores(q_codes, q_scales, weights, k_codes, k_scales)       # [T, N]
    scores = indexer_scores_at(q_codes, q_scales, weights, k_codes, k_scales, idx)  # [T, C]
    idx = topk_visible(scores, visible, k)                      # [T, k] int32, -1 padded
    pos = candidate_blocks(scores, visible, block, n_blocks)    # [T, n_blocks*block] int32
"""
from __future__ import annotations

import torch

from .._ext import _C  # noqa: F401  (registers torch.ops.dsv41.* codecs)
from . import attention, reference  # noqa: F401  (registers the attention/indexer ops)
from . import _fake  # noqa: F401
from .attention import (candidate_blocks, dense_attention, indexer_scores, indexer_scores_at,
                        sparse_attention, topk_visible)
from . import cache_ops  # noqa: F401  (cache writes, block copies: kernels in csrc/)

ops = torch.ops.dsv41

__all__ = ["ops", "reference", "sparse_attention", "dense_attention", "indexer_scores",
           "indexer_scores_at", "topk_visible", "candidate_blocks"]
