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

from .. import ops
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


_SHARED: dict[tuple, Rope] = {}


@dataclass(frozen=True)
class Rope:
    dim: int
    freqs: torch.Tensor  # float64 [dim/2]

    @classmethod
    def for_layer(cls, config: ModelConfig, compress_ratio: int) -> Rope:
        """The layer's rotation; layers with the same one share the object (and so its
        last table, `table`)."""
        if compress_ratio:
            args = (config.rope_head_dim, config.compress_rope_theta, config.rope_scaling)
        else:
            args = (config.rope_head_dim, config.rope_theta, None)
        key = (args[0], args[1], repr(args[2]))
        rope = _SHARED.get(key)
        if rope is None:
            rope = _SHARED[key] = cls(args[0], yarn_frequencies(*args))
        return rope

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, dim/2] float32 of positions [T]: the angles in float64 (so large
        positions keep their phase), rounded once. A step computes them once per set of
        positions and hands them to every layer that shares this rotation; eagerly, the
        last table is also kept for the very `positions` tensor it was made from (a
        per-sequence forward rotates at ctx.positions several times a layer)."""
        # only on the CPU: a CUDA graph captured after a warm-up step must record the
        # table's computation, never reuse the table the warm-up made (its replays would
        # rotate every later step by the warm-up's positions)
        eager = positions.device.type == "cpu" and not torch.compiler.is_compiling()
        if eager:
            last = self.__dict__.get("_last")
            if last is not None and last[0] is positions and last[1] == positions._version:
                return last[2]
        angles = positions.to(torch.float64)[:, None] * self.freqs.to(positions.device)[None, :]
        out = torch.cos(angles).float(), torch.sin(angles).float()
        if eager:
            object.__setattr__(self, "_last", (positions, positions._version, out))
        return out

    def rotate(self, x: torch.Tensor, positions: torch.Tensor | None, *, inverse: bool = False,
               fp32: bool = False, table: tuple[torch.Tensor, torch.Tensor] | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rotate the last `dim` dims of x [T, ..., D] (float32) at positions [T]; returns
        float32. inverse=True rotates by the negative angle (undoes a rotation at the same
        position). fp32=True (the production path) rotates in float32 with the float32
        (cos, sin) of `table` (default: computed from positions), one dsv41::rope op, and
        returns bf16 with dtype=torch.bfloat16; the reference rotates in float64 and
        rounds once."""
        if fp32:
            cos, sin = self.table(positions) if table is None else table
            return ops.rope(x, cos, sin, inverse, dtype)
        angles = positions.to(torch.float64)[:, None] * self.freqs.to(x.device)[None, :]
        if inverse:
            angles = -angles
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.dim // 2,)
        cos, sin = torch.cos(angles).view(shape), torch.sin(angles).view(shape)
        tail = x[..., -self.dim:].double()
        a, b = tail[..., 0::2], tail[..., 1::2]
        rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
        return torch.cat((x[..., :-self.dim], rotated.float()), -1)
