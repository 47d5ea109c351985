"""The production path's per-row math that every layer calls: a Linear's GEMM with its
weight as stored (bf16, FP8 with block scales, packed FP4 dequantized tile by tile), the
float32 RMSNorm, and cached transposed views of weights. production.py builds on it (the
MoE, attention's tiles, switching a model to production); layers.py, moe_grouped.py and
the attention call it. It imports nothing of the model above fp8_gemm.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_shortcuts, ops
from . import fp8_gemm
from .fp8_gemm import scale_f32

__all__ = ["CPU_F32_BYTES", "FP4_BLOCK", "PRODUCTION_FLAG", "SMALL_ROWS", "TILE_BYTES", "bucket",
           "cpu_f32", "dequantize_rows",
           "grouped_view", "is_production", "linear", "rms_norm", "transposed"]

TILE_BYTES = 4 << 20        # dequantized bf16 bytes per tile of a quantized weight
FP4_BLOCK = 32
PRODUCTION_FLAG = "_dsv41_production"   # set on every module of a production model
SMALL_ROWS = 8              # CPU GEMMs of at most this many rows run on float32 copies
CPU_F32_BYTES = 4 << 30     # the most bytes of float32 weight copies one process makes
_f32_made = [0]             # bytes of float32 copies made so far


def is_production(module: nn.Module) -> bool:
    return getattr(module, PRODUCTION_FLAG, False)


_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_rows(lin: nn.Module, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of a production Linear's weight as bf16 [r1 - r0, in]."""
    w = lin.weight
    if w.dtype == torch.bfloat16:
        return w[r0:r1]
    if w.dtype == torch.float8_e4m3fn:
        b0, b1 = lin.weight_block
        s = scale_f32(lin.weight_scale[r0 // b0:(r1 + b0 - 1) // b0])
        s = s.repeat_interleave(b0, 0)[r0 % b0:r0 % b0 + r1 - r0]
        s = s.repeat_interleave(b1, 1)[:, :w.shape[1]]
        return (w[r0:r1].float() * s).to(torch.bfloat16)
    if w.dtype in (torch.int8, torch.uint8):        # packed FP4
        b = w[r0:r1].view(torch.uint8).long()
        table = _FP4.to(w.device)
        vals = torch.stack((table[b & 0xF], table[b >> 4]), -1).reshape(r1 - r0, -1)
        s = scale_f32(lin.weight_scale[r0:r1]).repeat_interleave(FP4_BLOCK, 1)
        return (vals * s).to(torch.bfloat16)
    raise TypeError(f"no production storage for a {w.dtype} weight")


def _tile_rows(lin: nn.Module) -> int:
    block = getattr(lin, "weight_block", (128, 128))[0]
    rows = max(1, TILE_BYTES // (2 * lin.in_features))
    return max(block, rows // block * block)


def bucket(rows: int) -> int:
    """Row counts the GEMMs run at: a few sizes, so oneDNN's per-shape kernels (costly to
    create next to one small GEMM, cached afterwards; docs/model.md) are reused across
    expert groups and calls."""
    if rows <= 8:
        return rows
    if rows <= 256:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 256) * 256


def transposed(w: torch.Tensor) -> torch.Tensor:
    """w.t() (or, for a 3-d stack, w.transpose(1, 2)) as a view made once per weight and
    cached on it: the GEMMs of a decode step take it without dispatching a transpose each
    call. Re-made when the weight moves or changes (its storage or version counter)."""
    if torch.compiler.is_compiling():
        return w.t() if w.dim() == 2 else w.transpose(1, 2)
    key = (w._version, w.data_ptr(), w.device)
    cached = getattr(w, "_dsv41_t", None)
    if cached is None or cached[0] != key:
        cached = (key, w.t() if w.dim() == 2 else w.transpose(1, 2))
        w._dsv41_t = cached  # type: ignore[attr-defined]
    return cached[1]


def grouped_view(w: torch.Tensor, groups: int) -> torch.Tensor:
    """w [G * R, in] viewed as [G, R, in], the view made once per weight and cached on it
    (like `transposed`, so that `transposed` of it is cached too)."""
    if torch.compiler.is_compiling():
        return w.view(groups, -1, w.shape[1])
    key = (w._version, w.data_ptr(), w.device, groups)
    cached = getattr(w, "_dsv41_grouped", None)
    if cached is None or cached[0] != key:
        cached = (key, w.view(groups, -1, w.shape[1]))
        w._dsv41_grouped = cached  # type: ignore[attr-defined]
    return cached[1]


def cpu_f32(owner: nn.Module, name: str, w: torch.Tensor) -> torch.Tensor | None:
    """A float32 copy of the bf16 CPU weight `w`, made once and cached on `owner` (under
    `name`; again if the weight moves or changes), for the small-row GEMMs of a decode
    step: on the CPU a bf16 GEMM of a few rows is slower than float32's, and the inputs
    are the same bf16 values (exact in float32) accumulated in float32 either way, so only
    the summation order differs. None - the caller runs its bf16 GEMM - for other weights
    and once the process has made CPU_F32_BYTES of copies (the copies cost twice the bf16
    weights' memory: a model that does not fit twice runs bf16 past the budget). A
    compiled step reads the copy an eager call made (None if there is none: compile after
    one eager step, as moe_grouped.stacked_weights asks)."""
    attr = f"_dsv41_f32_{name}"
    cached = owner.__dict__.get(attr)
    if torch.compiler.is_compiling():
        return None if cached is None else cached[1]
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not cpu_shortcuts.enabled():
        return None
    key = (w._version, w.data_ptr(), w.shape)
    if cached is not None and cached[0] == key:
        return cached[1]
    size = w.numel() * 4
    if cached is None:
        if _f32_made[0] + size > CPU_F32_BYTES:
            return None
        _f32_made[0] += size
    copy = w.float()
    object.__setattr__(owner, attr, (key, copy))
    return copy


def _small_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= SMALL_ROWS


def linear(x: torch.Tensor, lin: nn.Module) -> torch.Tensor:
    """x [.., in] -> x W^T [.., out] in bf16, W as `lin` stores it."""
    w = lin.weight
    if w.dtype == torch.bfloat16 and _small_cpu(x):
        wf = cpu_f32(lin, "weight", w)
        if wf is not None:
            xf = x.float() if x.dtype == torch.bfloat16 else x.to(torch.bfloat16).float()
            return torch.mm(xf, transposed(wf)).to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    if xb.dim() == 2 and xb.device.type == "cpu" and bucket(xb.shape[0]) != xb.shape[0]:
        padded = xb.new_zeros(bucket(xb.shape[0]), xb.shape[1])
        padded[:xb.shape[0]] = xb
        return linear(padded, lin)[:xb.shape[0]]
    if w.dtype == torch.bfloat16:
        return torch.mm(xb, transposed(w)) if xb.dim() == 2 else torch.matmul(xb, transposed(w))
    if w.dtype == torch.float8_e4m3fn and xb.device.type != "cpu":
        out = fp8_gemm.scaled_linear(xb, lin)   # None: this weight takes the dequant path
        if out is not None:
            return out
    out_dim = lin.out_features
    step = _tile_rows(lin)
    if step >= out_dim:
        return F.linear(xb, dequantize_rows(lin, 0, out_dim))
    out = xb.new_empty(*xb.shape[:-1], out_dim)
    for r0 in range(0, out_dim, step):
        r1 = min(out_dim, r0 + step)
        out[..., r0:r1] = F.linear(xb, dequantize_rows(lin, r0, r1))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """float32 RMSNorm (no weight: normalization only), one dsv41::rms_norm op; float32
    out, or bf16 with dtype=torch.bfloat16."""
    return ops.rms_norm(x, None if weight is None else weight.float(), eps, dtype)
