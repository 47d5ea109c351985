"""Deterministic synthetic weights, scaled so activations stay realistic through depth.

Each parameter draws from its own torch.Generator seeded by (seed, parameter name), so a
weight does not depend on the order or presence of other parameters.

Scales: matrices N(0, 1/fan_in) (a projection keeps the RMS of its input); the residual
branch outputs (`attn.wo_b`, every expert's `w2`) are further scaled by 1/sqrt(2 L), so
that the 2 L branch contributions add up to about the embedding's RMS and the hidden
state's RMS stays between ~1 and ~2 through all L layers (checked by tests/model).
Embedding N(0, 1); norm weights 1 + N(0, 0.05^2); attention sinks N(0, 0.5^2); gate bias
N(0, 0.02^2); mHC scales 1 + N(0, 0.1^2); hash tables: k distinct random experts per id.
"""
from __future__ import annotations

import math
import zlib

import torch
from torch import nn

__all__ = ["init_synthetic", "parameter_seed"]

_NORMS = ("norm.weight",)  # suffix of every RMSNorm weight (attn_norm, q_norm, k_norm, ...)


def parameter_seed(seed: int, name: str) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)


def _std(name: str, shape: torch.Size, num_layers: int) -> tuple[float, float]:
    """(mean, std) of the parameter's normal distribution."""
    if name == "embed.weight":
        return 0.0, 1.0
    if name.endswith("attn_sink"):
        return 0.0, 0.5
    if name.endswith("gate.bias"):
        return 0.0, 0.02
    if name.endswith(_NORMS):
        return 1.0, 0.05
    if name.endswith("_scale") and name.split(".")[-1].startswith("hc_"):
        return 1.0, 0.1  # mHC scales: around transformers' initial 1
    std = 1.0 / math.sqrt(shape[-1])
    if name.endswith(("attn.wo_b.weight", ".w2.weight")):
        std /= math.sqrt(2 * num_layers)
    return 0.0, std


@torch.no_grad()
def init_synthetic(model: nn.Module, seed: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    n_layers = model.config.num_layers
    for name, p in model.named_parameters():
        if p.is_meta:
            raise RuntimeError("init_synthetic: parameters are on the meta device; use "
                               "Model.synthetic(config, seed, device=...)")
        mean, std = _std(name, p.shape, n_layers)
        g = torch.Generator().manual_seed(parameter_seed(seed, name))
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std + mean)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):  # hash routing: k distinct experts per token id
            g = torch.Generator().manual_seed(parameter_seed(seed, name))
            n_experts = model.config.n_routed_experts
            order = torch.rand(b.shape[0], n_experts, generator=g).argsort(-1)
            b.copy_(order[:, :b.shape[1]])
