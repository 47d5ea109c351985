"""The kernels' fast bf16 decoders (include/dsv41/dequant.h: bit tricks, permuted pairs,
exponent bias folded into the scale) against the codecs of formats.h, for every code and
every scale. On the CPU this runs the very header functions the CUDA kernels inline; the
GPU variant checks the device instructions (bf16x2 fma with subnormal operands)."""
from __future__ import annotations

import pytest
import torch

from dsv41 import formats
from dsv41.ops import cache_ops



def _all_codes_fp4(rows: int, d: int) -> torch.Tensor:
    # Every byte value (two E2M1 codes) in every row, rotated so each code meets many scales.
    base = torch.arange(256, dtype=torch.int64)
    return torch.stack([(base + 37 * r) % 256 for r in range(rows)]).repeat(1, d // 2 // 256).to(torch.uint8)


def _all_scales(rows: int, n: int) -> torch.Tensor:
    return (torch.arange(rows * n, dtype=torch.int64) % 256).reshape(rows, n).to(torch.uint8)


def _cases(fmt: str):
    if fmt == "nvfp4":  # D = 512: 256 code bytes, 32 E4M3 scales per row; 8 rows = all 256 scales
        codes, scales = _all_codes_fp4(8, 512), _all_scales(8, 32)
        ref = formats.dequantize_nvfp4(codes, scales.view(torch.float8_e4m3fn))
    elif fmt == "mxfp4":  # D = 512: 256 code bytes, 16 UE8M0 scales; 16 rows = all scales
        codes, scales = _all_codes_fp4(16, 512), _all_scales(16, 16)
        ref = formats.dequantize_mxfp4(codes, scales)
    else:  # FP8: D = 256: every E4M3 code once per row, 8 scales; 32 rows = all scales
        codes = torch.stack([(torch.arange(256) + 11 * r) % 256 for r in range(32)]).to(torch.uint8)
        scales = _all_scales(32, 8)
        ref = formats.dequantize_fp8_swa(codes.view(torch.float8_e4m3fn), scales)
    return codes, scales, ref


def _check(fmt, got, codes, ref):
    # The fast path produces bf16: equal to the codec value wherever that is a bf16 value
    # (always, except below 2^-126 where bf16 keeps fewer subnormal bits: compare to the
    # bf16 rounding there). E4M3 NaN codes 0x7F/0xFF are outside what dsv41 stores and
    # are not decoded as NaN by the fast path (documented): excluded.
    want = ref.to(torch.bfloat16).float()
    keep = torch.ones_like(ref, dtype=torch.bool)
    if fmt == "fp8_swa":
        keep = (codes & 0x7F) != 0x7F
    g, w = got[keep], want[keep]
    assert torch.equal(torch.isnan(g), torch.isnan(w))
    fin = ~torch.isnan(w)
    assert torch.equal(g[fin], w[fin]), (g[fin] - w[fin]).abs().max()
    # Normal-range values are exact codec values (no rounding at all).
    normal = fin & (w.abs() >= 2.0 ** -126) & torch.isfinite(w)
    assert torch.equal(g[normal], ref[keep][normal])
    # Signed zeros survive.
    zero = fin & (w == 0)
    assert torch.equal(torch.signbit(g[zero]), torch.signbit(ref[keep][zero]))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8_swa"])
def test_fast_decoders_match_codecs_cpu(fmt):
    codes, scales, ref = _cases(fmt)
    got = cache_ops.dequant_tricks(fmt, codes, scales)
    _check(fmt, got, codes, ref)
    # NaN scales (NVFP4's 0x7F and 0xFF, UE8M0 0xFF) decode to the formats' one NaN,
    # 0x7FC00000, whatever sign the scale's NaN has and whatever the multiply writes.
    nan_bits = got.view(torch.int32)[got.isnan()]
    assert nan_bits.numel() > 0 and (nan_bits == 0x7FC00000).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8_swa"])
def test_fast_decoders_on_quantized_data(fmt, gen):
    x = torch.randn(64, 512, generator=gen) * torch.logspace(-6, 6, 64)[:, None]
    codes, scales = getattr(formats, f"quantize_{fmt}")(x)
    ref = getattr(formats, f"dequantize_{fmt}")(codes, scales)
    got = cache_ops.dequant_tricks(fmt, codes, scales)
    assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8_swa"])
def test_fast_decoders_match_codecs_cuda(fmt):
    codes, scales, ref = _cases(fmt)
    got = cache_ops.dequant_tricks(fmt, codes.cuda(), scales.cuda()).cpu()
    _check(fmt, got, codes, ref)
    cpu = cache_ops.dequant_tricks(fmt, codes, scales)
    assert torch.equal(got.view(torch.int32), cpu.view(torch.int32))  # GPU == CPU, bit for bit
