"""CUDA indexer scores, exact top-k and hierarchical candidates (csrc/cuda/indexer.cu,
topk.cu) against the model's float64 reference: top-k and candidates must match exactly
(ties included: the kernels implement the reference's tie rule, lower index first), the
scores to float32 accumulation accuracy, and indexer + top-512 must keep >= 99.5% of the
set an fp32 oracle picks on real-scale random data."""
from __future__ import annotations

import math

import pytest
import torch

from dsv41 import formats

from .kernel_cases import DEVICE, distinct_scores, reference, tied_scores

pytestmark = pytest.mark.gpu(cpu_dry_run=True)


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


def _visible(gen, T, N, k):
    picks = [0, 1, k - 1, k, k + 1, N, N // 2, N + 5]  # +5: beyond N is clamped
    v = torch.tensor([picks[i % len(picks)] for i in range(T)], dtype=torch.int32)
    return v.clamp(min=0)


@pytest.mark.parametrize("N", [1, 100, 513, 5000, 8192, 8193, 20000, 65536, 131072, 300000])
def test_topk_visible_exact_no_ties(N, gen):
    k = 512
    scores = distinct_scores(gen, 8, N)
    visible = _visible(gen, 8, N, k)
    got = torch.ops.dsv41.topk_visible(*_dev(scores, visible), k).cpu()
    want = reference().topk_visible(scores, visible, k)
    assert got.dtype == torch.int32 and got.shape == (8, k)
    assert torch.equal(got, want)


@pytest.mark.parametrize("N,k", [(1000, 7), (40000, 512), (70000, 2048), (9000, 1)])
def test_topk_visible_exact_with_ties_and_infinities(N, k, gen):
    scores = tied_scores(gen, 6, N)
    scores[0, ::97] = math.inf
    scores[1, ::13] = -math.inf
    scores[2, :] = 1.25  # a row of equal scores: the first k visible positions
    visible = torch.tensor([N, N, N, N // 3, k, N - 1], dtype=torch.int32)
    got = torch.ops.dsv41.topk_visible(*_dev(scores, visible), k).cpu()
    assert torch.equal(got, reference().topk_visible(scores, visible, k))


def test_topk_int64_visible_and_zero_k(gen):
    scores = distinct_scores(gen, 3, 700)
    visible = torch.tensor([700, 3, 0], dtype=torch.int64)
    got = torch.ops.dsv41.topk_visible(*_dev(scores, visible), 64).cpu()
    assert torch.equal(got, reference().topk_visible(scores, visible, 64))
    assert torch.ops.dsv41.topk_visible(*_dev(scores, visible), 0).shape == (3, 0)


@pytest.mark.parametrize("N,n_blocks", [(5, 4), (8, 4), (17, 2), (3000, 64), (16384, 2048),
                                        (100000, 2048), (1_000_000, 2048)])
def test_candidate_blocks_exact(N, n_blocks, gen):
    T = 4
    scores = distinct_scores(gen, T, N) if N < 200000 else torch.randn(T, N, generator=gen)
    visible = torch.tensor([N, max(N - 3, 0), N // 2 + 1, 1], dtype=torch.int32)
    got = torch.ops.dsv41.candidate_blocks(*_dev(scores, visible), 8, n_blocks).cpu()
    want = reference().candidate_blocks(scores, visible, 8, n_blocks)
    assert got.shape == want.shape and torch.equal(got, want)


def _indexer_inputs(gen, T, N, Hi=32, Di=128):
    q = torch.randn(T, Hi, Di, generator=gen)
    k = torch.randn(N, Di, generator=gen)
    q_codes, q_scales = formats.quantize_mxfp4(q)
    k_codes, k_scales = formats.quantize_mxfp4(k)
    w = torch.randn(T, Hi, generator=gen) * (Di * Hi) ** -0.5
    return q_codes, q_scales, w, k_codes, k_scales


@pytest.mark.parametrize("T,N", [(1, 1), (1, 300), (4, 8192), (9, 1000), (3, 65536)])
def test_indexer_scores(T, N, gen):
    args = _indexer_inputs(gen, T, N)
    got = torch.ops.dsv41.indexer_scores(*_dev(*args)).cpu()
    want = reference().indexer_scores(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_indexer_scores_generic_shapes(gen):
    args = _indexer_inputs(gen, 3, 77, Hi=4, Di=64)  # small model: the fp32 kernel
    got = torch.ops.dsv41.indexer_scores(*_dev(*args)).cpu()
    torch.testing.assert_close(got, reference().indexer_scores(*args), rtol=1e-5, atol=1e-6)


def test_indexer_scores_at(gen):
    T, N, C = 3, 5000, 1000
    args = _indexer_inputs(gen, T, N)
    idx = torch.randint(0, N, (T, C), generator=gen, dtype=torch.int32)
    idx[:, -37:] = -1
    idx[1] = -1
    got = torch.ops.dsv41.indexer_scores_at(*_dev(*args, idx)).cpu()
    want = reference().indexer_scores_at(*args, idx)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-6)


def test_indexer_top512_overlap_with_fp32_oracle(gen):
    T, N, k = 4, 65536, 512
    args = _indexer_inputs(gen, T, N)
    visible = torch.tensor([N, N - 1000, 30000, 4096], dtype=torch.int32)
    dev = _dev(*args)
    idx = torch.ops.dsv41.topk_visible(torch.ops.dsv41.indexer_scores(*dev), visible.to(DEVICE), k).cpu()
    q = formats.dequantize_mxfp4(args[0], args[1])
    keys = formats.dequantize_mxfp4(args[3], args[4])
    oracle_scores = (torch.relu(torch.einsum("thd,nd->thn", q, keys)) * args[2][..., None]).sum(1)
    for t in range(T):
        v = int(visible[t])
        oracle = set(oracle_scores[t, :v].topk(k).indices.tolist())
        mine = set(i for i in idx[t].tolist() if i >= 0)
        assert len(mine) == k and len(mine & oracle) >= 0.995 * k
