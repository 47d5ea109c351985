"""Rotary position embedding on the last `rope_head_dim` dims, with YaRN.

Two regimes (docs/design.md#model): SWA-only layers use `rope_theta` without scaling; every
compressing layer (ratio 1 or 2: its queries, SWA keys, global entries and indexer
queries/keys) uses `compress_rope_theta` with YaRN when `rope_scaling` is set.

Pairs are interleaved (dims 2i and 2i+1 of the RoPE part rotate together), as in the
DeepSeek-V3/V4 main attention. Angles are computed in float64 from integer positions, so a
position's rotation never depends on which other positions are in the call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import ModelConfig

__all__ = ["Rope", "yarn_frequencies"]


def yarn_frequencies(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [dim/2] (float64). With YaRN (factor s, original length L,
    betas): dims rotating fewer than beta_slow times over L are divided by s, dims rotating
    more than beta_fast times are kept, with a linear ramp between."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
    if scaling is None:
        return freqs
    factor = scaling["factor"]
    orig = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(scaling["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp
    return freqs / factor * (1 - keep) + freqs * keep


@dataclass(frozen=True)
class Rope:
    dim: int
    freqs: torch.Tensor  # float64 [dim/2]

    @classmethod
    def for_layer(cls, config: ModelConfig, compress_ratio: int) -> Rope:
        if compress_ratio:
            freqs = yarn_frequencies(config.rope_head_dim, config.compress_rope_theta,
                                     config.rope_scaling)
        else:
            freqs = yarn_frequencies(config.rope_head_dim, config.rope_theta, None)
        return cls(config.rope_head_dim, freqs)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False,
               fp32: bool = False) -> torch.Tensor:
        """Rotate the last `dim` dims of x [T, ..., D] (float32) at positions [T]; returns
        float32. inverse=True rotates by the negative angle (undoes a rotation at the same
        position). fp32=True (the production path) rotates in float32 (the angles are
        still float64, so large positions keep their phase); the reference rotates in
        float64 and rounds once."""
        angles = positions.to(torch.float64)[:, None] * self.freqs.to(x.device)[None, :]
        if inverse:
            angles = -angles
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.dim // 2,)
        if fp32:   # (a + ib) * e^(i angle) in complex64 on a copy: the same products, few ops
            out = x.float().clone()
            pairs = torch.view_as_complex(out[..., -self.dim:].unflatten(-1, (-1, 2)))
            pairs.mul_(torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
                       .view(shape))
            return out
        cos, sin = torch.cos(angles).view(shape), torch.sin(angles).view(shape)
        tail = x[..., -self.dim:].double()
        a, b = tail[..., 0::2], tail[..., 1::2]
        rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
        return torch.cat((x[..., :-self.dim], rotated.float()), -1)
