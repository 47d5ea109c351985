"""Per-row layer math as single ops (csrc/bindings/layer_ops.cpp), for the production path.

    y = rms_norm(x, weight, eps)          # x / sqrt(mean(x^2) + eps) * weight
    y = rope(x, cos, sin, inverse=False)  # interleaved rotation of each head's last dims
    pre, post, comb = hc_weights(mix, base, scale, n, iters, eps)   # mHC site weights (CPU)
    x = hc_collapse(h, pre)                 # sum_j pre_j h_j (CPU)
    y = hc_expand(h, out, post, comb)       # post * out + comb^T h (CPU)

A decode step calls these about eight times per layer; written as torch expressions they
are 6 (RMSNorm) and 14 (RoPE with its angles) launches each. On the CPU each is one C++ loop
(the sum of squares in double); on CUDA rms_norm is ATen's fused RMSNorm and rope one copy
and one complex multiply (plus a cast for a bf16 result). x may be float32 or bfloat16;
the result is float32, or bfloat16 with dtype=torch.bfloat16 (the float32 result rounded
to nearest even: what the next bf16 GEMM would have rounded it to).

rope's (cos, sin) [R, pairs] are the rotation of each row of x [R, ..., D] (`Rope.table`
computes them in float64 from positions and rounds them once): value pairs (2i, 2i + 1) of
the last 2 * pairs dims of every head turn by angle i; the first D - 2 * pairs are copied.

The hc_* ops (CPU only, float32) are mHC's per-site math (model/mhc.py has the torch
expressions they replace): one mHC site is ~150 tiny torch ops, mostly its Sinkhorn
iterations over an n x n matrix, which dominate a CPU decode step; GPUs keep the torch
expressions.
"""
from __future__ import annotations

import torch

from .._ext import _C  # noqa: F401  (registers the ops)

__all__ = ["hc_collapse", "hc_expand", "hc_weights", "rms_norm", "rope"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.ops.dsv41.rms_norm(x, weight, float(eps), dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.ops.dsv41.rope(x, cos, sin, bool(inverse), dtype)


def hc_weights(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix [T, (2+n)n] float32 (the site's normalized streams times its fn) -> pre [T, n],
    post [T, n], comb [T, n, n] (mhc.HyperConnection.weights' production math)."""
    return torch.ops.dsv41.hc_weights(mix, base, scale, int(n), int(iters), float(eps))


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """h [T, n, hidden], pre [T, n] float32 -> sum_j pre_j h_j [T, hidden] float32."""
    return torch.ops.dsv41.hc_collapse(h, pre)


def hc_expand(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
    """h [T, n, hidden], out [T, hidden] (float32 or bf16), post [T, n], comb [T, n, n] ->
    post * out + comb^T h [T, n, hidden] float32."""
    return torch.ops.dsv41.hc_expand(h, out, post, comb)


@torch.library.register_fake("dsv41::hc_weights")
def _(mix, base, scale, n, iters, eps):
    T = mix.shape[0]
    return mix.new_empty(T, n), mix.new_empty(T, n), mix.new_empty(T, n, n)


@torch.library.register_fake("dsv41::hc_collapse")
def _(h, pre):
    return h.new_empty(h.shape[0], h.shape[2])


@torch.library.register_fake("dsv41::hc_expand")
def _(h, out, post, comb):
    return h.new_empty(h.shape)


@torch.library.register_fake("dsv41::rms_norm")
def _(x, weight, eps, dtype=None):
    return x.new_empty(x.shape, dtype=dtype or torch.float32)


@torch.library.register_fake("dsv41::rope")
def _(x, cos, sin, inverse, dtype=None):
    return x.new_empty(x.shape, dtype=dtype or torch.float32)
