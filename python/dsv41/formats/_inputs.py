"""The input check every codec's quantize shares: float32 values with a last dimension."""
from __future__ import annotations

import torch


def check_float32_values(x, op: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{op}: x must be float32, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dimension")
