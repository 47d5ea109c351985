"""The FP8 V4 main-KV codec (DeepSeek-V4 / FlashMLA MODEL1 entries): C++ op (and CUDA
kernel) == float32 torch reference bit for bit, hand-checked layout facts, errors, custom-op
registration."""
from __future__ import annotations

import math

import pytest
import torch

from dsv41 import budget, formats
from dsv41.config import ModelConfig
from dsv41.formats import layout
from dsv41.formats import reference as ref

from . import cases

V4 = dict(head_dim=512, rope_dim=64)  # V4-Flash: 448 no-RoPE dims, 64 RoPE dims, 584 B
FLOOR_CODE = 127 - 22  # 2^-22: the smallest power of two >= fl32(1e-4) * fl32(1/448)
# (head_dim, rope_dim) beyond V4-Flash's: one tile, no RoPE, a pad of 7, bigger.
SHAPES = [(512, 64), (128, 64), (128, 0), (80, 16), (200, 8), (1056, 32)]


def quant(x, rope_dim=64, **kw):
    return formats.quantize_fp8_v4(x, rope_dim=rope_dim, **kw)


def dequant(e, head_dim=512, rope_dim=64, **kw):
    return formats.dequantize_fp8_v4(e, head_dim=head_dim, rope_dim=rope_dim, **kw)


def same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as bit patterns (so -0 != +0 and NaN == NaN)."""
    return torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape
    bad = (a.cpu() != b.cpu()).nonzero()
    assert bad.numel() == 0, (f"{bad.shape[0]} bytes differ, first at {bad[0].tolist()}: "
                              f"{a.cpu()[tuple(bad[0])]:#04x} vs {b.cpu()[tuple(bad[0])]:#04x}")


def entries_of(nope: torch.Tensor, rope: torch.Tensor, nope_dim: int = 448) -> torch.Tensor:
    """Rows of nope_dim no-RoPE values (from a flat list, zero padded) next to RoPE rows."""
    n = -(-nope.numel() // nope_dim)
    body = torch.cat([nope.flatten(), torch.zeros(n * nope_dim - nope.numel())]).view(n, nope_dim)
    r = rope.flatten()
    reps = -(-n * 64 // max(r.numel(), 1))
    return torch.cat([body, r.repeat(reps)[: n * 64].view(n, 64)], dim=1)


def bf16_boundaries() -> torch.Tensor:
    """bf16 ties and their float32 neighbours, both signs; overflow, bf16 max, subnormals."""
    k = torch.arange(-8, 9, dtype=torch.float32)
    ulp = 2.0 ** (k - 7)
    base = 2.0 ** k
    ties = torch.cat([base + ulp / 2, base + 3 * ulp / 2, base - ulp / 4])  # round down/up/down
    pts = torch.cat([ties, torch.tensor([torch.finfo(torch.bfloat16).max, 3.3961e38, 3.4e38,
                                         1e-40, 9.2e-41, 2.0**-133, 0.0])])
    up = torch.nextafter(pts, torch.full_like(pts, math.inf))
    down = torch.nextafter(pts, torch.full_like(pts, -math.inf)).clamp(min=0)
    v = torch.cat([pts, up, down])
    return torch.cat([v, -v])


def scale_boundaries() -> torch.Tensor:
    """Tiles whose amax sits on, and one ulp either side of, 448 * 2^k (where the UE8M0
    scale steps) for k across the range, and around the 1e-4 amax floor."""
    amax = 448.0 * torch.pow(2.0, torch.arange(-150, 120, 3, dtype=torch.float32))
    amax = torch.cat([amax, torch.tensor([1e-4, 448 * 2.0**-22, 448 * 2.0**-23, 5e-5, 1e-4 * 1.5])])
    amax = amax[torch.isfinite(amax) & (amax > 0)]
    a = torch.cat([amax, torch.nextafter(amax, torch.full_like(amax, math.inf)),
                   torch.nextafter(amax, torch.zeros_like(amax))])
    return a[:, None] * torch.linspace(-1, 1, 64)  # one tile per amax, values spread below it


def inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    rope = torch.randn(64, generator=gen)
    return {
        "e4m3_boundaries": entries_of(cases.blocks_with_unit_scale(cases.E4M3_BOUNDARY, 64, 448.0), rope),
        "scale_boundaries": entries_of(scale_boundaries(), rope),
        "bf16_rope": entries_of(torch.randn(448, generator=gen), bf16_boundaries()),
        "random": cases.scaled_random(gen, 256, 512),
        "special": entries_of(cases.special_blocks(64), cases.special_blocks(64)),
        "nonfinite": entries_of(cases.nonfinite_blocks(64), torch.tensor([1.0, math.nan, -math.inf, math.inf])),
        "batched_3d": torch.randn(3, 5, 512, generator=gen) * 7,
    }


CASES = ["e4m3_boundaries", "scale_boundaries", "bf16_rope", "random", "special", "nonfinite",
         "batched_3d"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("floor", [layout.FP8_V4_AMAX_FLOOR, 0.0])
def test_cpu_op_matches_reference_bits(case, floor, gen):
    x = inputs(gen)[case].contiguous()
    got = quant(x, amax_floor=floor)
    want = quant(x, amax_floor=floor, reference=True)
    assert got.shape == (*x.shape[:-1], 584)
    assert_same_bytes(got, want)
    assert same_floats(dequant(got), dequant(want, reference=True))


@pytest.mark.parametrize("head_dim,rope_dim", SHAPES)
def test_other_head_dims_and_odd_batch_shapes(head_dim, rope_dim, gen):
    lay = layout.fp8_v4_layout(head_dim, rope_dim)
    for lead in [(), (1,), (3, 7), (2, 1, 5)]:
        x = torch.randn(*lead, head_dim, generator=gen) * 3
        got = quant(x, rope_dim)
        assert got.shape == (*lead, lay.entry_bytes)
        assert_same_bytes(got, quant(x, rope_dim, reference=True))
        y = dequant(got, head_dim, rope_dim)
        assert y.shape == x.shape
        assert same_floats(y, dequant(got, head_dim, rope_dim, reference=True))
        assert got[..., lay.pad_offset:].eq(0).all()


def test_v4_flash_byte_layout_by_hand():
    # Every part at the offset FlashMLA's MODEL1 layout gives it, checked without the reference.
    x = torch.zeros(512)
    x[3 * 64 + 5] = 448.0    # tile 3: amax 448 -> scale 2^0 (code 127), code 0x7E
    x[3 * 64 + 6] = -1.0     # E4M3 -1.0 = 0xB8
    x[6 * 64] = -0.0         # -0 keeps its sign: 0x80
    x[448 + 2] = 2.0         # bf16 0x4000, little-endian at bytes 452, 453
    x[448 + 63] = -1.5       # bf16 0xBFC0 at bytes 574, 575
    e = quant(x)
    assert e.shape == (584,) and e.dtype == torch.uint8
    assert e[3 * 64 + 5] == 0x7E and e[3 * 64 + 6] == 0xB8 and e[6 * 64] == 0x80
    assert e[:448].count_nonzero() == 3
    assert e[452:454].tolist() == [0x00, 0x40] and e[574:576].tolist() == [0xC0, 0xBF]
    assert e[448:576].count_nonzero() == 3
    # Scales at 576..582 in tile order: empty tiles get the floor's 2^-22; pad byte 583 is 0.
    assert e[576:583].tolist() == [FLOOR_CODE] * 3 + [127] + [FLOOR_CODE] * 3
    assert e[583] == 0
    # Without the floor an all-zero tile gets the smallest scale, 2^-127 (code 0).
    assert quant(x, amax_floor=0.0)[576:583].tolist() == [0, 0, 0, 127, 0, 0, 0]
    # Decoding gives back exactly the representable inputs.
    assert same_floats(dequant(e), x)


def test_scale_steps_at_448_times_powers_of_two():
    x = torch.zeros(4, 512)
    x[0, 0] = 448.0
    x[1, 0] = torch.nextafter(torch.tensor(448.0), torch.tensor(math.inf))
    x[2, 0] = 224.0
    x[3, 0] = 1e-4  # exactly at the floor: fl32(1e-4 * fl32(1/448)) = 2.23e-7 -> 2^-22
    scales = quant(x)[:, 576]
    assert scales.tolist() == [127, 128, 126, FLOOR_CODE]
    # The next value above 448 needs scale 2 and rounds to 224 * 2 = 448 (E4M3 0x76 * 2).
    assert quant(x)[1, 0] == 0x76


def test_matches_deepseek_act_quant_formula(gen):
    # An independent witness written from DeepSeek-V4's inference kernel (act_quant with
    # block 64 and a ue8m0 scale): amax floored at 1e-4, times fl32(1/448), scale rounded up
    # to a power of two on the float32 bits, then x / s clamped to +-448 and cast with torch.
    x = torch.cat([cases.scaled_random(gen, 64, 448) * 1e-3, torch.randn(64, 448, generator=gen)])
    tiles = x.view(-1, 7, 64)
    amax = tiles.abs().amax(-1).clamp_min(1e-4) * (1.0 / 448.0)
    bits = amax.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    s = (exp << 23).view(torch.float32)
    codes = (tiles / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    e = quant(torch.cat([x, torch.randn(128, 64, generator=gen)], 1))
    assert torch.equal(e[:, :448], codes.flatten(-2))
    assert torch.equal(e[:, 576:583], exp.to(torch.uint8))


def test_rope_dims_round_to_bf16_nearest_even():
    # Hand-written: ties go to the even bf16 mantissa; float32 values just past a tie go up.
    one = 1.0
    x = torch.zeros(6, 512)
    rope = torch.tensor([one + 2.0**-8, one + 3 * 2.0**-8, -(one + 2.0**-8),
                         float(torch.nextafter(torch.tensor(one + 2.0**-8), torch.tensor(2.0))),
                         3.4e38, 1e-40])
    x[:, 448] = rope
    got = dequant(quant(x))[:, 448]
    want = torch.tensor([1.0, 1.0 + 2.0**-6, -1.0, 1.0 + 2.0**-7, math.inf, 9.9184e-41])
    assert torch.equal(got[:5], want[:5])
    assert got[5] == rope[5].to(torch.bfloat16).float()  # bf16 keeps float32's subnormals
    # And every value equals torch's own bf16 conversion (RNE).
    xs = bf16_boundaries()
    rows = -(-xs.numel() // 64)
    x = entries_of(torch.zeros(rows * 448), xs)
    y = dequant(quant(x))[:, 448:].flatten()[: xs.numel()]
    assert same_floats(y, xs.to(torch.bfloat16).float())


def test_nonfinite_tiles_are_poisoned_and_rope_keeps_inf():
    x = torch.randn(2, 512)
    x[0, 2 * 64 + 9] = math.nan
    x[1, 6 * 64] = -math.inf
    x[0, 448], x[0, 449], x[0, 450] = math.nan, math.inf, -math.inf
    x[1, 448] = -math.nan
    e = quant(x)
    assert e[0, 576 + 2] == 0xFF and e[0, 2 * 64:3 * 64].eq(0).all()
    assert e[1, 576 + 6] == 0xFF and e[1, 6 * 64:7 * 64].eq(0).all()
    assert e[0, 576:583].eq(0xFF).sum() == 1 and e[1, 576:583].eq(0xFF).sum() == 1
    # Every NaN is stored as the canonical bf16 NaN 0x7FC0, whatever its sign or payload.
    assert e[0, 448:450].tolist() == [0xC0, 0x7F] and e[1, 448:450].tolist() == [0xC0, 0x7F]
    y = dequant(e)
    assert y[0, 128:192].isnan().all() and y[1, 384:448].isnan().all()
    assert y[0, 448].isnan() and y[0, 449] == math.inf and y[0, 450] == -math.inf
    finite_tiles = torch.ones(2, 7, dtype=torch.bool)
    finite_tiles[0, 2] = finite_tiles[1, 6] = False
    assert not y[:, :448].view(2, 7, 64)[finite_tiles].isnan().any()


def nan_entries() -> torch.Tensor:
    """V4 entries holding every way to decode to NaN: E4M3 NaN codes (0x7F, 0xFF: -NaN)
    under finite scales, the NaN scale 0xFF over every code, and bf16 RoPE NaNs of either
    sign and other payloads (a foreign writer's bytes, not what the encoder stores)."""
    e = torch.zeros(4, 584, dtype=torch.uint8)
    e[:, :448] = torch.arange(448) % 256
    e[:, 576:583] = 127
    e[1, 576:583] = 0xFF
    rope_nans = torch.tensor([0x7FC0, 0xFFC0, 0x7F81, 0xFFFF], dtype=torch.int32)
    e[:, 448:456:2], e[:, 449:456:2] = rope_nans & 0xFF, rope_nans >> 8
    return e


def test_every_nan_dequantizes_to_the_canonical_bits():
    y = dequant(nan_entries())
    assert y[1, :448].isnan().all() and y[:, 448:452].isnan().all()
    nan_bits = y.view(torch.int32)[y.isnan()]
    assert (nan_bits == 0x7FC00000).all(), f"{(nan_bits != 0x7FC00000).sum()} NaNs with other bits"
    assert same_floats(y, dequant(nan_entries(), reference=True))


def test_round_trip_error_bound(gen):
    x = torch.randn(256, 512, generator=gen) * torch.logspace(-6, 30, 256)[:, None]
    e = quant(x)
    y = dequant(e)
    s = ref.ue8m0_decode(e[:, 576:583]).repeat_interleave(64, -1)
    # E4M3 normals keep 3 mantissa bits (relative error <= 2^-4); subnormals step 2^-9.
    bound = torch.maximum(x[:, :448].abs() * 2.0**-4, s * 2.0**-10)
    assert ((x[:, :448] - y[:, :448]).abs() <= bound * (1 + 1e-6)).all()
    assert same_floats(y[:, 448:], x[:, 448:].to(torch.bfloat16).float())


def test_into_variant_writes_the_same_bytes(gen):
    x = torch.randn(6, 512, generator=gen)
    cache = torch.zeros(10, 584, dtype=torch.uint8)
    formats.quantize_fp8_v4_into(x, cache[2:8], rope_dim=64)
    assert_same_bytes(cache[2:8], quant(x))
    assert cache[:2].eq(0).all() and cache[8:].eq(0).all()
    formats.quantize_fp8_v4_into(x[0], cache[9], rope_dim=64, amax_floor=0.0)
    assert_same_bytes(cache[9], quant(x[0], amax_floor=0.0))


def test_split_views_name_the_parts(gen):
    x = torch.randn(3, 512, generator=gen)
    e = quant(x)
    values, rope, scales = formats.fp8_v4_split(e, **V4)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (3, 448)
    assert rope.dtype == torch.bfloat16 and rope.shape == (3, 64)
    assert scales.dtype == torch.uint8 and scales.shape == (3, 7)
    assert torch.equal(rope.float(), x[:, 448:].to(torch.bfloat16).float())
    y = values.float().view(3, 7, 64) * ref.ue8m0_decode(scales)[..., None]
    assert same_floats(y.flatten(-2), dequant(e)[:, :448])
    assert values.data_ptr() == e.data_ptr()  # views, no copies


def test_non_contiguous_inputs_and_empty_tensors(gen):
    x = torch.randn(4, 1024, generator=gen)
    view = x[:, ::2]
    assert_same_bytes(quant(view), quant(view.contiguous(), reference=True))
    e = quant(torch.randn(4, 512, generator=gen))
    strided = torch.cat([e, e], -1)[:, :584]
    assert same_floats(dequant(strided), dequant(e, reference=True))
    assert quant(torch.empty(0, 512)).shape == (0, 584)
    assert dequant(torch.empty(0, 584, dtype=torch.uint8)).shape == (0, 512)


# ---- the byte sizes come from the one layout module -----------------------------------

def test_layout_module_is_what_the_codecs_write(gen):
    lay = layout.fp8_v4_layout(512, 64)
    assert (lay.nope_dim, lay.n_tiles, lay.rope_offset, lay.scale_offset, lay.pad_offset,
            lay.entry_bytes) == (448, 7, 448, 576, 583, 584)
    for h, r in SHAPES:
        assert quant(torch.zeros(h), r).numel() == layout.fp8_v4_layout(h, r).entry_bytes
    for name, spec in layout.BLOCK_FORMATS.items():
        codes, scales = getattr(formats, f"quantize_{name}")(torch.randn(2, 128, generator=gen))
        assert (codes.shape[-1], scales.shape[-1]) == spec.row_shapes(128)
        assert (codes.dtype, scales.dtype) == (spec.code_dtype, spec.scale_dtype)
        assert codes[0].nbytes + scales[0].nbytes == spec.bytes(128)


def test_v4_budget_counts_the_codec_entry():
    v4 = ModelConfig.preset("v4-flash")
    x = torch.zeros(v4.head_dim)
    assert budget.main_entry_bytes(v4) == quant(x, v4.rope_head_dim).numel() == 584
    assert layout.main_kv_entry_bytes("fp8_v4", 512, 64) == 584
    with pytest.raises(ValueError, match="unknown main-KV format"):
        layout.main_kv_entry_bytes("fp16", 512, 64)


# ---- errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("reference", [False, True])
def test_bad_inputs_get_clear_errors(reference):
    with pytest.raises(TypeError, match="x must be float32, got torch.bfloat16"):
        quant(torch.zeros(512, dtype=torch.bfloat16), reference=reference)
    with pytest.raises(ValueError, match=r"no-RoPE dims \(head_dim 512 - rope_dim 32 = 480\) "
                                         r"must be a multiple of the 64"):
        quant(torch.zeros(2, 512), 32, reference=reference)
    with pytest.raises(ValueError, match=r"rope_dim must be in \[0, head_dim=64\), got 64"):
        quant(torch.zeros(64), 64, reference=reference)
    with pytest.raises(ValueError, match="at least one dimension"):
        quant(torch.tensor(1.0), reference=reference)
    with pytest.raises(ValueError, match="amax_floor must be finite and >= 0"):
        quant(torch.zeros(512), amax_floor=-1.0, reference=reference)
    with pytest.raises(ValueError, match="amax_floor must be finite and >= 0"):
        quant(torch.zeros(512), amax_floor=math.nan, reference=reference)
    with pytest.raises(TypeError, match="amax_floor must be a number"):
        quant(torch.zeros(512), amax_floor="1e-4", reference=reference)
    e = quant(torch.zeros(2, 512))
    with pytest.raises(ValueError, match="must have a last dimension of 584 bytes"):
        dequant(e[:, :576], reference=reference)
    with pytest.raises(ValueError, match="must have a last dimension of 520 bytes"):
        dequant(e, 512, 0, reference=reference)
    with pytest.raises(TypeError, match="entries must be uint8, got torch.int8"):
        dequant(e.view(torch.int8), reference=reference)
    with pytest.raises(ValueError, match="rope_dim must be in"):
        dequant(e, 512, -2, reference=reference)


def test_into_rejects_bad_buffers():
    x = torch.randn(4, 512)
    with pytest.raises(ValueError, match="must be contiguous"):
        formats.quantize_fp8_v4_into(x, torch.zeros(4, 1168, dtype=torch.uint8)[:, ::2], rope_dim=64)
    with pytest.raises(ValueError, match=r"entries has shape \(2, 584\), expected \(4, 584\)"):
        formats.quantize_fp8_v4_into(x, torch.zeros(2, 584, dtype=torch.uint8), rope_dim=64)
    with pytest.raises(TypeError, match="entries must be uint8"):
        formats.quantize_fp8_v4_into(x, torch.zeros(4, 584), rope_dim=64)


def test_the_cpp_op_checks_too():
    # C++ callers reach the op without the Python checks: it must refuse bad input itself.
    ops = torch.ops.dsv41
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.quantize_fp8_v4(torch.zeros(2, 512, dtype=torch.float64), 64, 1e-4)
    with pytest.raises(RuntimeError, match="must be a multiple of the 64-value scale tile"):
        ops.quantize_fp8_v4(torch.zeros(2, 500), 64, 1e-4)
    with pytest.raises(RuntimeError, match=r"rope_dim must be in \[0, head_dim=512\)"):
        ops.quantize_fp8_v4(torch.zeros(2, 512), -64, 1e-4)
    with pytest.raises(RuntimeError, match="amax_floor must be finite and >= 0"):
        ops.quantize_fp8_v4(torch.zeros(2, 512), 64, -1.0)
    with pytest.raises(RuntimeError, match="must have a last dimension of 584 bytes"):
        ops.dequantize_fp8_v4(torch.zeros(2, 583, dtype=torch.uint8), 512, 64)
    with pytest.raises(RuntimeError, match="entries must be uint8"):
        ops.dequantize_fp8_v4(torch.zeros(2, 584, dtype=torch.int8), 512, 64)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.quantize_fp8_v4_into(torch.zeros(2, 512), 64, 1e-4,
                                 torch.zeros(2, 1168, dtype=torch.uint8)[:, ::2])
    with pytest.raises(RuntimeError, match=r"expected \[2, 584\]"):
        ops.quantize_fp8_v4_into(torch.zeros(2, 512), 64, 1e-4, torch.zeros(3, 584, dtype=torch.uint8))


# ---- custom-op registration -------------------------------------------------------------

def test_ops_are_registered_custom_ops_with_fake_kernels(gen):
    x = torch.randn(3, 512, generator=gen)
    ops = torch.ops.dsv41
    torch.library.opcheck(ops.quantize_fp8_v4, (x, 64, 1e-4))
    e = ops.quantize_fp8_v4(x, 64, 1e-4)
    torch.library.opcheck(ops.dequantize_fp8_v4, (e, 512, 64))
    torch.library.opcheck(ops.quantize_fp8_v4_into, (x, 64, 1e-4, torch.empty_like(e)))


def test_ops_run_under_torch_compile(gen):
    def roundtrip(x):
        e = formats.quantize_fp8_v4(x * 2, rope_dim=64)
        return formats.dequantize_fp8_v4(e, head_dim=512, rope_dim=64) + 1

    x = torch.randn(5, 512, generator=gen)
    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), roundtrip(x))


# ---- CUDA (these run only where a GPU is present) --------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_cuda_kernel_matches_cpu_bits(case, gen):
    x = inputs(gen)[case].contiguous()
    got = quant(x.cuda())
    assert_same_bytes(got, quant(x))
    assert same_floats(dequant(got), dequant(quant(x)))


@pytest.mark.gpu
def test_cuda_nans_are_the_cpu_bits():
    assert same_floats(dequant(nan_entries().cuda()), dequant(nan_entries()))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,rope_dim", SHAPES)
def test_cuda_other_shapes_into_and_odd_sizes(head_dim, rope_dim, gen):
    lay = layout.fp8_v4_layout(head_dim, rope_dim)
    for rows in (1, 3, 257, 4099):  # grids that end mid-block
        x = torch.randn(rows, head_dim, generator=gen)
        want = quant(x, rope_dim)
        assert_same_bytes(quant(x.cuda(), rope_dim), want)
        buf = torch.full((rows, lay.entry_bytes), 0xAB, dtype=torch.uint8, device="cuda")
        formats.quantize_fp8_v4_into(x.cuda(), buf, rope_dim=rope_dim)
        assert_same_bytes(buf, want)
        assert same_floats(dequant(buf, head_dim, rope_dim), dequant(want, head_dim, rope_dim))
