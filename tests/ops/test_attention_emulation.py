"""The index arithmetic of the tensor-core attention kernel, checked on the CPU through a
line-by-line emulation of its CTAs (tests/ops/attention_emulator.py): swizzled layouts, raw
staging vs. dequantizer reads, permuted dims, ldmatrix lane addresses and mma fragments,
the online softmax across tiles and the split combine. Compared with a float64 attention
on the same dequantized inputs at bf16-level tolerance."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsv41 import formats

from . import attention_emulator as emu
from . import attention_wgmma_emulator as wg_emu
from .kernel_cases import attention_inputs

EMULATORS = pytest.mark.parametrize("kernel", [emu, wg_emu], ids=["mma", "wgmma"])


def _float64_reference(a):
    swa = formats.dequantize_fp8_swa(a["swa_values"], a["swa_scales"]).double()
    kv = formats.dequantize_nvfp4(a["kv_codes"], a["kv_scales"]).double()
    T, H, _ = a["q"].shape
    out = torch.zeros(T, H, a["q"].shape[2], dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    for t in range(T):
        keys = [swa[i] for i in a["swa_idx"][t].tolist() if 0 <= i < swa.shape[0]]
        keys += [kv[i] for i in a["kv_idx"][t].tolist() if 0 <= i < kv.shape[0]]
        if not keys:
            continue
        k = torch.stack(keys)
        s = a["q"][t].double() @ k.T * a["softmax_scale"]
        lse[t] = torch.logsumexp(s, -1)
        out[t] = torch.softmax(s, -1) @ k * torch.sigmoid(lse[t] - a["sink"].double())[:, None]
    return out, lse


@EMULATORS
@pytest.mark.parametrize("splits", [1, 3])
def test_emulated_kernel_matches_float64(kernel, splits, gen):
    a = attention_inputs(gen, 2, W=70, K=100, Ns=90, Ng=300, p_empty=0.2)
    a["kv_idx"][1, 40:] = -1  # fewer global entries than K for the second query
    out, lse = kernel.run(*a.values(), S=splits)
    ref_out, ref_lse = _float64_reference(a)
    np.testing.assert_allclose(lse, ref_lse.numpy(), rtol=0, atol=2e-2)
    err = np.abs(out - ref_out.numpy()).max()
    scale = np.abs(ref_out.numpy()).max()
    assert err < 2e-2 * scale, (err, scale)  # bf16 q and P: ~1e-3 relative expected
    # and the row layout is right: heads and dims land where they belong
    corr = np.corrcoef(out.ravel(), ref_out.numpy().ravel())[0, 1]
    assert corr > 0.9999


@EMULATORS
def test_emulated_kernel_no_valid_key(kernel, gen):
    a = attention_inputs(gen, 1, W=8, K=8, Ns=4, Ng=4)
    a["swa_idx"].fill_(-1)
    a["kv_idx"].fill_(-1)
    out, lse = kernel.run(*a.values())
    assert np.all(out == 0) and np.all(np.isneginf(lse))


# The emulator transcribes these expressions of the kernel; if the kernel changes them,
# this fails so that the emulator is updated with it (and keeps checking the real thing).
_TRANSCRIBED = [
    "return static_cast<uint32_t>(r * 1024 + ((c ^ (r & 7)) << 4));",
    "return static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) << 4));",
    "dst = raw + r * 512 + ((c ^ (r & 7)) << 4);",
    "dst = raw + kRawFp8Values + r * 16;",
    "dst = raw + r * 256 + ((c ^ (r & 7)) << 4);",
    "dst = raw + kRawNvfp4Codes + r * 32 + 16 * (c - 16);",
    "const int r = tid & 63, qq = tid >> 6;",
    "const uint32_t sc = ld_shared_b32(raw + kRawFp8Values + r * 16 + 4 * qq);",
    "const int c = 8 * qq + 2 * jb + jc;",
    "st_shared_v4(sK + qk_off(r, 2 * c + 1), o[0], o[1], o[2], o[3]);",
    "const uint2 sc = ld_shared_v2(raw + kRawNvfp4Codes + r * 32 + 8 * qq);",
    "const uint32_t f1 = dq::nvfp4_factor(static_cast<uint8_t>(sw >> (16 * (jc & 1) + 8)));",
    "st_shared_v4(sK + qk_off(r, 4 * c + 3), o[0], o[1], o[2], o[3]);",
    "const int b_row = skey0 + (lane & 7) + ((lane >> 4) << 3);",
    "a_off[j] = static_cast<uint32_t>(((2 * j + (lane >> 4)) ^ (a_row & 7)) << 4);",
    "b_off[j] = static_cast<uint32_t>(((2 * j + ((lane >> 3) & 1)) ^ (b_row & 7)) << 4);",
    "ldmatrix_x4(b1, b_base + 16 * 1024 + kofs + b_off[ks & 3]);",
    "const bool valid = skey0 + 8 * nt + 2 * qd + e < ti.rows;",
    "st_shared_b32(sP + p_off(srow0 + g + 8, chunk) + 4 * qd, dq::floats_to_bf16x2(p10, p11));",
    "const int v_key = (lane & 7) + (((lane >> 3) & 1) << 3);",
    "const uint32_t v_base = sK + v_key * 1024 + 128 * warp;",
    "ldmatrix_x4(pa[mt], pa_base + mt * 16 * 128 + (((2 * ks + (lane >> 4)) ^ lx) << 4));",
    "ldmatrix_x4_trans(vb, v_base + ks * 16 * 1024 + (((2 * np + (lane >> 4)) ^ lx) << 4));",
    "const int src0 = (2 * qd) & 3, src1 = (2 * qd + 1) & 3, hi = qd >> 1;",
    "const float a0 = __shfl_sync(0xFFFFFFFFu, x0, src0, 4), a1 = __shfl_sync(0xFFFFFFFFu, x1, src0, 4);",
    "const float b0 = __shfl_sync(0xFFFFFFFFu, x0, src1, 4), b1 = __shfl_sync(0xFFFFFFFFu, x1, src1, 4);",
    "const int dim = 8 * (8 * warp + nt) + 2 * qd;",
    "*reinterpret_cast<float2*>(dst + dim) = make_float2(hi ? a1 : a0, hi ? b1 : b0);",
]


def test_emulator_tracks_the_kernel_source():
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "csrc" / "cuda" / "attention_mma.cu").read_text()
    missing = [e for e in _TRANSCRIBED if e not in src]
    assert not missing, f"attention_mma.cu changed; update tests/ops/attention_emulator.py: {missing}"


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
    "const bool valid = skey0 + 8 * j + 2 * qd + e < ti.rows;",
    "st_shared_b32(sP + wg_off(srow0 + g + 8, chunk) + 4 * qd, dq::floats_to_bf16x2(p10, p11));",
    "wgmma::m64n256k16_ss_tb(o_acc, wgmma::desc_sw128(sP + ks * 32, 16, 1024),",
    "wgmma::desc_sw128(sK + (4 * wg) * kWgBlockBytes + ks * 2048, kWgBlockBytes, 1024), 1);",
    "const int dim = 8 * (32 * wg + j) + 2 * qd;",
]

# The shared-memory constants the emulator hard-codes, as config.h defines them.
_CONFIG_WGMMA = [
    "constexpr int kWgProducerThreads = 128;",
    "constexpr int kWgBlockBytes = kHeadsPerCta * 128;",
    "constexpr int kWgStageOff = kKBytes / 2;",
    "constexpr int kWgScaleBytes = kTileKeys * 32;",
    "constexpr int kWgOffK0 = kWgOffQ + kQBytes;",
    "constexpr int kWgOffK1 = kWgOffK0 + kKBytes;",
    "constexpr int kWgOffP = kWgOffK1 + kKBytes;",
    "constexpr int kWgOffScales0 = kWgOffP + kPBytes;",
]


def test_wgmma_emulator_tracks_the_kernel_source():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    src = (root / "csrc" / "cuda" / "attention_wgmma.cu").read_text()
    missing = [e for e in _TRANSCRIBED_WGMMA if e not in src]
    assert not missing, f"attention_wgmma.cu changed; update tests/ops/attention_wgmma_emulator.py: {missing}"
    cfg = (root / "include" / "dsv41" / "attention" / "config.h").read_text()
    missing = [e for e in _CONFIG_WGMMA if e not in cfg]
    assert not missing, f"attention/config.h changed; update tests/ops/attention_wgmma_emulator.py: {missing}"
    # the descriptor packing the emulator decodes is the header's
    hdr = (root / "include" / "dsv41" / "cuda" / "wgmma.h").read_text()
    assert "(static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32) | (uint64_t{1} << 62);" in hdr
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in hdr and "p, 1, 1, 0, 1;" in hdr


def test_wgmma_model_reads_the_canonical_layouts():
    """The wgmma model on its own, against matrices placed by hand (no kernel expression):
    a K-major [64 x 64] tile and its MN-major reading, through the 128-byte swizzle."""
    rng = np.random.default_rng(0)
    m = rng.standard_normal((64, 64)).astype(np.float32)
    bits = emu.bf16_bits(m.reshape(-1)).reshape(64, 64)
    sm = wg_emu.Smem()
    base = wg_emu.OFF_K0
    for r in range(64):
        for k in range(64):  # element (r, k): row r's 128-byte line, chunk k/8 swizzled
            a = base + r * 128 + ((((k >> 3) ^ (r & 7)) << 4) | (2 * (k & 7)))
            sm.b[a:a + 2] = np.array([bits[r, k]], np.uint16).view(np.uint8)
    mb = emu.bits_bf16(bits).astype(np.float64)
    ks = 2  # k-step 2: columns 32..47 (start + 64 bytes)
    a_tile = wg_emu._k_major(sm, wg_emu.desc_sw128(base + 2 * 16 * ks, 16, 1024), 64)
    assert np.array_equal(a_tile, mb[:, 16 * ks:16 * ks + 16])
    b_tile = wg_emu._mn_major(sm, wg_emu.desc_sw128(base + 16 * 128 * 1, 8192, 1024), 64)  # rows 16..31
    assert np.array_equal(b_tile, mb[16:32, :])
