"""The three codecs: C++ op (and CUDA kernel) == torch reference, bit for bit; error bounds."""
from __future__ import annotations

import pytest
import torch

from dsv41 import formats
from dsv41.formats import reference as ref

from . import cases

# name -> (quantize, dequantize, block, top element value, code dtype)
CODECS = {
    "nvfp4": (formats.quantize_nvfp4, formats.dequantize_nvfp4, 16),
    "mxfp4": (formats.quantize_mxfp4, formats.dequantize_mxfp4, 32),
    "fp8_swa": (formats.quantize_fp8_swa, formats.dequantize_fp8_swa, 32),
}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def assert_same_bits(a: tuple, b: tuple) -> None:
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        xb, yb = as_bytes(x.cpu()), as_bytes(y.cpu())
        bad = (xb != yb).nonzero()
        assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}: " \
                                 f"{xb[tuple(bad[0])]:#04x} vs {yb[tuple(bad[0])]:#04x}"


def assert_same_floats(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal as bit patterns (so -0 != +0 and NaN == NaN)."""
    assert torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))


def inputs(name: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    block = CODECS[name][2]
    top = ref.E4M3_MAX if name == "fp8_swa" else ref.E2M1_MAX
    grid = cases.E4M3_BOUNDARY if name == "fp8_swa" else cases.E2M1_BOUNDARY
    return {
        "boundaries": cases.blocks_with_unit_scale(grid, block, top),
        # NVFP4's E4M3 scale sees every E4M3 rounding boundary when amax / 6 sweeps them.
        "scale_boundaries": cases.E4M3_BOUNDARY.abs()[:, None] * 6 * torch.linspace(-1, 1, block),
        "random": cases.scaled_random(gen, 512, 128),
        "special": cases.special_blocks(block),
        "nonfinite": cases.nonfinite_blocks(block),
        "batched_3d": torch.randn(3, 5, 64, generator=gen) * 7,
    }


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("case", ["boundaries", "scale_boundaries", "random", "special",
                                  "nonfinite", "batched_3d"])
def test_cpu_op_matches_reference_bits(name, case, gen):
    quant, dequant, _ = CODECS[name]
    x = inputs(name, gen)[case].contiguous()
    got = quant(x)
    want = quant(x, reference=True)
    assert_same_bits(got, want)
    assert_same_floats(dequant(*got), dequant(*want, reference=True))


def test_e2m1_ties_go_to_even_codes():
    # Hand-written from the E2M1 grid: each midpoint rounds to the neighbour whose code is even.
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0]
                     + [0.0] * 22)
    codes, scales = formats.quantize_mxfp4(x)
    assert scales.item() == 127  # amax 6 -> scale 2^0
    want = [7, 0, 2, 2, 4, 4, 6, 6, 0x8, 0xE] + [0] * 22
    unpacked = torch.stack([codes & 0xF, codes >> 4], -1).flatten().tolist()
    assert unpacked == want


def test_negative_zero_and_saturation_rules():
    # FP8: -tiny rounds to -0 (0x80); values just under 448 * scale saturate to 448.
    x = torch.zeros(32)
    x[0], x[1], x[2] = 448.0, -1e-30, -0.0
    values, scales = formats.quantize_fp8_swa(x)
    v = values.view(torch.uint8)
    assert scales.item() == 127 and v[0] == 0x7E and v[1] == 0x80 and v[2] == 0x80 and v[3] == 0
    # NVFP4: a block whose scale rounds to zero is all +0 even for negative inputs.
    tiny = torch.full((16,), -1e-4)
    codes, s = formats.quantize_nvfp4(tiny)
    assert s.view(torch.uint8).item() == 0 and codes.eq(0).all()
    # MXFP4: -tiny next to a large value gives the negative-zero code 0b1000.
    x = torch.zeros(32)
    x[0], x[1] = 6.0, -0.1
    codes, _ = formats.quantize_mxfp4(x)
    assert codes[0].item() == 0x87


def test_nonfinite_blocks_are_poisoned_and_decode_to_nan():
    for name, (quant, dequant, block) in CODECS.items():
        codes, scales = quant(cases.nonfinite_blocks(block))
        nan_code = 0x7F if name == "nvfp4" else 0xFF
        assert as_bytes(scales).eq(nan_code).all(), name
        assert as_bytes(codes).eq(0).all(), name
        assert dequant(codes, scales).isnan().all(), name


CANONICAL_NAN = 0x7FC00000  # the one NaN every dequantizer writes (formats.h)


def nan_code_cases(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales that decode to NaN every way the format allows: both NaN scale
    codes of NVFP4 (E4M3 0x7F, 0xFF: a negative NaN) and UE8M0 0xFF under every element
    code, and FP8's NaN element codes 0x7F/0xFF under finite scales. Stored bytes may hold
    any of these (a foreign writer, a bit flip), not only what dsv41's encoders emit."""
    every_byte = torch.arange(256, dtype=torch.uint8)
    if name == "fp8_swa":  # 8 blocks of every E4M3 code, each under a finite or the NaN scale
        codes = every_byte.repeat(4).view(4, 256)
        scales = torch.tensor([127, 0, 254, 0xFF], dtype=torch.uint8)[:, None].repeat(1, 8)
        return codes.view(torch.float8_e4m3fn), scales
    block = CODECS[name][2]
    codes = every_byte.repeat(2).view(-1, block // 2)  # every pair of E2M1 codes
    nan_scales = [0x7F, 0xFF] if name == "nvfp4" else [0xFF]
    scales = torch.tensor(nan_scales * (codes.shape[0] // len(nan_scales) + 1), dtype=torch.uint8)
    scales = scales[: codes.shape[0], None]
    return codes, scales.view(torch.float8_e4m3fn) if name == "nvfp4" else scales


def assert_nans_canonical(y: torch.Tensor) -> None:
    bits = y.cpu().view(torch.int32)[y.cpu().isnan()]
    assert bits.numel() > 0
    bad = bits[bits != CANONICAL_NAN]
    assert bad.numel() == 0, f"{bad.numel()} NaNs with other bits, e.g. {bad[0].item() & 0xFFFFFFFF:#010x}"


@pytest.mark.parametrize("name", list(CODECS))
def test_every_nan_dequantizes_to_the_canonical_bits(name):
    # Hardware picks a NaN result's bits (x86 keeps the operand's sign and payload; NVIDIA
    # GPUs write 0x7FFFFFFF), so the formats fix them: every NaN out of a decoder is
    # 0x7FC00000. The C++ CPU loop runs the very header code the CUDA kernel runs.
    dequant = CODECS[name][1]
    codes, scales = nan_code_cases(name)
    got = dequant(codes, scales)
    assert_nans_canonical(got)
    assert_same_floats(got, dequant(codes, scales, reference=True))


def test_e4m3_encoder_agrees_with_torch_float8_cast():
    # A third, independent witness for the E4M3 rounding: torch's own float8 conversion
    # (RNE; it maps overflow to NaN, so clamp to the saturation bound first).
    x = torch.cat([cases.E4M3_BOUNDARY, torch.randn(4000) * 30, torch.randn(4000) * 1e-3])
    ours = ref.e4m3_encode(x)
    theirs = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, theirs)
    # And the C++ path, through NVFP4's scale: amax / 6 == x exactly when amax = 6x.
    x = x.abs()
    blocks = torch.zeros(x.numel(), 16)
    blocks[:, 0] = x * 6
    ok = torch.isfinite(blocks[:, 0]) & ((blocks[:, 0] / 6) == x)
    _, scales = formats.quantize_nvfp4(blocks[ok])
    assert torch.equal(scales.view(torch.uint8).flatten(), theirs[ok] & 0x7F)


def test_every_e4m3_and_e2m1_code_round_trips():
    values = ref.e4m3_decode(torch.arange(256, dtype=torch.uint8))
    finite = ~values.isnan()
    v = values[finite]
    x = cases.blocks_with_unit_scale(v, 32, 448.0)
    q, s = formats.quantize_fp8_swa(x)
    back = formats.dequantize_fp8_swa(q, s)
    assert torch.equal(back[:, 1:].flatten()[: v.numel()].view(torch.int32), v.view(torch.int32))
    grid = ref.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    x = cases.blocks_with_unit_scale(grid, 32, 6.0)
    codes, s = formats.quantize_mxfp4(x)
    back = formats.dequantize_mxfp4(codes, s)
    assert torch.equal(back[:, 1:].flatten()[:16].view(torch.int32), grid.view(torch.int32))


def _e2m1_half_step(v: torch.Tensor) -> torch.Tensor:
    """Half the grid spacing around |v| (0.25 below 2, 0.5 below 4, 1 up to 6)."""
    a = v.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_fp4_round_trip_error_bound(name, gen):
    quant, dequant, block = CODECS[name]
    x = torch.randn(256, 128, generator=gen) * torch.logspace(-3, 3, 256)[:, None]
    codes, scales = quant(x)
    y = dequant(codes, scales)
    s = (ref.e4m3_decode(scales.view(torch.uint8)) if name == "nvfp4"
         else ref.ue8m0_decode(scales)).repeat_interleave(block, -1)
    zero = s == 0  # NVFP4 only: amax / 6 <= 2^-10 rounded the scale to 0, all codes +0
    v = x / torch.where(zero, 1.0, s)
    # Within the grid: at most half a step (in units of the scale); past 6 (NVFP4's scale
    # can round down): the saturation excess on top.
    bound = s * _e2m1_half_step(v.clamp(-6, 6)) + (x.abs() - 6 * s).clamp(min=0)
    bound = torch.where(zero, 6 * 2.0**-10, bound)
    assert ((x - y).abs() <= bound * (1 + 1e-6)).all()
    if name == "nvfp4":
        # RNE to a normal, unclamped E4M3 scale loses at most 2^-4 of amax / 6, so
        # |x / s| <= 6 / (1 - 2^-4); subnormal or clamped (448) scales saturate more.
        normal = (s >= 2.0**-6) & (s < 448)
        assert (v.abs()[normal] <= 6 / (1 - 2.0**-4) * (1 + 1e-6)).all()
        assert zero.any() and normal.any()  # the data reaches both regimes
    else:
        assert (v.abs() <= 6).all()  # power-of-two scale >= amax / 6


def test_fp8_swa_round_trip_error_bound(gen):
    x = torch.randn(256, 128, generator=gen) * torch.logspace(-30, 30, 256)[:, None]
    q, s = formats.quantize_fp8_swa(x)
    y = formats.dequantize_fp8_swa(q, s)
    scale = ref.ue8m0_decode(s).repeat_interleave(32, -1)
    # E4M3 normals keep 3 mantissa bits (relative error <= 2^-4); subnormals step 2^-9.
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((x - y).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("name", list(CODECS))
def test_into_variant_writes_the_same_bits(name, gen):
    quant, _, block = CODECS[name]
    x = torch.randn(6, 4 * block, generator=gen)
    codes, scales = quant(x)
    cache_codes, cache_scales = torch.zeros(10, *codes.shape[1:], dtype=codes.dtype), \
        torch.zeros(10, *scales.shape[1:], dtype=scales.dtype)
    into = getattr(formats, f"quantize_{name}_into")
    into(x, cache_codes[2:8], cache_scales[2:8])
    assert_same_bits((cache_codes[2:8], cache_scales[2:8]), (codes, scales))
    assert as_bytes(cache_codes[:2]).eq(0).all() and as_bytes(cache_codes[8:]).eq(0).all()


def test_non_contiguous_and_unaligned_inputs(gen):
    x = torch.randn(64, 33, generator=gen)
    for view in (x[:, 1:], x.t()[:32].t().contiguous()[:, :32], x.flatten()[1:1 + 64 * 32].view(64, 32)):
        assert_same_bits(formats.quantize_mxfp4(view), formats.quantize_mxfp4(view, reference=True))
    codes, scales = formats.quantize_fp8_swa(torch.randn(4, 64, generator=gen))
    strided = torch.cat([codes, codes], -1)[:, ::2]  # non-contiguous view of FP8 values
    assert_same_floats(formats.dequantize_fp8_swa(strided, scales),
                       formats.dequantize_fp8_swa(strided.contiguous(), scales, reference=True))


def test_e8m0_scale_dtype_is_accepted(gen):
    x = torch.randn(3, 64, generator=gen)
    codes, scales = formats.quantize_mxfp4(x)
    a = formats.dequantize_mxfp4(codes, scales)
    b = formats.dequantize_mxfp4(codes, scales.view(torch.float8_e8m0fnu))
    assert_same_floats(a, b)


def test_empty_tensors():
    for name, (quant, dequant, block) in CODECS.items():
        codes, scales = quant(torch.empty(0, block))
        assert codes.shape[0] == 0 and dequant(codes, scales).shape == (0, block)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("case", ["boundaries", "scale_boundaries", "random", "special",
                                  "nonfinite", "batched_3d"])
def test_cuda_kernel_matches_cpu_bits(name, case, gen):
    quant, dequant, _ = CODECS[name]
    x = inputs(name, gen)[case].contiguous()
    got = quant(x.cuda())
    want = quant(x)
    assert_same_bits(got, want)
    assert_same_floats(dequant(*got), dequant(*want))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CODECS))
def test_cuda_nans_are_the_cpu_bits(name):
    dequant = CODECS[name][1]
    codes, scales = nan_code_cases(name)
    got = dequant(codes.cuda(), scales.cuda())
    assert_nans_canonical(got)
    assert_same_floats(got, dequant(codes, scales))


@pytest.mark.gpu
def test_cuda_into_and_odd_sizes(gen):
    for rows in (1, 3, 257, 4099):  # grids that end mid-warp and mid-block
        x = torch.randn(rows, 96, generator=gen)
        for name in ("mxfp4", "fp8_swa"):
            quant = CODECS[name][0]
            codes, scales = quant(x)
            c, s = torch.zeros_like(codes).cuda(), torch.zeros_like(scales).cuda()
            getattr(formats, f"quantize_{name}_into")(x.cuda(), c, s)
            assert_same_bits((c, s), (codes, scales))
