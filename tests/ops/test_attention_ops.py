"""The attention ops against dense float64 computations written out here, per query.

The expected values are built with the formats' torch reference decoders (independent of
the C++ codecs the ops use) and a plain loop over each query's valid keys.
"""
from __future__ import annotations

import math

import pytest
import torch

from dsv41 import formats, ops
from dsv41.formats import reference as fref


def _pools(gen, ns, ng, d):
    swa = torch.randn(ns, d, generator=gen) * 2
    kv = torch.randn(ng, d, generator=gen) * 2
    sv, ss = formats.quantize_fp8_swa(swa)
    kc, ks = formats.quantize_nvfp4(kv)
    return sv, ss, kc, ks


def _random_idx(gen, t, width, n, p_empty=0.3):
    idx = torch.randint(0, max(n, 1), (t, width), generator=gen, dtype=torch.int32)
    empty = torch.rand(t, width, generator=gen) < p_empty
    if n == 0:
        empty[:] = True
    return torch.where(empty, -1, idx)


def _expected(q, swa_rows, kv_rows, swa_idx, kv_idx, sink, scale):
    """Per query: softmax over [valid keys] + the sink as one more logit with a zero value."""
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    for t in range(T):
        keys = [swa_rows[j] for j in swa_idx[t].tolist() if j >= 0]
        keys += [kv_rows[j] for j in kv_idx[t].tolist() if j >= 0]
        if not keys:
            continue
        k = torch.stack(keys).double()
        for h in range(H):
            s = (k @ q[t, h].double()) * scale
            lse[t, h] = torch.logsumexp(s, 0)
            p = torch.exp(s - torch.logsumexp(torch.cat((s, sink[h:h + 1].double())), 0))
            out[t, h] = p @ k
    return out, lse


@pytest.mark.parametrize("T,H,D,W,K,ns,ng", [(5, 4, 64, 16, 8, 20, 30), (3, 2, 128, 4, 33, 7, 9),
                                             (4, 3, 32, 8, 0, 12, 0)])
def test_sparse_attention_matches_dense_per_query_softmax(gen, T, H, D, W, K, ns, ng):
    sv, ss, kc, ks = _pools(gen, ns, ng, D)
    q = torch.randn(T, H, D, generator=gen)
    sidx, kidx = _random_idx(gen, T, W, ns), _random_idx(gen, T, K, ng)
    sink = torch.randn(H, generator=gen)
    scale = D ** -0.5
    out, lse = ops.sparse_attention(q, sv, ss, sidx, kc, ks, kidx, sink, scale)
    swa_rows = fref.dequantize_fp8_swa(sv, ss)
    kv_rows = fref.dequantize_nvfp4(kc, ks) if ng else torch.zeros(0, D)
    want, want_lse = _expected(q, swa_rows, kv_rows, sidx, kidx, sink, scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_query_without_any_valid_key_gives_zero_and_minus_inf(gen):
    sv, ss, kc, ks = _pools(gen, 6, 6, 64)
    q = torch.randn(3, 2, 64, generator=gen)
    sidx = torch.full((3, 4), -1, dtype=torch.int32)
    kidx = torch.full((3, 5), -1, dtype=torch.int32)
    sidx[1, 2] = 3  # query 1 has one key, queries 0 and 2 none
    out, lse = ops.sparse_attention(q, sv, ss, sidx, kc, ks, kidx, torch.zeros(2), 0.125)
    for t in (0, 2):
        assert torch.equal(out[t], torch.zeros(2, 64))
        assert torch.isinf(lse[t]).all() and (lse[t] < 0).all()
    # One key with sink 0: out = v * e^s / (e^s + 1).
    v = fref.dequantize_fp8_swa(sv, ss)[3]
    s = (q[1].double() @ v.double()) * 0.125
    want = (torch.sigmoid(s)[:, None] * v.double()).float()
    torch.testing.assert_close(out[1], want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse[1], s.float())
    # The dense op follows the same convention.
    out_d, lse_d = ops.dense_attention(q, sv, ss, sidx, kc, ks, torch.tensor([0, 0, 0]),
                                       torch.zeros(2), 0.125)
    assert torch.equal(out_d[0], torch.zeros(2, 64)) and torch.isinf(lse_d[2]).all()
    torch.testing.assert_close(out_d[1], out[1])


def test_sparse_with_every_visible_entry_equals_dense(gen):
    T, H, D, W, N = 6, 4, 64, 8, 25
    sv, ss, kc, ks = _pools(gen, 14, N, D)
    q = torch.randn(T, H, D, generator=gen)
    sidx = _random_idx(gen, T, W, 14)
    visible = torch.tensor([0, 1, 5, 13, 24, 25])
    kidx = torch.full((T, N), -1, dtype=torch.int32)
    for t, v in enumerate(visible.tolist()):
        kidx[t, :v] = torch.arange(v, dtype=torch.int32)
    sink = torch.randn(H, generator=gen)
    sparse = ops.sparse_attention(q, sv, ss, sidx, kc, ks, kidx, sink, D ** -0.5)
    dense = ops.dense_attention(q, sv, ss, sidx, kc, ks, visible, sink, D ** -0.5)
    torch.testing.assert_close(sparse[0], dense[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sparse[1], dense[1], atol=1e-6, rtol=1e-6)


def test_attention_is_batch_invariant(gen):
    # One query's result must not depend on the other queries of the call.
    T, H, D = 9, 4, 128
    sv, ss, kc, ks = _pools(gen, 40, 50, D)
    q = torch.randn(T, H, D, generator=gen)
    sidx, kidx = _random_idx(gen, T, 16, 40), _random_idx(gen, T, 12, 50)
    sink = torch.randn(H, generator=gen)
    out, lse = ops.sparse_attention(q, sv, ss, sidx, kc, ks, kidx, sink, D ** -0.5)
    for t in range(T):
        o, l = ops.sparse_attention(q[t:t + 1], sv, ss, sidx[t:t + 1], kc, ks, kidx[t:t + 1],
                                    sink, D ** -0.5)
        assert torch.equal(o[0], out[t]) and torch.equal(l[0], lse[t])


def _mx(gen, shape, d):
    return formats.quantize_mxfp4(torch.randn(*shape, d, generator=gen))


def test_indexer_scores_match_the_definition(gen):
    T, Hi, Di, N = 5, 3, 64, 17
    qc, qs = _mx(gen, (T, Hi), Di)
    kc, ks = _mx(gen, (N,), Di)
    w = torch.randn(T, Hi, generator=gen)
    scores = ops.indexer_scores(qc, qs, w, kc, ks)
    q = fref.dequantize_mxfp4(qc, qs).double()
    k = fref.dequantize_mxfp4(kc, ks).double()
    want = torch.zeros(T, N, dtype=torch.float64)
    for t in range(T):
        for j in range(N):
            want[t, j] = sum(w[t, h].double() * torch.relu(q[t, h] @ k[j]) for h in range(Hi))
    torch.testing.assert_close(scores.double(), want, atol=1e-6, rtol=1e-6)
    # Scoring a subset gives the same bits as scoring everything (one value per pair).
    idx = torch.tensor([[0, 16, -1], [3, 3, 2], [-1, -1, -1], [5, 1, 0], [16, 15, 14]],
                       dtype=torch.int32)
    at = ops.indexer_scores_at(qc, qs, w, kc, ks, idx)
    gathered = scores.gather(1, idx.clamp(min=0).long()).masked_fill(idx < 0, -math.inf)
    assert torch.equal(at, gathered)
    # And a row's scores do not depend on how many keys or queries the call holds.
    assert torch.equal(ops.indexer_scores(qc[2:3], qs[2:3], w[2:3], kc[:9], ks[:9]),
                       scores[2:3, :9])


def _brute_topk(row, vis, k):
    order = sorted(range(vis), key=lambda j: (-row[j], j))[:k]
    return sorted(order) + [-1] * (k - len(order))


def test_topk_visible_is_exact_with_lowest_index_ties(gen):
    T, N, k = 40, 30, 7
    scores = torch.randint(-3, 4, (T, N), generator=gen).float()  # many ties
    visible = torch.randint(0, N + 3, (T,), generator=gen)
    idx = ops.topk_visible(scores, visible, k)
    assert idx.dtype == torch.int32 and idx.shape == (T, k)
    for t in range(T):
        assert idx[t].tolist() == _brute_topk(scores[t].tolist(), min(int(visible[t]), N), k)
    # Never an invisible column, even when invisible columns score best.
    scores[:, 10:] = 100.0
    idx = ops.topk_visible(scores, torch.full((T,), 10), k)
    assert int(idx.max()) < 10


def test_topk_visible_k_larger_than_columns(gen):
    scores = torch.randn(3, 4, generator=gen)
    idx = ops.topk_visible(scores, torch.tensor([4, 2, 0]), 6)
    assert idx.tolist() == [[0, 1, 2, 3, -1, -1], [0, 1, -1, -1, -1, -1], [-1] * 6]


def _brute_candidates(row, vis, block, n_blocks):
    nb = -(-vis // block)
    best = [max(row[b * block:min(vis, (b + 1) * block)]) for b in range(nb)]
    if nb:
        best[nb - 1] = math.inf
    chosen = sorted(sorted(range(nb), key=lambda b: (-best[b], b))[:n_blocks])
    pos = [p for b in chosen for p in range(b * block, (b + 1) * block) if p < vis]
    return pos + [-1] * (n_blocks * block - len(pos))


def test_candidate_blocks_keep_the_newest_block_and_the_best_blocks(gen):
    T, N, block, n_blocks = 30, 45, 4, 3
    scores = torch.randint(-5, 5, (T, N), generator=gen).float()
    visible = torch.randint(0, N + 1, (T,), generator=gen)
    visible[:3] = torch.tensor([1, 4, 45])
    pos = ops.candidate_blocks(scores, visible, block, n_blocks)
    assert pos.shape == (T, n_blocks * block) and pos.dtype == torch.int32
    for t in range(T):
        assert pos[t].tolist() == _brute_candidates(scores[t].tolist(), int(visible[t]), block,
                                                    n_blocks)


@pytest.mark.parametrize("op", ["sparse", "dense"])
def test_bf16_q_gives_bf16_out_and_float32_lse(gen, op):
    """bf16 q: the result of the same q values in float32, out rounded to bf16 once (no
    bf16 arithmetic inside), lse float32; checked against the float64 loop too."""
    T, H, D, W, K, ns, ng = 4, 3, 64, 8, 12, 10, 20
    sv, ss, kc, ks = _pools(gen, ns, ng, D)
    q = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
    sidx, kidx = _random_idx(gen, T, W, ns), _random_idx(gen, T, K, ng)
    sidx[1] = -1
    kidx[1] = -1  # a query without any valid key: out = 0 in bf16 too
    sink = torch.randn(H, generator=gen)
    scale = D ** -0.5
    if op == "sparse":
        run = lambda qq: ops.sparse_attention(qq, sv, ss, sidx, kc, ks, kidx, sink, scale)  # noqa: E731
        want, want_lse = _expected(q.float(), fref.dequantize_fp8_swa(sv, ss), fref.dequantize_nvfp4(kc, ks),
                                   sidx, kidx, sink, scale)
    else:
        vis = torch.tensor([3, 0, 20, 13])
        run = lambda qq: ops.dense_attention(qq, sv, ss, sidx, kc, ks, vis, sink, scale)  # noqa: E731
        want = want_lse = None
    out, lse = run(q)
    out32, lse32 = run(q.float())
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.shape == (T, H, D)
    assert torch.equal(out, out32.to(torch.bfloat16)) and torch.equal(lse, lse32)
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    if want is not None:  # rounding to bf16 is the only error: half an ulp (2^-8 relative)
        torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=1e-6)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_bf16_q_under_fake_tensors(gen):
    """The fake kernels give the real kernels' dtypes (out: q's, lse: float32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sv, ss, kc, ks = _pools(gen, 6, 5, 32)
    sidx, kidx = _random_idx(gen, 3, 4, 6), _random_idx(gen, 3, 2, 5)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(3, 2, 32, dtype=torch.bfloat16)
        out, lse = torch.ops.dsv41.sparse_attention(q, sv, ss, sidx, kc, ks, kidx, torch.zeros(2), 0.5)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_bad_arguments_get_clear_errors(gen):
    sv, ss, kc, ks = _pools(gen, 4, 4, 64)
    q = torch.randn(2, 2, 64)
    sidx = torch.zeros(2, 3, dtype=torch.int32)
    kidx = torch.zeros(2, 3, dtype=torch.int32)
    sink = torch.zeros(2)
    with pytest.raises(TypeError, match="q must be torch.float32 or torch.bfloat16, got torch.float64"):
        ops.sparse_attention(q.double(), sv, ss, sidx, kc, ks, kidx, sink, 1.0)
    with pytest.raises(TypeError, match="q must be torch.float32 or torch.bfloat16, got torch.float16"):
        ops.sparse_attention(q.half(), sv, ss, sidx, kc, ks, kidx, sink, 1.0)
    with pytest.raises(TypeError, match="kv_idx must be torch.int32"):
        ops.sparse_attention(q, sv, ss, sidx, kc, ks, kidx.long(), sink, 1.0)
    with pytest.raises(IndexError, match=r"kv_idx holds 4, outside \[-1, 4\)"):
        ops.sparse_attention(q, sv, ss, sidx, kc, ks, kidx + 4, sink, 1.0)
    with pytest.raises(ValueError, match="sink must have shape"):
        ops.sparse_attention(q, sv, ss, sidx, kc, ks, kidx, torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="do not hold NVFP4 rows of head dim 64"):
        ops.sparse_attention(q, sv, ss, sidx, kc[:, :16], ks, kidx, sink, 1.0)
    with pytest.raises(ValueError, match="visible has 2 rows"):
        ops.topk_visible(torch.zeros(3, 4), torch.zeros(2, dtype=torch.int64), 2)
    qc, qs = _mx(gen, (2, 2), 32)
    with pytest.raises(ValueError, match="weights must have shape"):
        ops.indexer_scores(qc, qs, torch.zeros(2, 3), *_mx(gen, (5,), 32))


# test_schema perturbs inputs with a multiply that float8 tensors do not support.
_OPCHECK = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def test_ops_pass_opcheck(gen):
    # Fake (meta) kernels, dispatch and tracing agree with the real kernels.
    sv, ss, kc, ks = _pools(gen, 6, 5, 32)
    q = torch.randn(3, 2, 32, generator=gen)
    sidx, kidx = _random_idx(gen, 3, 4, 6), _random_idx(gen, 3, 2, 5)
    torch.library.opcheck(torch.ops.dsv41.sparse_attention,
                          (q, sv, ss, sidx, kc, ks, kidx, torch.zeros(2), 0.5),
                          test_utils=_OPCHECK)
    torch.library.opcheck(torch.ops.dsv41.sparse_attention,
                          (q.to(torch.bfloat16), sv, ss, sidx, kc, ks, kidx, torch.zeros(2), 0.5),
                          test_utils=_OPCHECK)
    torch.library.opcheck(torch.ops.dsv41.dense_attention,
                          (q, sv, ss, sidx, kc, ks, torch.tensor([0, 2, 5]), torch.zeros(2), 0.5),
                          test_utils=_OPCHECK)
    scores = torch.randn(3, 9, generator=gen)
    torch.library.opcheck(torch.ops.dsv41.topk_visible, (scores, torch.tensor([9, 2, 0]), 4))
    torch.library.opcheck(torch.ops.dsv41.candidate_blocks, (scores, torch.tensor([9, 2, 0]), 2, 2))
    qc, qs = _mx(gen, (3, 2), 32)
    kc2, ks2 = _mx(gen, (7,), 32)
    torch.library.opcheck(torch.ops.dsv41.indexer_scores, (qc, qs, torch.randn(3, 2), kc2, ks2))
    torch.library.opcheck(torch.ops.dsv41.indexer_scores_at,
                          (qc, qs, torch.randn(3, 2), kc2, ks2, _random_idx(gen, 3, 4, 7)))
