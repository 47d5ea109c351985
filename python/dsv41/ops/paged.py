"""The indexer op of the paged step: each query scored against its own sequence's entries.

    scores = indexer_scores_paged(q_codes, q_scales, weights, k_codes, k_scales,
                                  seg_rows, query_seg)          # [T, E] f32

k_codes/k_scales are a page pool's rows [N, Di/2] / [N, Di/32]; seg_rows [S, E] int32 lists
each segment's entries as pool rows in entry order (-1 past its pages); query_seg [T] int64
names each query's segment. scores[t, j] = indexer_scores of query t against key
seg_rows[query_seg[t], j] (-inf where that is -1): the same values `indexer_scores` gives
against the segment's keys stored contiguously, so column j is entry j and
`topk_visible(scores, visible, k)` returns entry ids.

Implementations: the CPU reference dequantizes each segment's keys once and scores its
queries with `reference.indexer_scores` (a loop over the segments inside the op: one op
per step whatever the batch); CUDA gathers each query's row list and runs the
`indexer_scores_at` kernel (two launches, no host sync, capturable in a CUDA graph).
"""
from __future__ import annotations

import math

import torch

from .. import profiling
from . import _checks, reference

Tensor = torch.Tensor

__all__ = ["indexer_scores_paged"]


def _check(q_codes, q_scales, weights, k_codes, k_scales, seg_rows, query_seg):
    op = "indexer_scores_paged"
    _checks.check_indexer(op, q_codes, q_scales, weights, k_codes, k_scales)
    if seg_rows.dtype != torch.int32 or seg_rows.dim() != 2:
        raise TypeError(f"{op}: seg_rows must be int32 [S, E], got {seg_rows.dtype} "
                        f"{tuple(seg_rows.shape)}")
    if query_seg.dtype != torch.int64 or tuple(query_seg.shape) != (weights.shape[0],):
        raise TypeError(f"{op}: query_seg must be int64 [{weights.shape[0]}], got "
                        f"{query_seg.dtype} {tuple(query_seg.shape)}")
    if seg_rows.device != weights.device or query_seg.device != weights.device:
        raise ValueError(f"{op}: seg_rows and query_seg must be on {weights.device}")


@torch.library.custom_op("dsv41::indexer_scores_paged", mutates_args=())
def _indexer_scores_paged(q_codes: Tensor, q_scales: Tensor, weights: Tensor, k_codes: Tensor,
                          k_scales: Tensor, seg_rows: Tensor, query_seg: Tensor) -> Tensor:
    _check(q_codes, q_scales, weights, k_codes, k_scales, seg_rows, query_seg)
    T, E = weights.shape[0], seg_rows.shape[1]
    out = torch.full((T, E), -math.inf, dtype=torch.float32, device=weights.device)
    if T == 0 or E == 0:
        return out
    _checks.check_indices("indexer_scores_paged", "seg_rows", seg_rows, k_codes.shape[0])
    if int(query_seg.min()) < 0 or int(query_seg.max()) >= seg_rows.shape[0]:
        raise IndexError(f"indexer_scores_paged: query_seg outside [0, {seg_rows.shape[0]})")
    qs, ks = q_scales.view(torch.uint8), k_scales.view(torch.uint8)
    for s in torch.unique(query_seg).tolist():
        rows = (query_seg == s).nonzero().view(-1)
        keys = seg_rows[s]
        n = int((keys >= 0).sum())      # the segment's entries are a prefix of its row list
        if n == 0:
            continue
        k = keys[:n].long()
        out[rows, :n] = reference.indexer_scores(q_codes[rows], qs[rows], weights[rows],
                                                 k_codes[k], ks[k])
    return out


@_indexer_scores_paged.register_fake
def _(q_codes, q_scales, weights, k_codes, k_scales, seg_rows, query_seg):
    _check(q_codes, q_scales, weights, k_codes, k_scales, seg_rows, query_seg)
    return weights.new_empty((weights.shape[0], seg_rows.shape[1]))


@_indexer_scores_paged.register_kernel("cuda")
def _(q_codes, q_scales, weights, k_codes, k_scales, seg_rows, query_seg):
    _check(q_codes, q_scales, weights, k_codes, k_scales, seg_rows, query_seg)
    idx = seg_rows.index_select(0, query_seg)
    return torch.ops.dsv41.indexer_scores_at(q_codes, q_scales, weights, k_codes, k_scales, idx)


@profiling.op("op.indexer_scores_paged")
def indexer_scores_paged(q_codes, q_scales, weights, k_codes, k_scales, seg_rows,
                         query_seg) -> Tensor:
    """See the module docstring."""
    return torch.ops.dsv41.indexer_scores_paged(q_codes, q_scales, weights, k_codes, k_scales,
                                                seg_rows, query_seg)
