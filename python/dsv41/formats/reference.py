"""Float32 torch reference of the codecs (docs/design.md#codecs), independent of the C++ code.

Where the C++/CUDA codecs in include/dsv41/formats.h work on bit patterns, this module
works on values: it rounds to the nearest point of each format's value grid (ties to the
even code) with `searchsorted`, derives power-of-two scales with `frexp`, and decodes by
evaluating the format definitions. Tests demand bit equality between the two.
"""
from __future__ import annotations

import torch

from .layout import FP8_SWA_BLOCK, FP8_V4_TILE, MXFP4_BLOCK, NVFP4_BLOCK, Fp8V4Layout

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_NAN = 0x7F
UE8M0_NAN = 0xFF
BF16_NAN = 0x7FC0  # the canonical NaN a V4 RoPE dim stores


def _e4m3_magnitude(code: int) -> float:
    """Value of a positive E4M3 (fn) code from the format's definition: bias 7, 3 mantissa bits."""
    exp, man = code >> 3, code & 7
    return man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)


# Positive magnitudes in code order (both grids are increasing in the code).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_GRID = tuple(_e4m3_magnitude(c) for c in range(0x7F))  # 0x7F is NaN


def _round_to_grid(v: torch.Tensor, grid: tuple[float, ...], sign_bit: int) -> torch.Tensor:
    """Nearest grid point of |v| (saturating at the top), ties to the even code; sign kept."""
    g = torch.tensor(grid, dtype=torch.float64, device=v.device)
    a = v.abs().to(torch.float64).clamp(max=grid[-1])  # float64: distances below are exact
    hi = torch.searchsorted(g, a).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - g[lo], g[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo).to(torch.int32)
    code = code | (torch.signbit(v).to(torch.int32) * sign_bit)
    return code.to(torch.uint8)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (4 bits, sign in bit 3) of float32 values, RNE, saturating at +-6."""
    return _round_to_grid(v, E2M1_GRID, 0x8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_GRID + tuple(-g for g in E2M1_GRID), dtype=torch.float32,
                         device=codes.device)
    return table[codes.long() & 0xF]


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) codes of finite float32 values, RNE, saturating at +-448."""
    return _round_to_grid(v, E4M3_GRID, 0x80)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    pos = E4M3_GRID + (float("nan"),)
    table = torch.tensor(pos + tuple(-g for g in pos), dtype=torch.float32, device=codes.device)
    return table[codes.long() & 0xFF]


def ue8m0_decode(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 127); 255 is NaN."""
    s = torch.pow(torch.tensor(2.0, dtype=torch.float64, device=e.device), e.double() - 127)
    return torch.where(e == UE8M0_NAN, torch.nan, s).to(torch.float32)


def ceil_pow2_exponent(v: torch.Tensor) -> torch.Tensor:
    """UE8M0 code of the smallest power of two >= v (finite, >= 0), at least 2^-127."""
    mant, exp = torch.frexp(v.to(torch.float64))  # v = mant * 2^exp, mant in [0.5, 1)
    power = torch.where(mant == 0.5, exp - 1, exp)
    code = torch.where(v == 0, 0, (power + 127).clamp(min=0))
    return code.to(torch.uint8)


def canonical_nan(y: torch.Tensor) -> torch.Tensor:
    """y with every NaN written as 0x7FC00000, the one NaN the formats decode to (the
    hardware would pick the sign and payload of a NaN product itself)."""
    return torch.where(torch.isnan(y), torch.tensor(float("nan"), dtype=y.dtype, device=y.device), y)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _pack_fp4(codes: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    c = codes.reshape(*shape[:-1], shape[-1] // 2, 2).to(torch.int32)
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int32)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def _pow2_scaled(xb: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x / 2^(e-127), exact in float64 and rounded once to float32 (= a float32 division)."""
    return (xb.double() / ue8m0_decode(e).double()[..., None]).float()


def _block_amax(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    finite = torch.isfinite(xb).all(-1)
    amax = torch.where(torch.isfinite(xb), xb.abs(), 0).amax(-1)
    return amax, finite


def quantize_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xb = _blocks(x.float(), NVFP4_BLOCK)
    amax, finite = _block_amax(xb)
    s_code = e4m3_encode(torch.clamp(amax / E2M1_MAX, max=E4M3_MAX))
    s = e4m3_decode(s_code)
    zero = (s == 0) | ~finite
    q = e2m1_encode(xb / torch.where(zero, 1.0, s)[..., None])
    q = torch.where(zero[..., None], 0, q)
    s_code = torch.where(finite, s_code, E4M3_NAN)
    return _pack_fp4(q, x.shape), s_code.view(torch.float8_e4m3fn)


def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    v = _blocks(e2m1_decode(_unpack_fp4(codes)), NVFP4_BLOCK)
    s = e4m3_decode(scales.view(torch.uint8))
    return canonical_nan(v * s[..., None]).flatten(-2)


def _quantize_mx(x: torch.Tensor, block: int, elem_max: float, encode) -> tuple[torch.Tensor, torch.Tensor]:
    xb = _blocks(x.float(), block)
    amax, finite = _block_amax(xb)
    e = ceil_pow2_exponent(amax / elem_max)  # fl32(amax / elem_max): docs/design.md#codecs
    safe_e = torch.where(finite, e, 127)
    q = encode(_pow2_scaled(xb, safe_e))
    q = torch.where(finite[..., None], q, 0)
    return q, torch.where(finite, e, UE8M0_NAN).to(torch.uint8)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, e = _quantize_mx(x, MXFP4_BLOCK, E2M1_MAX, e2m1_encode)
    return _pack_fp4(q, x.shape), e


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    v = _blocks(e2m1_decode(_unpack_fp4(codes)), MXFP4_BLOCK)
    return canonical_nan(v * ue8m0_decode(scales.view(torch.uint8))[..., None]).flatten(-2)


def quantize_fp8_swa(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, e = _quantize_mx(x, FP8_SWA_BLOCK, E4M3_MAX, e4m3_encode)
    return q.reshape(x.shape).view(torch.float8_e4m3fn), e


def dequantize_fp8_swa(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    v = _blocks(e4m3_decode(values.view(torch.uint8)), FP8_SWA_BLOCK)
    return canonical_nan(v * ue8m0_decode(scales.view(torch.uint8))[..., None]).flatten(-2)


# ---- FP8 V4 main-KV entry -----------------------------------------------------------------

def _bf16_bytes(v: torch.Tensor) -> torch.Tensor:
    """Little-endian bytes [..., 2n] of float32 values rounded to bf16 (torch's RNE
    conversion); every NaN becomes the canonical 0x7FC0."""
    h = v.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    h = torch.where(torch.isnan(v), BF16_NAN, h)
    return torch.stack((h & 0xFF, h >> 8), dim=-1).flatten(-2).to(torch.uint8)


def quantize_fp8_v4(x: torch.Tensor, rope_dim: int, amax_floor: float) -> torch.Tensor:
    """Entries [..., entry_bytes]: E4M3 no-RoPE codes, bf16 RoPE dims, UE8M0 tile scales,
    zero pad. Tile scale: 2^ceil(log2(fl32(max(amax, floor) * fl32(1/448)))), as
    DeepSeek-V4's act_quant with a ue8m0 scale format computes it."""
    lay = Fp8V4Layout(x.shape[-1], rope_dim)
    x = x.float()
    xb = _blocks(x[..., :lay.nope_dim], FP8_V4_TILE)
    amax, finite = _block_amax(xb)
    f32 = dict(dtype=torch.float32, device=x.device)
    floored = torch.maximum(amax, torch.tensor(amax_floor, **f32))
    e = ceil_pow2_exponent(floored * torch.tensor(1 / E4M3_MAX, **f32))  # float32 product
    q = e4m3_encode(_pow2_scaled(xb, torch.where(finite, e, 127)))
    q = torch.where(finite[..., None], q, 0).flatten(-2)
    e = torch.where(finite, e, UE8M0_NAN).to(torch.uint8)
    out = torch.zeros(*x.shape[:-1], lay.entry_bytes, dtype=torch.uint8, device=x.device)
    out[..., :lay.rope_offset] = q
    out[..., lay.rope_offset:lay.scale_offset] = _bf16_bytes(x[..., lay.nope_dim:])
    out[..., lay.scale_offset:lay.pad_offset] = e
    return out


def dequantize_fp8_v4(entries: torch.Tensor, head_dim: int, rope_dim: int) -> torch.Tensor:
    lay = Fp8V4Layout(head_dim, rope_dim)
    v = _blocks(e4m3_decode(entries[..., :lay.rope_offset]), FP8_V4_TILE)
    s = ue8m0_decode(entries[..., lay.scale_offset:lay.pad_offset])
    nope = (v * s[..., None]).flatten(-2)
    b = entries[..., lay.rope_offset:lay.scale_offset].to(torch.int32)
    h = b[..., 0::2] | (b[..., 1::2] << 8)  # little-endian bf16 bits
    rope = (h << 16).view(torch.float32)     # bf16 is the top half of a float32
    return canonical_nan(torch.cat((nope, rope), dim=-1))
