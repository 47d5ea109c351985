"""dsv41::rms_norm, dsv41::rope and the mHC ops dsv41::hc_* (ops/layer.py) against their
torch definitions."""
from __future__ import annotations

import math

import pytest
import torch

from dsv41 import ops
from dsv41.model.rope import Rope
from dsv41.config import ModelConfig


def _rms_ref(x, w, eps):
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    return (y if w is None else y * w.double()).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_the_float64_definition(dtype, weighted, gen):
    x = (torch.randn(7, 3, 96, generator=gen) * 5).to(dtype)
    w = torch.randn(96, generator=gen) if weighted else None
    got = ops.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, _rms_ref(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    b = ops.rms_norm(x, w, 1e-6, torch.bfloat16)
    assert b.dtype == torch.bfloat16 and torch.equal(b, got.to(torch.bfloat16))  # RNE, as torch


def test_rms_norm_and_rope_refuse_bad_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        ops.rms_norm(x, torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(x.double(), None, 1e-6)
    with pytest.raises(RuntimeError, match="out dtype"):
        ops.rms_norm(x, None, 1e-6, torch.float16)
    cos = torch.ones(4, 2)
    with pytest.raises(RuntimeError, match="rows"):
        ops.rope(x, cos[:3], cos[:3])
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.rope(x, torch.ones(4, 5), torch.ones(4, 5))


@pytest.mark.parametrize("shape", [(5, 64), (5, 4, 64), (1, 2, 3, 64)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_equals_the_complex_rotation_of_the_last_dims(shape, inverse, gen):
    """The float32 production rotation: (a + ib)(cos + i sin) of each pair (2i, 2i+1) of the
    last 2 * pairs dims, in complex64 - what the production path computed before the op."""
    rope = Rope.for_layer(ModelConfig.preset("v41-tiny"), 2)
    x = torch.randn(*shape, generator=gen)
    pos = torch.randint(0, 5000, (shape[0],), generator=gen)
    cos, sin = rope.table(pos)
    got = ops.rope(x, cos, sin, inverse)
    want = x.clone()
    pairs = torch.view_as_complex(want[..., -rope.dim:].unflatten(-1, (-1, 2)))
    angle = torch.complex(cos, -sin if inverse else sin).view(
        (shape[0],) + (1,) * (len(shape) - 2) + (rope.dim // 2,))
    pairs.mul_(angle)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6 * float(x.abs().max()))
    assert torch.equal(got[..., :-rope.dim], x[..., :-rope.dim])
    back = ops.rope(got, cos, sin, not inverse)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-5)


def test_rope_table_keeps_phase_at_large_positions():
    """The angles are float64 before rounding: position 1e6 rotates like the float64 math."""
    rope = Rope.for_layer(ModelConfig.preset("v41-tiny"), 0)
    cos, sin = rope.table(torch.tensor([1_000_000]))
    ang = 1_000_000 * rope.freqs
    assert torch.equal(cos[0], torch.cos(ang).float()) and torch.equal(sin[0], torch.sin(ang).float())
    assert math.isclose(float(cos[0, 0]), math.cos(1_000_000), abs_tol=1e-6)


def test_layer_ops_have_fake_kernels_for_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(3, 2, 64, dtype=torch.bfloat16)
        assert ops.rms_norm(x, None, 1e-6, torch.bfloat16).dtype == torch.bfloat16
        assert ops.rope(x, torch.empty(3, 8), torch.empty(3, 8)).shape == x.shape
        pre, post, comb = ops.hc_weights(torch.empty(3, 24), torch.empty(24), torch.empty(3),
                                         4, 20, 1e-6)
        assert (pre.shape, post.shape, comb.shape) == ((3, 4), (3, 4), (3, 4, 4))
        h = torch.empty(3, 4, 64)
        assert ops.hc_collapse(h, pre).shape == (3, 64)
        assert ops.hc_expand(h, torch.empty(3, 64), post, comb).shape == h.shape


def _hc_weights_ref(mix, base, scale, n, iters, eps):
    """The torch expressions of mhc.HyperConnection.weights' float32 path."""
    T = mix.shape[0]
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = mix[:, 2 * n:].view(T, n, n) * scale[2] + base[2 * n:].view(n, n)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


@pytest.mark.parametrize("n,iters", [(4, 20), (2, 1), (3, 5)])
def test_hc_weights_match_the_torch_sinkhorn(n, iters, gen):
    mix = torch.randn(6, (2 + n) * n, generator=gen) * 3
    base, scale = torch.randn((2 + n) * n, generator=gen), torch.rand(3, generator=gen)
    got = ops.hc_weights(mix, base, scale, n, iters, 1e-6)
    for g, w in zip(got, _hc_weights_ref(mix, base, scale, n, iters, 1e-6)):
        assert g.dtype == torch.float32 and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    if iters == 20:   # Sinkhorn converged: the columns sum to 1, the rows nearly
        cols = got[2].sum(-2)
        torch.testing.assert_close(cols, torch.ones_like(cols), rtol=0, atol=1e-4)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_hc_collapse_and_expand_match_the_torch_mixing(out_dtype, gen):
    T, n, D = 5, 4, 96
    h = torch.randn(T, n, D, generator=gen)
    pre, post = torch.rand(T, n, generator=gen), torch.rand(T, n, generator=gen) * 2
    comb = torch.rand(T, n, n, generator=gen)
    out = torch.randn(T, D, generator=gen).to(out_dtype)
    torch.testing.assert_close(ops.hc_collapse(h, pre), (pre[..., None] * h).sum(1),
                               rtol=1e-6, atol=1e-6)
    want = post[..., None] * out.float()[:, None, :] + torch.matmul(comb.transpose(-1, -2), h)
    torch.testing.assert_close(ops.hc_expand(h, out, post, comb), want, rtol=1e-6, atol=1e-5)


def test_hc_ops_refuse_bad_arguments():
    with pytest.raises(RuntimeError, match="mix"):
        ops.hc_weights(torch.randn(2, 23), torch.randn(24), torch.randn(3), 4, 20, 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        ops.hc_collapse(torch.randn(2, 4, 8).double(), torch.rand(2, 4))
    with pytest.raises(RuntimeError, match="comb"):
        ops.hc_expand(torch.randn(2, 4, 8), torch.randn(2, 8), torch.rand(2, 4),
                      torch.rand(2, 3, 3))
