"""The stored KV formats: NVFP4 main KV, MXFP4 indexer keys, FP8 SWA KV (docs/design.md#formats),
and DeepSeek-V4's FP8 main-KV entry (FlashMLA's MODEL1 FP8 sparse layout).

Each function checks its arguments, then runs the dsv41 torch op: the C++ CPU loop for a
CPU tensor, the CUDA kernel for a CUDA tensor. `reference=True` runs the independent
float32 torch reference (`dsv41.formats.reference`) instead; every path gives the same
bits. See include/dsv41/formats.h for the rounding, saturation, zero and NaN rules.

    codes, scales = quantize_nvfp4(x)        # x float32 [..., D], D % 16 == 0
    codes: uint8 [..., D/2]   scales: float8_e4m3fn [..., D/16]
    codes, scales = quantize_mxfp4(x)        # D % 32 == 0
    codes: uint8 [..., D/2]   scales: uint8 UE8M0 exponents [..., D/32]
    values, scales = quantize_fp8_swa(x)     # D % 32 == 0
    values: float8_e4m3fn [..., D]   scales: uint8 UE8M0 exponents [..., D/32]
    entries = quantize_fp8_v4(x, rope_dim=64)       # x float32 [..., 512]
    entries: uint8 [..., 584]   (E4M3 448 | bf16 RoPE 128 | 7 UE8M0 scales | 1 pad)
    x_hat = dequantize_fp8_v4(entries, head_dim=512, rope_dim=64)
"""
from __future__ import annotations

import torch

from .. import profiling
from . import layout, reference
from ._inputs import check_float32_values
from . import reference as _ref  # the parameter `reference` shadows the module name
from .fp8_v4 import dequantize_fp8_v4, fp8_v4_split, quantize_fp8_v4, quantize_fp8_v4_into
from .layout import (FP8_SWA_BLOCK, FP8_V4_AMAX_FLOOR, MXFP4_BLOCK, NVFP4_BLOCK, BlockFormat,
                     Fp8V4Layout, fp8_swa_bytes, fp8_v4_layout, fp8_v4_main_bytes, mxfp4_bytes,
                     nvfp4_bytes)

__all__ = [
    "quantize_nvfp4", "dequantize_nvfp4", "quantize_mxfp4", "dequantize_mxfp4",
    "quantize_fp8_swa", "dequantize_fp8_swa", "quantize_nvfp4_into", "quantize_mxfp4_into",
    "quantize_fp8_swa_into", "quantize_fp8_v4", "quantize_fp8_v4_into", "dequantize_fp8_v4",
    "fp8_v4_split", "nvfp4_bytes", "mxfp4_bytes", "fp8_swa_bytes", "fp8_v4_main_bytes",
    "fp8_v4_layout", "Fp8V4Layout", "layout", "reference", "NVFP4_BLOCK", "MXFP4_BLOCK",
    "FP8_SWA_BLOCK", "FP8_V4_AMAX_FLOOR",
]


class _Format:
    """What the argument checks need to know about one block format (from its layout)."""

    def __init__(self, spec: BlockFormat):
        self.name, self.block, self.values_per_code = spec.name, spec.block, spec.values_per_code
        self.code_dtype = spec.code_dtype
        # UE8M0 scales may also come as torch's float8_e8m0fnu (the same bits).
        self.scale_dtypes = ((torch.uint8, torch.float8_e8m0fnu)
                             if spec.scale_dtype == torch.uint8 else (spec.scale_dtype,))

    def check_input(self, x: torch.Tensor, op: str) -> None:
        check_float32_values(x, op)
        if x.shape[-1] % self.block:
            raise ValueError(f"{op}: last dimension ({x.shape[-1]}) must be a multiple of the "
                             f"{self.block}-value block")

    def check_codes(self, codes: torch.Tensor, scales: torch.Tensor, op: str) -> None:
        for t, what in ((codes, "codes"), (scales, "scales")):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if codes.dtype != self.code_dtype:
            raise TypeError(f"{op}: codes must be {self.code_dtype}, got {codes.dtype}")
        if scales.dtype not in self.scale_dtypes:
            allowed = " or ".join(str(d) for d in self.scale_dtypes)
            raise TypeError(f"{op}: scales must be {allowed}, got {scales.dtype}")
        if codes.dim() < 1 or codes.dim() != scales.dim():
            raise ValueError(f"{op}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} "
                             "must have the same number of dimensions (at least one)")
        if codes.shape[:-1] != scales.shape[:-1]:
            raise ValueError(f"{op}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} "
                             "disagree on the leading dimensions")
        d = codes.shape[-1] * self.values_per_code
        if d % self.block or scales.shape[-1] * self.block != d:
            raise ValueError(f"{op}: codes {tuple(codes.shape)} hold {d} values per row, which "
                             f"needs {d / self.block:g} scales of {self.block}, but scales has "
                             f"{scales.shape[-1]}")
        if codes.device != scales.device:
            raise ValueError(f"{op}: codes on {codes.device} but scales on {scales.device}")

    def check_into(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, op: str) -> None:
        self.check_input(x, op)
        self.check_codes(codes, scales, op)
        want = (*x.shape[:-1], x.shape[-1] // self.values_per_code)
        if tuple(codes.shape) != want:
            raise ValueError(f"{op}: codes has shape {tuple(codes.shape)}, expected {want}")
        if not (codes.is_contiguous() and scales.is_contiguous()):
            raise ValueError(f"{op}: codes and scales must be contiguous (they are written in place)")
        if codes.device != x.device:
            raise ValueError(f"{op}: x on {x.device} but codes on {codes.device}")


_NVFP4 = _Format(layout.NVFP4)
_MXFP4 = _Format(layout.MXFP4)
_FP8_SWA = _Format(layout.FP8_SWA)


def _ops():
    from .._ext import _C  # noqa: F401  (loading the extension registers torch.ops.dsv41)
    return torch.ops.dsv41


@profiling.op("op.quantize_nvfp4")
def quantize_nvfp4(x: torch.Tensor, *, reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4: E2M1 codes (two per byte) and one E4M3 scale per 16 values."""
    _NVFP4.check_input(x, "quantize_nvfp4")
    if reference:
        return _ref.quantize_nvfp4(x)
    return _ops().quantize_nvfp4(x)


@profiling.op("op.dequantize_nvfp4")
def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor, *, reference: bool = False) -> torch.Tensor:
    _NVFP4.check_codes(codes, scales, "dequantize_nvfp4")
    if reference:
        return _ref.dequantize_nvfp4(codes, scales)
    return _ops().dequantize_nvfp4(codes, scales)


@profiling.op("op.quantize_mxfp4")
def quantize_mxfp4(x: torch.Tensor, *, reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4: E2M1 codes (two per byte) and one UE8M0 power-of-two scale per 32 values."""
    _MXFP4.check_input(x, "quantize_mxfp4")
    if reference:
        return _ref.quantize_mxfp4(x)
    return _ops().quantize_mxfp4(x)


@profiling.op("op.dequantize_mxfp4")
def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, *, reference: bool = False) -> torch.Tensor:
    _MXFP4.check_codes(codes, scales, "dequantize_mxfp4")
    scales = scales.view(torch.uint8)
    if reference:
        return _ref.dequantize_mxfp4(codes, scales)
    return _ops().dequantize_mxfp4(codes, scales)


@profiling.op("op.quantize_fp8_swa")
def quantize_fp8_swa(x: torch.Tensor, *, reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 SWA: E4M3 values and one UE8M0 power-of-two scale per 32 values."""
    _FP8_SWA.check_input(x, "quantize_fp8_swa")
    if reference:
        return _ref.quantize_fp8_swa(x)
    return _ops().quantize_fp8_swa(x)


@profiling.op("op.dequantize_fp8_swa")
def dequantize_fp8_swa(values: torch.Tensor, scales: torch.Tensor, *, reference: bool = False) -> torch.Tensor:
    _FP8_SWA.check_codes(values, scales, "dequantize_fp8_swa")
    scales = scales.view(torch.uint8)
    if reference:
        return _ref.dequantize_fp8_swa(values, scales)
    return _ops().dequantize_fp8_swa(values, scales)


@profiling.op("op.quantize_nvfp4_into")
def quantize_nvfp4_into(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize into caller-owned buffers (e.g. a slot of a KV cache)."""
    _NVFP4.check_into(x, codes, scales, "quantize_nvfp4_into")
    _ops().quantize_nvfp4_into(x, codes, scales)


@profiling.op("op.quantize_mxfp4_into")
def quantize_mxfp4_into(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    _MXFP4.check_into(x, codes, scales, "quantize_mxfp4_into")
    _ops().quantize_mxfp4_into(x, codes, scales.view(torch.uint8))


@profiling.op("op.quantize_fp8_swa_into")
def quantize_fp8_swa_into(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    _FP8_SWA.check_into(x, values, scales, "quantize_fp8_swa_into")
    _ops().quantize_fp8_swa_into(x, values, scales.view(torch.uint8))
