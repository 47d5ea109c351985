"""mHC: manifold-constrained hyper-connections (DeepSeek-V4; transformers'
DeepseekV4HyperConnection / DeepseekV4HyperHead).

The residual is hc_mult streams h [T, n, hidden]. Around each attention and MoE block, a
one-layer perceptron over the RMS-normalized flattened streams gives (with its `fn`
[(2+n)n, n*hidden], `base` [(2+n)n] and `scale` [3]):
  pre  = sigmoid(w_pre * scale0 + b_pre) + hc_eps            [T, n]
  post = 2 * sigmoid(w_post * scale1 + b_post)                [T, n]
  comb = softmax(w_comb * scale2 + b_comb, rows) + hc_eps     [T, n, n], then
         column-normalized and hc_sinkhorn_iters - 1 Sinkhorn (row, column) iterations
The block reads x = sum_j pre_j h_j and the streams become h' = post * f(norm(x)) + comb^T h.
The final collapse before `norm` and `head` uses `hc_head` (pre only, no eps on the
sigmoid's input side). Computed in float64, rounded to float32 once per output; on the
production path in float32, on the CPU as the dsv41::hc_* ops (ops/layer.py: one op where
the torch expressions below take ~150 per site, mostly the Sinkhorn iterations).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import cpu_shortcuts, ops
from .layers import as_f64, rms_normalize
from .gemm import is_production

__all__ = ["HyperConnection", "add_site", "hc_head"]


def add_site(owner: nn.Module, prefix: str, n: int, width: int, hidden: int) -> None:
    """Register `{prefix}_fn` [width, n*hidden], `{prefix}_base` [width] and
    `{prefix}_scale` on owner (DeepSeek's checkpoint names, e.g. layers.3.hc_attn_fn)."""
    for name, shape in (("fn", (width, n * hidden)), ("base", (width,)),
                        ("scale", (3 if width != n else 1,))):
        owner.register_parameter(f"{prefix}_{name}",
                                 nn.Parameter(torch.empty(shape), requires_grad=False))


class HyperConnection:
    """One mHC site around a block, reading its owner's `{prefix}_*` parameters."""

    def __init__(self, owner: nn.Module, prefix: str, *, n: int, iters: int, eps: float,
                 norm_eps: float):
        self.owner, self.prefix = owner, prefix
        self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps

    def _p(self, name: str) -> torch.Tensor:
        p = getattr(self.owner, f"{self.prefix}_{name}")
        return p.float() if is_production(self.owner) else as_f64(p)

    def weights(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, n, hidden] f32 -> pre [T, n], post [T, n], comb [T, n, n] (float64; float32
        on the production path)."""
        n, T = self.n, h.shape[0]
        if is_production(self.owner) and h.device.type == "cpu" and cpu_shortcuts.enabled():
            flat = ops.rms_norm(h.reshape(T, -1), None, self.norm_eps)
            return ops.hc_weights(flat @ self._p("fn").T, self._p("base"), self._p("scale"),
                                  n, self.iters, self.eps)
        if is_production(self.owner):
            x = h.reshape(T, -1).float()
            flat = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)
        else:
            flat = rms_normalize(h.reshape(T, -1).double(), self.norm_eps)
        mix = flat @ self._p("fn").T
        base, scale = self._p("base"), self._p("scale")
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + self.eps
        post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = mix[:, 2 * n:].view(T, n, n) * scale[2] + base[2 * n:].view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        if is_production(self.owner):   # the same iterations in place (fewer allocations)
            for _ in range(self.iters - 1):
                comb.div_(comb.sum(-1, keepdim=True).add_(self.eps))
                comb.div_(comb.sum(-2, keepdim=True).add_(self.eps))
            return pre, post, comb
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        return pre, post, comb

    @staticmethod
    def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """sum_j pre_j h_j: [T, hidden] f32 (pre's dtype is the math's)."""
        if pre.dtype == torch.float32 and h.dtype == torch.float32 and h.device.type == "cpu" \
                and cpu_shortcuts.enabled():
            return ops.hc_collapse(h, pre)
        return (pre[..., None] * h.to(pre.dtype)).sum(1).float()

    @staticmethod
    def expand(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
               comb: torch.Tensor) -> torch.Tensor:
        """h' = post * out + comb^T h: [T, n, hidden] f32."""
        if comb.dtype == torch.float32 and h.dtype == torch.float32 and h.device.type == "cpu" \
                and cpu_shortcuts.enabled():
            return ops.hc_expand(h, out, post, comb)
        dt = comb.dtype
        mixed = torch.matmul(comb.transpose(-1, -2), h.to(dt))
        return (post[..., None] * out.to(dt)[:, None, :] + mixed).float()


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            eps: float, norm_eps: float, *, fp32: bool = False) -> torch.Tensor:
    """The final collapse: sum_j (sigmoid(w_j * scale + b_j) + eps) h_j -> [T, hidden]."""
    if fp32:  # the production path
        x = h.reshape(h.shape[0], -1).float()
        flat = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
        pre = torch.sigmoid(flat @ fn.float().T * scale.float() + base.float()) + eps
        return (pre[..., None] * h.float()).sum(1)
    flat = rms_normalize(h.reshape(h.shape[0], -1).double(), norm_eps)
    mix = flat @ as_f64(fn).T
    pre = torch.sigmoid(mix * as_f64(scale) + as_f64(base)) + eps
    return (pre[..., None] * h.double()).sum(1).float()
