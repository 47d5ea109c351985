"""DeepSeek-V4's FP8 main-KV entry (FlashMLA's MODEL1 FP8 sparse layout), one packed
uint8 record per entry. Byte layout: `layout.Fp8V4Layout`; rules: include/dsv41/formats.h.

    entries = quantize_fp8_v4(x, rope_dim=64)        # x float32 [..., 512] -> uint8 [..., 584]
    quantize_fp8_v4_into(x, entries, rope_dim=64)   # into a caller-owned (cache) buffer
    y = dequantize_fp8_v4(entries, head_dim=512, rope_dim=64)    # float32 [..., 512]
    values, rope, scales = fp8_v4_split(entries, head_dim=512, rope_dim=64)   # views

`x` holds the no-RoPE dims first and the `rope_dim` RoPE dims last (DeepSeek's order).
CPU tensors run the C++ op, CUDA tensors the kernel; `reference=True` runs the float32
torch reference. `amax_floor` is the scale rule's floor on a tile's amax (DeepSeek-V4's
1e-4 by default; 0 removes it).
"""
from __future__ import annotations

import torch

from . import reference as _ref
from ._inputs import check_float32_values
from .layout import FP8_V4_AMAX_FLOOR, Fp8V4Layout

__all__ = ["quantize_fp8_v4", "quantize_fp8_v4_into", "dequantize_fp8_v4", "fp8_v4_split"]


def _ops():
    from .._ext import _C  # noqa: F401  (loading the extension registers torch.ops.dsv41)
    return torch.ops.dsv41


def _layout(head_dim, rope_dim, op: str) -> Fp8V4Layout:
    try:
        return Fp8V4Layout(head_dim, rope_dim)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None


def _check_floor(amax_floor, op: str) -> float:
    if isinstance(amax_floor, bool) or not isinstance(amax_floor, (int, float)):
        raise TypeError(f"{op}: amax_floor must be a number, got {type(amax_floor).__name__}")
    f = float(amax_floor)
    if not (f >= 0 and f != float("inf")):
        raise ValueError(f"{op}: amax_floor must be finite and >= 0, got {amax_floor}")
    return f


def _check_x(x, rope_dim, op: str) -> Fp8V4Layout:
    check_float32_values(x, op)
    return _layout(x.shape[-1], rope_dim, op)


def _check_entries(entries, lay: Fp8V4Layout, op: str) -> None:
    if not isinstance(entries, torch.Tensor):
        raise TypeError(f"{op}: entries must be a torch.Tensor, got {type(entries).__name__}")
    if entries.dtype != torch.uint8:
        raise TypeError(f"{op}: entries must be uint8, got {entries.dtype}")
    if entries.dim() < 1 or entries.shape[-1] != lay.entry_bytes:
        raise ValueError(f"{op}: entries {tuple(entries.shape)} must have a last dimension of "
                         f"{lay.entry_bytes} bytes (head_dim {lay.head_dim}, rope_dim "
                         f"{lay.rope_dim})")


def quantize_fp8_v4(x: torch.Tensor, *, rope_dim: int, amax_floor: float = FP8_V4_AMAX_FLOOR,
                    reference: bool = False) -> torch.Tensor:
    """float32 [..., head_dim] -> uint8 entries [..., entry_bytes]."""
    op = "quantize_fp8_v4"
    _check_x(x, rope_dim, op)
    floor = _check_floor(amax_floor, op)
    if reference:
        return _ref.quantize_fp8_v4(x, rope_dim, floor)
    return _ops().quantize_fp8_v4(x, rope_dim, floor)


def quantize_fp8_v4_into(x: torch.Tensor, entries: torch.Tensor, *, rope_dim: int,
                         amax_floor: float = FP8_V4_AMAX_FLOOR) -> None:
    """Quantize into caller-owned entries [..., entry_bytes] (e.g. rows of a KV cache):
    contiguous, uint8, on x's device, with x's leading shape."""
    op = "quantize_fp8_v4_into"
    lay = _check_x(x, rope_dim, op)
    floor = _check_floor(amax_floor, op)
    _check_entries(entries, lay, op)
    want = (*x.shape[:-1], lay.entry_bytes)
    if tuple(entries.shape) != want:
        raise ValueError(f"{op}: entries has shape {tuple(entries.shape)}, expected {want}")
    if not entries.is_contiguous():
        raise ValueError(f"{op}: entries must be contiguous (they are written in place)")
    if entries.device != x.device:
        raise ValueError(f"{op}: x on {x.device} but entries on {entries.device}")
    _ops().quantize_fp8_v4_into(x, rope_dim, floor, entries)


def dequantize_fp8_v4(entries: torch.Tensor, *, head_dim: int, rope_dim: int,
                      reference: bool = False) -> torch.Tensor:
    """uint8 entries [..., entry_bytes] -> float32 [..., head_dim]."""
    op = "dequantize_fp8_v4"
    lay = _layout(head_dim, rope_dim, op)
    _check_entries(entries, lay, op)
    if reference:
        return _ref.dequantize_fp8_v4(entries, head_dim, rope_dim)
    return _ops().dequantize_fp8_v4(entries, head_dim, rope_dim)


def fp8_v4_split(entries: torch.Tensor, *, head_dim: int, rope_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the parts of entries [..., entry_bytes]: E4M3 values [..., nope]
    (float8_e4m3fn), RoPE dims [..., rope] (bfloat16) and UE8M0 scales [..., nope/64]
    (uint8). No copy; the pad byte(s) are left out."""
    lay = _layout(head_dim, rope_dim, "fp8_v4_split")
    _check_entries(entries, lay, "fp8_v4_split")
    if entries.stride(-1) != 1:
        raise ValueError("fp8_v4_split: entries must be contiguous in the last dimension")
    values = entries[..., :lay.rope_offset].view(torch.float8_e4m3fn)
    rope = entries[..., lay.rope_offset:lay.scale_offset].view(torch.bfloat16)
    scales = entries[..., lay.scale_offset:lay.pad_offset]
    return values, rope, scales
