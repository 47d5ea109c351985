"""Basic layers: Linear, RMSNorm, Embedding, with batch-invariant float32 outputs.

Every layer takes and returns float32 but computes in float64 and rounds once: BLAS
chooses different kernels (and summation orders) for different numbers of rows, so a
float32 matmul of one token differs in the last bit from the same token inside a batch,
and a one-bit difference can flip a stored FP4 code. The float64 differences are ~1e-16
relative and survive the rounding to float32 only with probability ~2^-29 per value
(measured: 0 of 512,000 values across row counts 1..100). docs/model.md, "Determinism".

Weights are float32 parameters (what checkpoints hold); their float64 copies are cached
per parameter and refreshed when the parameter changes (its version counter or storage).
A Linear whose weight is stored bf16/FP8/FP4 and modules flagged by
`production.to_production` run the production path instead (production.py).
"""
from __future__ import annotations

import torch
from torch import nn

from . import gemm

__all__ = ["Embedding", "Linear", "RMSNorm", "as_f64", "rms_normalize"]


def as_f64(param: torch.Tensor) -> torch.Tensor:
    """The float64 copy of a parameter, cached on the parameter object."""
    key = (param._version, param.data_ptr(), param.device)
    cached = getattr(param, "_dsv41_f64", None)
    if cached is None or cached[0] != key:
        cached = (key, param.detach().double())
        param._dsv41_f64 = cached  # type: ignore[attr-defined]
    return cached[1]


class Linear(nn.Module):
    """y = x W^T without bias; `weight` is [out_features, in_features] as in nn.Linear."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x W^T, float32 (production storage: bf16 with dtype=torch.bfloat16, for a
        consumer that reads bf16 anyway - the next GEMM or a norm - saving a round trip;
        the reference always returns float32)."""
        if self.weight.dtype != torch.float32:  # production storage (production.py)
            return gemm.linear(x, self).to(dtype or torch.float32)
        return self.forward_f64(x).float()

    def forward_f64(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype != torch.float32:
            return gemm.linear(x, self).double()
        return torch.matmul(x.double(), as_f64(self.weight).T)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}"


def rms_normalize(x64: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim (float64 in, float64 out)."""
    return x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Float32 out (production: bf16 with dtype=torch.bfloat16, for a GEMM to read)."""
        if gemm.is_production(self):
            return gemm.rms_norm(x, self.weight, self.eps, dtype)
        return (rms_normalize(x.double(), self.eps) * as_f64(self.weight)).float()

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(0, tokens).float()  # bf16 tables in production
