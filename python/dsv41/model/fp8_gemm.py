"""Block-scaled FP8 GEMMs for the production path (production.linear).

DeepSeek ships dense weights as FP8 E4M3 with one float32 scale per 128x128 block. On a
Hopper GPU (sm_90) torch's scaled matmul runs DeepSeek's recipe directly: activations
quantized to FP8 per 1x128 block (one scale per token and 128 inputs), weights per 128x128
block, products accumulated in float32 by cuBLASLt (>= 12.9), bf16 out. Everywhere else the
weight is dequantized tile by tile to bf16 (production.linear's own path).

`fp8_gemm_path` decides, from facts it is given, which path a weight takes and says why;
`fp8_path_for` gathers those facts from torch and the device. What the CUDA call needs in a
different layout (the weight scales: transposed, rows padded to 16 bytes) is converted once
per weight and cached on its module, never per call. `scaled_mm_emulated` is the CPU
emulation of the CUDA product (dequantize both operands, multiply in float32) that the tests
hold against the dequant path.

The CUDA path has never run here (no GPU was lent while it was written): its arguments are
checked against torch 2.14.1's own shape rules (torch/_meta_registrations.py,
_check_scaled_mm_sizes, and the messages in libtorch_cuda), and a failing first call
switches that weight back to the dequant path with a warning that carries torch's error.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

__all__ = ["BLOCK", "FP8_MAX", "GemmPath", "scale_f32", "act_scales_layout", "fp8_gemm_path", "fp8_path_for",
           "quantize_act_1x128", "scaled_linear", "scaled_mm_emulated", "weight_scales_layout"]

BLOCK = 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max   # 448
ROW_ALIGN = 16       # activation rows are padded to this (cuBLASLt alignment, scale strides)
_CACHE = "_dsv41_fp8_gemm"


class GemmPath(tuple):
    """(path, reason): path is "scaled_mm" (torch's block-scaled FP8 GEMM) or "dequant"."""

    def __new__(cls, path: str, reason: str):
        return super().__new__(cls, (path, reason))

    path = property(lambda self: self[0])
    reason = property(lambda self: self[1])


def fp8_gemm_path(*, device_type: str, capability: tuple[int, int] | None,
                  has_blockwise_scaled_mm: bool, cuda_version: tuple[int, int] | None,
                  block: tuple[int, int], in_features: int, out_features: int) -> GemmPath:
    """Which path an FP8 weight [out_features, in_features] with `block` scales takes, from
    explicit facts (pure: the CPU tests drive every branch)."""
    if tuple(block) != (BLOCK, BLOCK):
        return GemmPath("dequant", f"weight blocks {tuple(block)}: torch's block-scaled GEMM "
                                   f"takes 128x128 weight blocks only")
    if device_type != "cuda":
        return GemmPath("dequant", f"device {device_type}: the block-scaled FP8 GEMM is a "
                                   f"CUDA (sm_90) kernel; dequantized tile by tile to bf16")
    if not has_blockwise_scaled_mm:
        return GemmPath("dequant", "this torch has no torch.nn.functional.scaled_mm with "
                                   "ScalingType.BlockWise1x128/BlockWise128x128")
    if capability != (9, 0):
        cap = "unknown" if capability is None else f"sm_{capability[0]}{capability[1]}"
        return GemmPath("dequant", f"GPU {cap}: torch runs DeepSeek-style (1x128, 128x128) "
                                   f"scaling only on sm_90")
    if cuda_version is None or cuda_version < (12, 9):
        return GemmPath("dequant", f"CUDA {cuda_version}: DeepSeek-style scaling needs "
                                   f"cuBLASLt >= 12.9")
    if in_features % BLOCK or out_features % 16:
        return GemmPath("dequant", f"shape [{out_features}, {in_features}]: needs in_features "
                                   f"% 128 == 0 (whole activation blocks) and out_features "
                                   f"% 16 == 0")
    return GemmPath("scaled_mm", "CUDA sm_90, torch BlockWise1x128 x BlockWise128x128 "
                                 "scaled_mm (cuBLASLt >= 12.9)")


def _torch_facts(device: torch.device) -> dict:
    has = (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
           and hasattr(F.ScalingType, "BlockWise1x128")
           and hasattr(F.ScalingType, "BlockWise128x128"))
    cap = None
    if device.type == "cuda" and torch.cuda.is_available():
        cap = tuple(torch.cuda.get_device_capability(device))
    cuda = None
    if torch.version.cuda:
        cuda = tuple(int(p) for p in torch.version.cuda.split(".")[:2])
    return {"device_type": device.type, "capability": cap, "has_blockwise_scaled_mm": has,
            "cuda_version": cuda}


def fp8_path_for(lin: torch.nn.Module) -> GemmPath:
    """The path of a production Linear holding an FP8 weight, from this torch and device."""
    w = lin.weight
    return fp8_gemm_path(**_torch_facts(w.device), block=getattr(lin, "weight_block", (0, 0)),
                         in_features=w.shape[1], out_features=w.shape[0])


# ---- layouts -----------------------------------------------------------------------------

def weight_scales_layout(scale: torch.Tensor) -> torch.Tensor:
    """Stored 128x128 weight scales [ceil(out/128), ceil(in/128)] float32 -> what scaled_mm
    takes as scale_b for mat_b = weight.t(): shape [ceil(in/128), ceil(out/128)], a
    transposed view of a row-major tensor whose rows are padded to a multiple of 4 floats
    ("near-inner-dim-major, 16-byte aligned strides" in torch's message)."""
    nb, kb = scale.shape
    padded = torch.zeros(nb, math.ceil(kb / 4) * 4, dtype=torch.float32, device=scale.device)
    padded[:, :kb] = scale.float()
    return padded[:, :kb].t()


def act_scales_layout(scale: torch.Tensor) -> torch.Tensor:
    """Per-1x128-block activation scales [M, K/128] (M a multiple of 4) -> scale_a:
    the same values outer-dim-major (stride(0) == 1, stride(1) == M)."""
    return scale.t().contiguous().t()


def quantize_act_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (float8_e4m3fn codes [M, K], float32 decode scales
    [M, K/128]) with x ~= codes * scale of its 1x128 block; all-zero blocks get scale 1."""
    M, K = x.shape
    blocks = x.float().view(M, K // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(M, K), scale


def scaled_mm_emulated(codes: torch.Tensor, act_scale: torch.Tensor, w_codes: torch.Tensor,
                       w_scale: torch.Tensor) -> torch.Tensor:
    """What the CUDA GEMM computes, on any device: both operands dequantized to float32
    (activation 1x128 blocks, weight 128x128 blocks), one float32 product, bf16 out.
    codes [M, K], act_scale [M, K/128], w_codes [N, K], w_scale [ceil(N/128), ceil(K/128)]."""
    M, K = codes.shape
    N = w_codes.shape[0]
    a = codes.float() * act_scale.float().repeat_interleave(BLOCK, 1)[:, :K]
    s = w_scale.float().repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return (a @ (w_codes.float() * s).T).to(torch.bfloat16)


def scale_f32(scale: torch.Tensor) -> torch.Tensor:
    """float32 values of stored scales: float, float8_e8m0fnu, or UE8M0 exponent bytes."""
    if scale.dtype == torch.uint8:
        return torch.ldexp(torch.ones(scale.shape, device=scale.device),
                           scale.to(torch.int32) - 127)
    return scale.float()


# ---- the CUDA call -----------------------------------------------------------------------

def _prepared(lin: torch.nn.Module):
    """(path, scale_b) for this weight, computed once and cached on the module (again only
    if the weight or its scales move or change)."""
    key = (lin.weight.data_ptr(), lin.weight.device, lin.weight_scale.data_ptr(),
           lin.weight_scale._version)
    cached = getattr(lin, _CACHE, None)
    if cached is None or cached[0] != key:
        path = fp8_path_for(lin)
        scale_b = None
        if path.path == "scaled_mm":
            scale_b = weight_scales_layout(scale_f32(lin.weight_scale))
        cached = (key, path, scale_b)
        object.__setattr__(lin, _CACHE, cached)
    return cached


def scaled_linear(x: torch.Tensor, lin: torch.nn.Module) -> torch.Tensor | None:
    """x [.., in] bf16 -> x W^T [.., out] bf16 through torch's block-scaled FP8 GEMM, or None
    when this weight takes the dequant path (fp8_path_for says why)."""
    key, path, scale_b = _prepared(lin)
    if path.path != "scaled_mm":
        return None
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    Mp = max(ROW_ALIGN, -(-M // ROW_ALIGN) * ROW_ALIGN)
    if Mp != M:
        x2 = torch.cat((x2, x2.new_zeros(Mp - M, K)))
    codes, scale = quantize_act_1x128(x2)
    try:
        out = F.scaled_mm(codes, lin.weight.t(), act_scales_layout(scale),
                          F.ScalingType.BlockWise1x128, scale_b,
                          F.ScalingType.BlockWise128x128,
                          swizzle_a=F.SwizzleType.NO_SWIZZLE,
                          swizzle_b=F.SwizzleType.NO_SWIZZLE, output_dtype=torch.bfloat16)
    except RuntimeError as e:   # never run on a GPU here: fall back loudly, once per weight
        warnings.warn(f"block-scaled FP8 GEMM failed for a [{lin.out_features}, "
                      f"{lin.in_features}] weight ({e}); using the dequant path for it",
                      RuntimeWarning, stacklevel=3)
        object.__setattr__(lin, _CACHE, (key, GemmPath("dequant", f"scaled_mm raised: {e}"),
                                         None))
        return None
    return out[:M].reshape(*lead, -1)
