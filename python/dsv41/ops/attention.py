"""The attention and indexer ops as torch custom ops in the `dsv41` namespace.

Each op is registered with the float32/float64 torch reference (`dsv41.ops.reference`) as
its implementation for every device; the CUDA kernels issue overrides the CUDA key. The
fake (meta) kernels live in `_fake.py`. Conventions (shapes, -1 = empty, the no-key case)
are documented on the reference functions.
"""
from __future__ import annotations

import torch

from .. import profiling
from . import _checks, reference

Tensor = torch.Tensor


@torch.library.custom_op("dsv41::sparse_attention", mutates_args=())
def _sparse_attention(q: Tensor, swa_values: Tensor, swa_scales: Tensor, swa_idx: Tensor,
                      kv_codes: Tensor, kv_scales: Tensor, kv_idx: Tensor, sink: Tensor,
                      softmax_scale: float) -> tuple[Tensor, Tensor]:
    op = "sparse_attention"
    _checks.check_attention(op, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales,
                            kv_idx, sink, dense=False)
    _checks.check_indices(op, "swa_idx", swa_idx, swa_values.shape[0])
    _checks.check_indices(op, "kv_idx", kv_idx, kv_codes.shape[0])
    return reference.sparse_attention(q, swa_values, swa_scales.view(torch.uint8), swa_idx,
                                      kv_codes, kv_scales, kv_idx, sink, softmax_scale)


@torch.library.custom_op("dsv41::dense_attention", mutates_args=())
def _dense_attention(q: Tensor, swa_values: Tensor, swa_scales: Tensor, swa_idx: Tensor,
                     kv_codes: Tensor, kv_scales: Tensor, kv_visible: Tensor, sink: Tensor,
                     softmax_scale: float) -> tuple[Tensor, Tensor]:
    op = "dense_attention"
    _checks.check_attention(op, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales,
                            kv_visible, sink, dense=True)
    _checks.check_indices(op, "swa_idx", swa_idx, swa_values.shape[0])
    return reference.dense_attention(q, swa_values, swa_scales.view(torch.uint8), swa_idx,
                                     kv_codes, kv_scales, kv_visible, sink, softmax_scale)


@torch.library.custom_op("dsv41::indexer_scores", mutates_args=())
def _indexer_scores(q_codes: Tensor, q_scales: Tensor, weights: Tensor, k_codes: Tensor,
                    k_scales: Tensor) -> Tensor:
    _checks.check_indexer("indexer_scores", q_codes, q_scales, weights, k_codes, k_scales)
    return reference.indexer_scores(q_codes, q_scales.view(torch.uint8), weights, k_codes,
                                    k_scales.view(torch.uint8))


@torch.library.custom_op("dsv41::indexer_scores_at", mutates_args=())
def _indexer_scores_at(q_codes: Tensor, q_scales: Tensor, weights: Tensor, k_codes: Tensor,
                       k_scales: Tensor, idx: Tensor) -> Tensor:
    op = "indexer_scores_at"
    _checks.check_indexer(op, q_codes, q_scales, weights, k_codes, k_scales, idx)
    _checks.check_indices(op, "idx", idx, k_codes.shape[0])
    return reference.indexer_scores_at(q_codes, q_scales.view(torch.uint8), weights, k_codes,
                                       k_scales.view(torch.uint8), idx)


@torch.library.custom_op("dsv41::topk_visible", mutates_args=())
def _topk_visible(scores: Tensor, visible: Tensor, k: int) -> Tensor:
    _checks.check_selection("topk_visible", scores, visible, k)
    return reference.topk_visible(scores, visible, k)


@torch.library.custom_op("dsv41::candidate_blocks", mutates_args=())
def _candidate_blocks(scores: Tensor, visible: Tensor, block: int, n_blocks: int) -> Tensor:
    op = "candidate_blocks"
    _checks.check_selection(op, scores, visible, n_blocks, name="n_blocks")
    if block <= 0:
        raise ValueError(f"{op}: block must be positive, got {block}")
    return reference.candidate_blocks(scores, visible, block, n_blocks)


# ---- the Python API: keyword-friendly names for the ops above ---------------------------

@profiling.op("op.sparse_attention")
def sparse_attention(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink,
                     softmax_scale: float) -> tuple[Tensor, Tensor]:
    """See `dsv41.ops.reference.sparse_attention`."""
    return torch.ops.dsv41.sparse_attention(q, swa_values, swa_scales, swa_idx, kv_codes,
                                            kv_scales, kv_idx, sink, float(softmax_scale))


@profiling.op("op.dense_attention")
def dense_attention(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_visible, sink,
                    softmax_scale: float) -> tuple[Tensor, Tensor]:
    """See `dsv41.ops.reference.dense_attention` (the dense baseline)."""
    return torch.ops.dsv41.dense_attention(q, swa_values, swa_scales, swa_idx, kv_codes,
                                           kv_scales, kv_visible, sink, float(softmax_scale))


@profiling.op("op.indexer_scores")
def indexer_scores(q_codes, q_scales, weights, k_codes, k_scales) -> Tensor:
    """See `dsv41.ops.reference.indexer_scores`."""
    return torch.ops.dsv41.indexer_scores(q_codes, q_scales, weights, k_codes, k_scales)


@profiling.op("op.indexer_scores_at")
def indexer_scores_at(q_codes, q_scales, weights, k_codes, k_scales, idx) -> Tensor:
    """See `dsv41.ops.reference.indexer_scores_at`."""
    return torch.ops.dsv41.indexer_scores_at(q_codes, q_scales, weights, k_codes, k_scales, idx)


@profiling.op("op.topk_visible")
def topk_visible(scores, visible, k: int) -> Tensor:
    """See `dsv41.ops.reference.topk_visible`."""
    return torch.ops.dsv41.topk_visible(scores, visible, int(k))


@profiling.op("op.candidate_blocks")
def candidate_blocks(scores, visible, block: int, n_blocks: int) -> Tensor:
    """See `dsv41.ops.reference.candidate_blocks`."""
    return torch.ops.dsv41.candidate_blocks(scores, visible, int(block), int(n_blocks))
