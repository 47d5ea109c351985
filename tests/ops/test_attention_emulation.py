"""The index arithmetic of the tensor-core attention kernels, checked on the CPU through
line-by-line emulations of their CTAs (tests/ops/attention_emulator.py: mma.sync, every
head dim it is instantiated for; attention_wgmma_emulator.py: wgmma): swizzled layouts, raw
staging vs. dequantizer reads, permuted dims, ldmatrix lane addresses and mma fragments,
warp roles per head dim, padding head rows, the online softmax across tiles and the split
combine. Compared with the op's float64 reference (dsv41.ops.reference) with the kernel
tests' tolerance idiom: error <= 2x the same math in bf16 torch + a small absolute term."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41._ext import _C
from dsv41.config import PRESETS
from dsv41.ops import reference

from . import attention_emulator as emu
from . import attention_wgmma_emulator as wg_emu
from .attention_cta import Smem, bf16_bits, bits_bf16, config
from .kernel_cases import assert_within_bf16_error, attention_inputs, bf16_attention

# (H, D) of every preset, and 72 heads at D = 128: a second head group with 8 live rows.
MMA_SHAPES = sorted({(c.num_heads, c.head_dim) for c in PRESETS.values()} | {(72, 128)})


def _check(kernel, a, splits, what):
    out, lse = kernel.run(*a.values(), S=splits)
    ref_out, ref_lse = reference.sparse_attention(*a.values())
    base_out, base_lse = bf16_attention(a)
    assert_within_bf16_error(torch.from_numpy(lse), ref_lse, base_lse, 2e-4, f"lse {what}")
    assert_within_bf16_error(torch.from_numpy(out), ref_out, base_out, 2e-4, f"out {what}")
    # and the row layout is right: heads and dims land where they belong
    corr = np.corrcoef(out.ravel(), ref_out.numpy().ravel())[0, 1]
    assert corr > 0.9999


def _inputs(gen, H, D):
    a = attention_inputs(gen, 2, H=H, D=D, W=70, K=100, Ns=90, Ng=300, p_empty=0.2)
    a["kv_idx"][1, 40:] = -1  # fewer global entries than K for the second query
    return a


def test_every_preset_head_dim_has_a_tensor_core_kernel():
    for cfg in PRESETS.values():
        c = _C.kernels.attention_config(cfg.head_dim)  # raises for a head dim without one
        assert c["kHeadDim"] == cfg.head_dim and c["kSmemBytes"] * c["kMinCtasPerSm"] <= 232448


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("H,D", MMA_SHAPES)
def test_emulated_mma_kernel_matches_the_reference(H, D, splits, gen):
    _check(emu, _inputs(gen, H, D), splits, f"mma H={H} D={D} S={splits}")


@pytest.mark.parametrize("splits", [1, 3])
def test_emulated_wgmma_kernel_matches_the_reference(splits, gen):
    _check(wg_emu, _inputs(gen, 64, 512), splits, f"wgmma S={splits}")


@pytest.mark.parametrize("kernel,H,D", [(emu, 64, 512), (emu, 4, 64), (wg_emu, 64, 512)],
                         ids=["mma512", "mma64", "wgmma"])
def test_emulated_kernel_no_valid_key(kernel, H, D, gen):
    a = attention_inputs(gen, 1, H=H, D=D, W=8, K=8, Ns=4, Ng=4)
    a["swa_idx"].fill_(-1)
    a["kv_idx"].fill_(-1)
    out, lse = kernel.run(*a.values())
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("slip", ["q/K swizzle", "dequant units", "raw swizzle mask"])
def test_emulation_catches_a_slip(D, slip, gen, monkeypatch):
    """The comparison is sharp enough to see one wrong expression at the small head dims."""
    c = dict(config(D))
    if slip == "q/K swizzle":
        monkeypatch.setattr(emu, "qk_off", lambda c, r, ch: r * c["kRowBytes"] + (ch << 4))
    elif slip == "dequant units":  # each thread decodes half its share
        c["kDqUnits"] = c["kDqUnits"] // 2 or 1
        if D == 64:
            pytest.skip("one unit per thread at D = 64: nothing to halve")
    else:  # the 8-chunk mask on rows of fewer chunks: rows overlap in the raw tile
        c["kFp8Swz"] = c["kNvfp4Swz"] = 7
    monkeypatch.setattr(emu, "config", lambda d: c)
    with pytest.raises(AssertionError):
        _check(emu, _inputs(gen, 8 if D == 128 else 4, D), 1, slip)


# The emulator transcribes these expressions of the kernel; if the kernel changes them,
# this fails so that the emulator is updated with it (and keeps checking the real thing).
_TRANSCRIBED = [
    "return static_cast<uint32_t>(r * MmaTile<kD>::kRowBytes + ((c ^ (r & 7)) << 4));",
    "return static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) << 4));",
    "const int h = u / (kD / 8), g = u % (kD / 8);",
    "constexpr int kPer = C::kFp8Chunks + 1;  // value chunks + the scale row",
    "cp_async_16(raw + r * kD + ((c ^ (r & C::kFp8Swz)) << 4),",
    "copy_scales<C::kFp8ScaleBytes>(raw + C::kRawFp8Values + r * C::kFp8ScaleStride,",
    "constexpr int kPer = C::kNvfp4Chunks + kPieces;  // code chunks + scale pieces",
    "cp_async_16(raw + r * (kD / 2) + ((c ^ (r & C::kNvfp4Swz)) << 4),",
    "raw + C::kRawNvfp4Codes + r * C::kNvfp4ScaleStride + C::kNvfp4ScalePiece * k,",
    "const int r = tid & 63, qq = tid >> 6;",
    "const int u0 = kU * qq;",
    "const uint32_t sw = ld_shared_b32(raw + C::kRawFp8Values + r * C::kFp8ScaleStride + 4 * (u0 >> 3)) >>",
    "(8 * ((u0 >> 1) & 3));",
    "for (int jb = 0; jb < (kU + 1) / 2; ++jb) {",
    "for (int jc = 0; jc < (kU < 2 ? kU : 2); ++jc) {",
    "const int c = u0 + 2 * jb + jc;",
    "const uint4 v = ld_shared_v4(raw + r * kD + ((c ^ (r & C::kFp8Swz)) << 4));",
    "st_shared_v4(sK + qk_off<kD>(r, 2 * c + 1), o[0], o[1], o[2], o[3]);",
    "const uint2 sc = ld_shared_v2(raw + C::kRawNvfp4Codes + r * C::kNvfp4ScaleStride + 8 * (u0 >> 3));",
    "const uint64_t s64 = ((static_cast<uint64_t>(sc.y) << 32) | sc.x) >> (8 * (u0 & 7));",
    "const int c = (u0 >> 1) + jc;",
    "const uint32_t f1 = dq::nvfp4_factor(static_cast<uint8_t>(s64 >> (16 * jc + 8)));",
    "st_shared_v4(sK + qk_off<kD>(r, 4 * c + 3), o[0], o[1], o[2], o[3]);",
    "const uint2 v = ld_shared_v2(raw + r * (kD / 2) + ((c ^ (r & C::kNvfp4Swz)) << 4) + 8 * (u0 & 1));",
    "ld_shared_b32(raw + C::kRawNvfp4Codes + r * C::kNvfp4ScaleStride + 4 * (u0 >> 2)) >> (8 * (u0 & 3))));",
    "st_shared_v4(sK + qk_off<kD>(r, 2 * u0 + 1), o[0], o[1], o[2], o[3]);",
    "const bool s_live = srow0 < n_heads;",
    "const int mt0 = (warp / C::kPvDimGroups) * C::kOMt;",
    "const int oc0 = (warp % C::kPvDimGroups) * C::kONt;",
    "const int b_row = skey0 + (lane & 7) + ((lane >> 4) << 3);",
    "a_off[j] = static_cast<uint32_t>(((2 * j + (lane >> 4)) ^ (a_row & 7)) << 4);",
    "b_off[j] = static_cast<uint32_t>(((2 * j + ((lane >> 3) & 1)) ^ (b_row & 7)) << 4);",
    "ldmatrix_x4(b1, b_base + 16 * C::kRowBytes + kofs + b_off[ks & 3]);",
    "st_shared_b32(sP + p_off(srow0 + g + 8, chunk) + 4 * qd, dq::floats_to_bf16x2(p10, p11));",
    "const int v_key = (lane & 7) + (((lane >> 3) & 1) << 3);",
    "const uint32_t v_base = sK + v_key * C::kRowBytes;",
    "ldmatrix_x4(pa[mt], pa_base + (mt0 + mt) * 16 * 128 + (((2 * ks + (lane >> 4)) ^ lx) << 4));",
    "ldmatrix_x4_trans(vb, v_base + ks * 16 * C::kRowBytes + (((oc0 + 2 * np + (lane >> 4)) ^ lx) << 4));",
    "store_row_pair(dst, 8 * (oc0 + nt) + 2 * qd, qd, o_acc[mt][nt][2 * rr] * sc,",
]

# attention_cta.cuh: what both kernels share (tests/ops/attention_cta.py transcribes it).
_TRANSCRIBED_CTA = [
    "const bool valid = skey0 + 8 * j + 2 * qd + e < rows;",
    "m_use[rr] = m_new == -INFINITY ? 0.f : m_new;",
    "lse = (m + log2f(lt)) * kLn2;",
    "if (!kSplit) scale *= 1.f / (1.f + expf(sink - lse));",
    "const int src0 = (2 * qd) & 3, src1 = (2 * qd + 1) & 3, hi = qd >> 1;",
    "if (live) *reinterpret_cast<float2*>(dst + dim) = make_float2(hi ? a1 : a0, hi ? b1 : b0);",
    "const int per = (n_tiles + S - 1) / S;",
]


def test_emulator_tracks_the_kernel_source():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "csrc" / "cuda"
    src = (root / "attention_mma.cuh").read_text()
    missing = [e for e in _TRANSCRIBED if e not in src]
    assert not missing, f"attention_mma.cuh changed; update tests/ops/attention_emulator.py: {missing}"
    src = (root / "attention_cta.cuh").read_text()
    missing = [e for e in _TRANSCRIBED_CTA if e not in src]
    assert not missing, f"attention_cta.cuh changed; update tests/ops/attention_cta.py: {missing}"


_TRANSCRIBED_WGMMA = [
    "return static_cast<uint32_t>((c >> 3) * kWgBlockBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4));",
    "st_shared_v4(sQ + wg_off(h, g), dq::floats_to_bf16x2(lo.x, hi.x), dq::floats_to_bf16x2(lo.y, hi.y),",
    # producer: cp.async pieces, stage and scale buffers, parity, the two decode phases
    "for (int u = ptid; u < kTileKeys * 33; u += kWgProducerThreads) {",
    "const int r = u / 33, c = u - r * 33;",
    "src = p.swa_values + row * p.swa_values_stride + 16 * c;",
    "dst = stage + r * 512 + ((c ^ (r & 7)) << 4);",
    "src = p.swa_scales + row * p.swa_scales_stride;",
    "dst = sSc + r * 16;",
    "for (int u = ptid; u < kTileKeys * 18; u += kWgProducerThreads) {",
    "const int r = u / 18, c = u - r * 18;",
    "src = p.kv_codes + row * p.kv_codes_stride + 16 * c;",
    "dst = stage + r * 256 + ((c ^ (r & 7)) << 4);",
    "src = p.kv_scales + row * p.kv_scales_stride + 16 * (c - 16);",
    "dst = sSc + r * 32 + 16 * (c - 16);",
    "ptx::cp_async_16(dst, src, ok ? 16u : 0u);",
    "for (int j = 0; j < 8; ++j) raw.v[j] = ld_shared_v4(stage + r * 512 + (((8 * qq + j) ^ (r & 7)) << 4));",
    "raw.sc = make_uint2(ld_shared_b32(sSc + r * 16 + 4 * qq), 0u);",
    "for (int j = 0; j < 4; ++j) raw.v[j] = ld_shared_v4(stage + r * 256 + (((4 * qq + j) ^ (r & 7)) << 4));",
    "raw.sc = ld_shared_v2(sSc + r * 32 + 8 * qq);",
    "const int r_dq = ptid & 63, h_dq = ptid >> 6;",
    "const int b = (j - tb) & 1;",
    "const uint32_t sK = sK0 + b * kKBytes;",
    "const uint32_t stage = sK + kWgStageOff;",
    "const uint32_t sSc = sScales0 + b * kWgScaleBytes;",
    "if (j - tb >= 2) ptx::bar_sync(kWgBarEmpty0 + b, kWgThreads);",
    "read_share(stage, sSc, tj.kv, r_dq, h_dq, raw);",
    "store_share(sK, tj.kv, r_dq, h_dq, raw);",
    "read_share(stage, sSc, tj.kv, r_dq, 2 + h_dq, raw);",
    "store_share(sK, tj.kv, r_dq, 2 + h_dq, raw);",
    "const int b = (i - tb) & 1;",
    "ptx::bar_sync(kWgBarFull0 + b, kWgThreads);",
    "if (i + 2 < te) ptx::bar_arrive(kWgBarEmpty0 + b, kWgThreads);",
    # the decoders
    "const int c = 8 * qq + 2 * jb + jc;  // 16-value chunk of the row",
    "const uint4 v = raw.v[2 * jb + jc];",
    "st_shared_v4(sK + wg_off(r, 2 * c + 1), o[0], o[1], o[2], o[3]);",
    "const uint32_t sw = jc < 2 ? raw.sc.x : raw.sc.y;",
    "const uint32_t f1 = dq::nvfp4_factor(static_cast<uint8_t>(sw >> (16 * (jc & 1) + 8)));",
    "st_shared_v4(sK + wg_off(r, 4 * c + 3), o[0], o[1], o[2], o[3]);",
    # consumers
    "const uint32_t kofs = (ks >> 2) * kWgBlockBytes + (ks & 3) * 32;",
    "wgmma::m64n32k16_ss(s_acc, wgmma::desc_sw128(sQ + kofs, 16, 1024),",
    "wgmma::desc_sw128(sK + skey0 * 128 + kofs, 16, 1024), 1);",
    "scale_mask_rowmax(s_acc, skey0, qd, ti.rows, c_tile, mx);",
    "st_shared_b32(sP + wg_off(srow0 + g + 8, chunk) + 4 * qd, dq::floats_to_bf16x2(p10, p11));",
    "wgmma::m64n256k16_ss_tb(o_acc, wgmma::desc_sw128(sP + ks * 32, 16, 1024),",
    "wgmma::desc_sw128(sK + (4 * wg) * kWgBlockBytes + ks * 2048, kWgBlockBytes, 1024), 1);",
    "store_row_pair(dst, 8 * (32 * wg + j) + 2 * qd, qd, o_acc[4 * j + 2 * rr] * sc, o_acc[4 * j + 2 * rr + 1] * sc);",
]

def test_wgmma_emulator_tracks_the_kernel_source():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    src = (root / "csrc" / "cuda" / "attention_wgmma.cu").read_text()
    missing = [e for e in _TRANSCRIBED_WGMMA if e not in src]
    assert not missing, f"attention_wgmma.cu changed; update tests/ops/attention_wgmma_emulator.py: {missing}"
    # the descriptor packing the emulator decodes is the header's
    hdr = (root / "include" / "dsv41" / "cuda" / "wgmma.h").read_text()
    assert "(static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32) | (uint64_t{1} << 62);" in hdr
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in hdr and "p, 1, 1, 0, 1;" in hdr


def test_wgmma_model_reads_the_canonical_layouts():
    """The wgmma model on its own, against matrices placed by hand (no kernel expression):
    a K-major [64 x 64] tile and its MN-major reading, through the 128-byte swizzle."""
    rng = np.random.default_rng(0)
    m = rng.standard_normal((64, 64)).astype(np.float32)
    bits = bf16_bits(m.reshape(-1)).reshape(64, 64)
    sm = Smem(wg_emu.SMEM)
    base = wg_emu.OFF_K0
    for r in range(64):
        for k in range(64):  # element (r, k): row r's 128-byte line, chunk k/8 swizzled
            a = base + r * 128 + ((((k >> 3) ^ (r & 7)) << 4) | (2 * (k & 7)))
            sm.b[a:a + 2] = np.array([bits[r, k]], np.uint16).view(np.uint8)
    mb = bits_bf16(bits).astype(np.float64)
    ks = 2  # k-step 2: columns 32..47 (start + 64 bytes)
    a_tile = wg_emu._k_major(sm, wg_emu.desc_sw128(base + 2 * 16 * ks, 16, 1024), 64)
    assert np.array_equal(a_tile, mb[:, 16 * ks:16 * ks + 16])
    b_tile = wg_emu._mn_major(sm, wg_emu.desc_sw128(base + 16 * 128 * 1, 8192, 1024), 64)  # rows 16..31
    assert np.array_equal(b_tile, mb[16:32, :])
