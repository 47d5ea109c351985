"""The ops that select what sparse attention reads, each defined in one place: here.

indexer_scores / indexer_scores_at (the CSA2 indexer's scores, all keys or gathered) and
topk_visible / candidate_blocks (exact selection). For each: the schema (a torch custom op
in the `dsv41` namespace), the checks (`_checks`, their only copy), the CPU implementation
(the torch reference, `dsv41.ops.reference`), the CUDA implementation (the checks, then
`dsv41._C.kernels`: csrc/cuda/indexer.cu, topk.cu) and the fake kernel. The indexer
counts its generic-kernel fallbacks in `dsv41.ops.fallbacks`.
"""
from __future__ import annotations

import torch

from .. import cpu_shortcuts, profiling
from .._ext import _C
from . import _checks, reference
from .fallbacks import fallbacks

Tensor = torch.Tensor

__all__ = ["indexer_scores", "indexer_scores_at", "topk_visible", "candidate_blocks"]

_K = _C.kernels
_CUDA = hasattr(_K, "indexer_scores")


def _check_candidates(op, scores, visible, block, n_blocks):
    _checks.check_selection(op, scores, visible, n_blocks, name="n_blocks")
    if block <= 0:
        raise ValueError(f"{op}: block must be positive, got {block}")


# ---- indexer ----------------------------------------------------------------------------

def _indexer_scores_cpu(q_codes, q_scales, weights, k_codes, k_scales, keys=None) -> Tensor:
    _checks.check_indexer("indexer_scores", q_codes, q_scales, weights, k_codes, k_scales)
    if keys is not None and (keys.shape[0] != k_codes.shape[0] or keys.dtype != torch.float32):
        raise ValueError(f"indexer_scores: keys must be float32 [{k_codes.shape[0]}, Di], got "
                         f"{keys.dtype} {tuple(keys.shape)}")
    return reference.indexer_scores(q_codes, q_scales.view(torch.uint8), weights, k_codes,
                                    k_scales.view(torch.uint8), keys=keys)


@torch.library.custom_op("dsv41::indexer_scores", mutates_args=())
def _indexer_scores(q_codes: Tensor, q_scales: Tensor, weights: Tensor, k_codes: Tensor,
                    k_scales: Tensor) -> Tensor:
    return _indexer_scores_cpu(q_codes, q_scales, weights, k_codes, k_scales)


@torch.library.custom_op("dsv41::indexer_scores_at", mutates_args=())
def _indexer_scores_at(q_codes: Tensor, q_scales: Tensor, weights: Tensor, k_codes: Tensor,
                       k_scales: Tensor, idx: Tensor) -> Tensor:
    op = "indexer_scores_at"
    _checks.check_indexer(op, q_codes, q_scales, weights, k_codes, k_scales, idx)
    _checks.check_indices(op, "idx", idx, k_codes.shape[0])
    return reference.indexer_scores_at(q_codes, q_scales.view(torch.uint8), weights, k_codes,
                                       k_scales.view(torch.uint8), idx)


def _indexer_cuda(op, q_codes, q_scales, weights, k_codes, k_scales, idx=None):
    # The checks of the CPU path except the index values (on CUDA outside [0, rows) = -inf).
    _checks.check_indexer(op, q_codes, q_scales, weights, k_codes, k_scales, idx)
    scores, why = _K.indexer_scores(q_codes, q_scales, weights, k_codes, k_scales, idx)
    if why:
        fallbacks.record(op, why)
    return scores


@torch.library.register_fake("dsv41::indexer_scores")
def _indexer_scores_fake(q_codes, q_scales, weights, k_codes, k_scales):
    _checks.check_indexer("indexer_scores", q_codes, q_scales, weights, k_codes, k_scales)
    return weights.new_empty((weights.shape[0], k_codes.shape[0]))


@torch.library.register_fake("dsv41::indexer_scores_at")
def _indexer_scores_at_fake(q_codes, q_scales, weights, k_codes, k_scales, idx):
    _checks.check_indexer("indexer_scores_at", q_codes, q_scales, weights, k_codes, k_scales, idx)
    return weights.new_empty(tuple(idx.shape))


# ---- top-k ------------------------------------------------------------------------------

def _topk_visible_cpu(scores, visible, k: int) -> Tensor:
    _checks.check_selection("topk_visible", scores, visible, k)
    return reference.topk_visible(scores, visible, k)


def _candidate_blocks_cpu(scores, visible, block: int, n_blocks: int) -> Tensor:
    _check_candidates("candidate_blocks", scores, visible, block, n_blocks)
    return reference.candidate_blocks(scores, visible, block, n_blocks)


@torch.library.custom_op("dsv41::topk_visible", mutates_args=())
def _topk_visible(scores: Tensor, visible: Tensor, k: int) -> Tensor:
    return _topk_visible_cpu(scores, visible, k)


@torch.library.custom_op("dsv41::candidate_blocks", mutates_args=())
def _candidate_blocks(scores: Tensor, visible: Tensor, block: int, n_blocks: int) -> Tensor:
    return _candidate_blocks_cpu(scores, visible, block, n_blocks)


@torch.library.register_fake("dsv41::topk_visible")
def _topk_visible_fake(scores, visible, k):
    _checks.check_selection("topk_visible", scores, visible, k)
    return scores.new_empty((scores.shape[0], k), dtype=torch.int32)


@torch.library.register_fake("dsv41::candidate_blocks")
def _candidate_blocks_fake(scores, visible, block, n_blocks):
    _check_candidates("candidate_blocks", scores, visible, block, n_blocks)
    return scores.new_empty((scores.shape[0], n_blocks * block), dtype=torch.int32)


if _CUDA:
    @_indexer_scores.register_kernel("cuda")
    def _indexer_scores_cuda(q_codes, q_scales, weights, k_codes, k_scales):
        return _indexer_cuda("indexer_scores", q_codes, q_scales, weights, k_codes, k_scales)

    @_indexer_scores_at.register_kernel("cuda")
    def _indexer_scores_at_cuda(q_codes, q_scales, weights, k_codes, k_scales, idx):
        return _indexer_cuda("indexer_scores_at", q_codes, q_scales, weights, k_codes, k_scales, idx)

    @_topk_visible.register_kernel("cuda")
    def _topk_visible_cuda(scores, visible, k):
        _checks.check_selection("topk_visible", scores, visible, k)
        return _K.topk(scores, visible, int(k), 1)

    @_candidate_blocks.register_kernel("cuda")
    def _candidate_blocks_cuda(scores, visible, block, n_blocks):
        _check_candidates("candidate_blocks", scores, visible, block, n_blocks)
        return _K.topk(scores, visible, int(n_blocks), int(block))


# ---- the Python API: keyword-friendly names for the ops above ---------------------------

def _eager_cpu(t: Tensor) -> bool:
    """On the CPU outside torch.compile (with dsv41.cpu_shortcuts on), indexer_scores,
    topk_visible and candidate_blocks call their CPU implementation (the same checks and
    reference, no host read) as a plain call: the custom-op dispatch costs more than a
    decode step's call does. indexer_scores_at keeps the dispatch (its index check reads
    values, which the paged step must not do outside the op)."""
    return (t.device.type == "cpu" and not torch.compiler.is_compiling()
            and cpu_shortcuts.enabled())


@profiling.op("op.indexer_scores")
def indexer_scores(q_codes, q_scales, weights, k_codes, k_scales, *, keys=None) -> Tensor:
    """See `dsv41.ops.reference.indexer_scores`. keys: the keys dequantized (float32 [N, Di],
    a cache of dequantize_mxfp4(k_codes, k_scales)), read instead of decoding k_codes on the
    eager CPU path (same values, so the same scores); ignored elsewhere."""
    if _eager_cpu(weights):
        return _indexer_scores_cpu(q_codes, q_scales, weights, k_codes, k_scales, keys)
    return torch.ops.dsv41.indexer_scores(q_codes, q_scales, weights, k_codes, k_scales)


@profiling.op("op.indexer_scores_at")
def indexer_scores_at(q_codes, q_scales, weights, k_codes, k_scales, idx) -> Tensor:
    """See `dsv41.ops.reference.indexer_scores_at`."""
    return torch.ops.dsv41.indexer_scores_at(q_codes, q_scales, weights, k_codes, k_scales, idx)


@profiling.op("op.topk_visible")
def topk_visible(scores, visible, k: int) -> Tensor:
    """See `dsv41.ops.reference.topk_visible`."""
    if _eager_cpu(scores):
        return _topk_visible_cpu(scores, visible, int(k))
    return torch.ops.dsv41.topk_visible(scores, visible, int(k))


@profiling.op("op.candidate_blocks")
def candidate_blocks(scores, visible, block: int, n_blocks: int) -> Tensor:
    """See `dsv41.ops.reference.candidate_blocks`."""
    if _eager_cpu(scores):
        return _candidate_blocks_cpu(scores, visible, int(block), int(n_blocks))
    return torch.ops.dsv41.candidate_blocks(scores, visible, int(block), int(n_blocks))
