"""The indexer kernel's fragment plumbing (csrc/cuda/indexer.cu), emulated on the CPU with
the ldmatrix/mma models of attention_emulator.py: queries decoded into the 256-byte-row
swizzled layout, each lane's B fragments built in registers from key g's pair q of every
group, head-sum by butterfly over the row lanes, validity fetched from the loading lane."""
from __future__ import annotations

import numpy as np
import torch

from dsv41 import formats

from .attention_cta import LANES, G, Q, Smem, bf16_bits, bits_bf16
from .attention_emulator import ldmatrix_x4, mma


def _pairs(vals8):  # 8 natural-order values -> 4 (i, i+4) bf16 pairs as uint32
    h = bf16_bits(np.stack([vals8[:4], vals8[4:]], 1).reshape(-1)).astype(np.uint32)
    return h[0::2] | (h[1::2] << 16)


def _smem_q_check(sm, rows):  # the natural-order q rows back out of the swizzled pair layout
    out = np.zeros((rows, 128), np.float32)
    for r in range(rows):
        for grp in range(16):
            a = r * 256 + ((grp ^ (r & 7)) << 4)
            h = sm.b[a:a + 16].view(np.uint16)
            v = np.asarray(bits_bf16(h), np.float32)
            out[r, 8 * grp:8 * grp + 4], out[r, 8 * grp + 4:8 * grp + 8] = v[0::2], v[1::2]
    return out


def emulate(q_codes, q_scales, w, k_codes, k_scales, key0=0, idx=None):
    T, Hi, _ = q_codes.shape
    qv = formats.dequantize_mxfp4(q_codes, q_scales).numpy()  # exact, = the fast decoder's values
    kv = formats.dequantize_mxfp4(k_codes, k_scales).numpy()
    N = kv.shape[0]
    n_cols = idx.shape[1] if idx is not None else N
    sm = Smem(1 << 18)
    rows = T * Hi
    codes = q_codes.reshape(rows, 64)
    scales = q_scales.view(torch.uint8).reshape(rows, 4)
    for u in range(rows * 4):  # the kernel's q items: one 32-value block (16 code bytes, one scale)
        r, blk = divmod(u, 4)
        block = codes[r, 16 * blk:16 * blk + 16]
        vals = formats.dequantize_mxfp4(block[None].contiguous(), scales[r, blk:blk + 1][None].contiguous())
        vals = vals.numpy().reshape(32)
        for x in range(4):  # word x of the 16-byte load = group 4 blk + x
            grp = 4 * blk + x
            words = _pairs(vals[8 * x:8 * x + 8])
            sm.b[r * 256 + ((grp ^ (r & 7)) << 4): r * 256 + ((grp ^ (r & 7)) << 4) + 16] = words.view(np.uint8)
    assert np.array_equal(qv.reshape(rows, 128), _smem_q_check(sm, rows)), "q items cover every group once"
    out = np.full((T, n_cols), np.nan, np.float32)
    for warp in range(8):
        kbase = key0 + warp * 16
        bk = np.zeros((2, 16, 32), np.uint32)
        col_ok = np.zeros((2, 32), bool)
        for j in range(2):
            for lane in range(32):
                col = kbase + 8 * j + G[lane]
                krow = -1
                if col < n_cols:
                    krow = int(idx[0, col]) if idx is not None else col
                    krow = krow if 0 <= krow < N else -1
                col_ok[j, lane] = krow >= 0
                vals = kv[krow] if krow >= 0 else np.zeros(128, np.float32)
                for grp in range(16):
                    bk[j, grp, lane] = _pairs(vals[8 * grp:8 * grp + 8])[Q[lane]]
        for tt in range(T if idx is None else 1):
            part = np.zeros((2, 2, 32))
            for mt in range(Hi // 16):
                rbase = tt * Hi + 16 * mt
                r = rbase + (LANES & 15)
                acc = np.zeros((2, 32, 4))
                for ks in range(8):
                    af = ldmatrix_x4(sm, r * 256 + (((2 * ks + (LANES >> 4)) ^ (r & 7)) << 4))
                    mma(acc[0], af, bk[0, 2 * ks], bk[0, 2 * ks + 1])
                    mma(acc[1], af, bk[1, 2 * ks], bk[1, 2 * ks + 1])
                w0, w1 = w.numpy()[tt, 16 * mt + G], w.numpy()[tt, 16 * mt + G + 8]
                for j in range(2):
                    for e in range(2):
                        part[j, e] += w0 * np.maximum(acc[j, :, e], 0) + w1 * np.maximum(acc[j, :, 2 + e], 0)
            part = part.reshape(2, 2, 8, 4).sum(2)  # butterfly over g: lanes with equal q
            for j in range(2):
                for e in range(2):
                    for qd in range(4):
                        key = 2 * qd + e
                        ok = col_ok[j, 4 * key]
                        col = kbase + 8 * j + key
                        if col < n_cols:
                            out[tt, col] = part[j, e, qd] if (idx is None or ok) else -np.inf
    return out


def _inputs(T, N, seed):
    g = torch.Generator().manual_seed(seed)
    qc, qs = formats.quantize_mxfp4(torch.randn(T, 32, 128, generator=g))
    kc, ks = formats.quantize_mxfp4(torch.randn(N, 128, generator=g))
    return qc, qs, torch.randn(T, 32, generator=g) * 0.02, kc, ks


def _float64(qc, qs, w, kc, ks):
    q = formats.dequantize_mxfp4(qc, qs).double()
    k = formats.dequantize_mxfp4(kc, ks).double()
    return (torch.relu(torch.einsum("thd,nd->thn", q, k)) * w.double()[..., None]).sum(1).numpy()


def test_emulated_indexer_scores():
    args = _inputs(2, 100, 1)
    got = emulate(*args)
    np.testing.assert_allclose(got, _float64(*args), rtol=1e-5, atol=1e-6)


def test_emulated_indexer_scores_at():
    qc, qs, w, kc, ks = _inputs(1, 300, 2)
    idx = torch.randint(0, 300, (1, 120), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    idx[0, 5] = -1
    idx[0, 100:] = -1
    got = emulate(qc, qs, w, kc, ks, idx=idx)
    full = _float64(qc, qs, w, kc, ks)[0]
    want = np.where(idx[0].numpy() >= 0, full[idx[0].clamp(min=0).numpy()], -np.inf)
    assert np.array_equal(np.isneginf(got[0]), np.isneginf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[0][fin], want[fin], rtol=1e-5, atol=1e-6)


# The kernel's q-decode expressions the emulator transcribes (drift guard).
_TRANSCRIBED_Q = [
    "for (int u = tid; u < rows * (kGroups / 4); u += kThreads) {",
    "const int r = u / (kGroups / 4), blk = u - r * (kGroups / 4);",
    "const uint8_t* c = p.q_codes + qrow * (kDi / 2) + 16 * blk;",
    "w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;",
    "const dq::Pow2Factor f = dq::ue8m0_factor(p.q_scales[qrow * (kDi / 32) + blk], dq::kE2M1PatternBias);",
    "const int grp = 4 * blk + x;",
    "dq::mxfp4_group8(w[x], f, o);",
    "ptx::st_shared_v4(sQ + r * 256 + ((grp ^ (r & 7)) << 4), o[0], o[1], o[2], o[3]);",
]


def test_emulator_tracks_the_q_decode():
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "csrc" / "cuda" / "indexer.cu").read_text()
    missing = [e for e in _TRANSCRIBED_Q if e not in src]
    assert not missing, f"indexer.cu changed; update tests/ops/test_indexer_emulation.py: {missing}"
