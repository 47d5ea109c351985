"""A numpy emulation of csrc/cuda/attention_wgmma.cu (one CTA at a time), the counterpart of
attention_emulator.py for the wgmma kernel.

The kernel's index arithmetic runs here as written in the .cu file (wg_off, the producer
warpgroup's cp.async pieces into the stage in the upper half of the next K buffer and into
the scale buffer, its two-phase decode shares, the K/scale buffer parity, the descriptor
start addresses and byte offsets, the accumulator fragment indices, the epilogue shuffles)
against a byte-addressed shared memory. The producer runs on the earliest schedule its
barriers allow (tile i+2 right after the P V of tile i), and a phase-1 store into the live
stage fails at once, so a wrong parity, stage offset or phase split shows up. wgmma is
modelled from the PTX ISA's description, independently of the kernel's expressions: the
64-bit descriptor is unpacked into its fields, every element's address is computed from
the canonical 128-byte-swizzled layouts (K-major: 8-row atoms of 128-byte rows, SBO
between atoms; MN-major: 64 elements per 128-byte row, LBO between 64-element blocks, SBO
between 8-row k groups), the swizzle XORs address bits 4-6 with bits 7-9, and the product
lands in the documented accumulator fragment (warp w of the warpgroup: rows 16w + lane/4
(+8), columns 8j + 2(lane%4) (+1)). A slip in a layout, a descriptor field or a fragment
index shows up as a wrong result. What the emulation cannot show is a misreading of the
ISA shared by kernel and model: that needs the GPU run (docs/kernels.md).
"""
from __future__ import annotations

import numpy as np

from .attention_cta import (LOG2E, G, KeyList, Pools, Q, Smem, bf16_bits, config, decode_fp8_bytes,
                            decode_nvfp4_bytes, merge_splits, probabilities, row_lse_scale, scale_mask_rowmax,
                            store_group, store_q, store_row_pair, update_row_max)

C = config(512)  # the wgmma kernel's layout (D = 512 only): config.h's kWg* constants
BLOCK = C["kWgBlockBytes"]
OFF_Q, OFF_K0, OFF_K1, OFF_P = C["kWgOffQ"], C["kWgOffK0"], C["kWgOffK1"], C["kWgOffP"]
K_BYTES = C["kKBytes"]
STAGE_OFF = C["kWgStageOff"]      # raw values of a tile in the upper half of its K buffer
SCALE_BYTES = C["kWgScaleBytes"]
OFF_SC0 = C["kWgOffScales0"]      # [2][SCALE_BYTES]
SMEM = OFF_SC0 + 2 * SCALE_BYTES
PRODUCER_THREADS = C["kWgProducerThreads"]


def wg_off(r, c):
    return (c >> 3) * BLOCK + r * 128 + (((c & 7) ^ (r & 7)) << 4)


def desc_sw128(addr, lbo, sbo):  # dsv41/cuda/wgmma.h
    return (((addr & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16) | (((sbo & 0x3FFFF) >> 4) << 32) | (1 << 62))


# ---- the wgmma model (PTX ISA), shared by both shapes --------------------------------------

def _fields(desc: int):
    assert desc >> 62 == 1, "only the 128-byte swizzle is modelled"
    assert (desc >> 49) & 7 == 0, "base offset must be 0"
    return (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4


def _swizzle128(addr):
    return addr ^ (((addr >> 7) & 7) << 4)


def _k_major(sm: Smem, desc: int, rows: int) -> np.ndarray:
    """[rows, 16] bf16 of a K-major operand: element (mn, k) at start + (mn/8) SBO +
    (mn%8) 128 + 2k, swizzled."""
    start, _, sbo = _fields(desc)
    mn, k = np.meshgrid(np.arange(rows), np.arange(16), indexing="ij")
    return sm.bf16_at(_swizzle128(start + (mn // 8) * sbo + (mn % 8) * 128 + 2 * k))


def _mn_major(sm: Smem, desc: int, cols: int) -> np.ndarray:
    """[16, cols] bf16 of an MN-major operand: element (k, mn) at start + (mn/64) LBO +
    (k/8) SBO + (k%8) 128 + 2 (mn%64), swizzled."""
    start, lbo, sbo = _fields(desc)
    k, mn = np.meshgrid(np.arange(16), np.arange(cols), indexing="ij")
    return sm.bf16_at(_swizzle128(start + (mn // 64) * lbo + (k // 8) * sbo + (k % 8) * 128 + 2 * (mn % 64)))


def wgmma(sm: Smem, acc: np.ndarray, desc_a: int, desc_b: int, n: int, tnsp_b: int, scale_d: int):
    """acc [4 warps, 32 lanes, n/2] (+)= A[64,16] B[16,n], float32 accumulation modelled in
    float64 then rounded (the order of the hardware's sums is not modelled)."""
    a = _k_major(sm, desc_a, 64).astype(np.float64)
    b = (_mn_major(sm, desc_b, n) if tnsp_b else _k_major(sm, desc_b, n).T).astype(np.float64)
    c = a @ b
    out = acc if scale_d else np.zeros_like(acc)
    for w in range(4):
        for j in range(n // 8):
            for h in range(2):
                for e in range(2):
                    out[w, :, 4 * j + 2 * h + e] += c[16 * w + G + 8 * h, 8 * j + 2 * Q + e]
    acc[...] = out.astype(np.float32)


# ---- the kernel -----------------------------------------------------------------------------

def run_cta(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, t, S=1, split=0, h0=0):
    T, H, D = q.shape
    assert D == 512 and H % 64 == 0, "the wgmma kernel's shapes (its plan refuses others)"
    sm = Smem(SMEM)
    pools = Pools(swa_values, swa_scales, kv_codes, kv_scales)
    store_q(sm, q[t, h0:h0 + 64].numpy(), 64, 512, lambda h, g: OFF_Q + wg_off(h, g))
    kl = KeyList(swa_idx[t], kv_idx[t], pools.swa_v.shape[0], pools.kv_c.shape[0], S, split)
    s_idx, tb, te = kl.s_idx, kl.tb, kl.te

    def stage_tile(j, stage, sSc):  # stage_tile: the cp.async pieces of every producer thread
        first, rows, kv = kl.tile(j)
        per_row = 18 if kv else 33
        for ptid in range(PRODUCER_THREADS):
            for u in range(ptid, 64 * per_row, PRODUCER_THREADS):
                r, c = divmod(u, per_row)
                ok = r < rows
                row = s_idx[first + r] if ok else 0
                if not kv:
                    if c < 32:
                        src, dst = pools.swa_v[row, 16 * c:16 * c + 16], stage + r * 512 + ((c ^ (r & 7)) << 4)
                    else:
                        src, dst = pools.swa_s[row, 0:16], sSc + r * 16
                else:
                    if c < 16:
                        src, dst = pools.kv_c[row, 16 * c:16 * c + 16], stage + r * 256 + ((c ^ (r & 7)) << 4)
                    else:
                        src, dst = pools.kv_s[row, 16 * (c - 16):16 * (c - 16) + 16], sSc + r * 32 + 16 * (c - 16)
                sm.b[dst:dst + 16] = src if ok else 0  # src-size 0: zero fill

    def read_share(stage, sSc, kv, r, qq):
        if not kv:
            v = np.concatenate([sm.ld(stage + r * 512 + (((8 * qq + j) ^ (r & 7)) << 4), 16) for j in range(8)])
            return v, sm.ld(sSc + r * 16 + 4 * qq, 4)
        v = np.concatenate([sm.ld(stage + r * 256 + (((4 * qq + j) ^ (r & 7)) << 4), 16) for j in range(4)])
        return v, sm.ld(sSc + r * 32 + 8 * qq, 8)

    def store_share(sK, kv, r, qq, raw):
        v, sc = raw
        if not kv:
            for jb in range(4):
                for jc in range(2):
                    c = 8 * qq + 2 * jb + jc
                    j = 2 * jb + jc
                    vals = decode_fp8_bytes(v[16 * j:16 * j + 16], int(sc[jb]))
                    store_group(sm, sK + wg_off(r, 2 * c), vals[:8])
                    store_group(sm, sK + wg_off(r, 2 * c + 1), vals[8:])
        else:
            for jc in range(4):
                c = 4 * qq + jc
                # sw = .x (bytes 0-3) or .y (4-7); f0, f1 = its bytes 2(jc&1), 2(jc&1)+1
                f0 = int(sc[4 * (jc >= 2) + 2 * (jc & 1)])
                f1 = int(sc[4 * (jc >= 2) + 2 * (jc & 1) + 1])
                cb = v[16 * jc:16 * jc + 16]
                v0 = decode_nvfp4_bytes(cb[:8], f0)
                v1 = decode_nvfp4_bytes(cb[8:], f1)
                for x, vals in enumerate((v0[:8], v0[8:], v1[:8], v1[8:])):
                    store_group(sm, sK + wg_off(r, 4 * c + x), vals)

    def produce(j):  # the producer warpgroup's iteration j: stage, then decode in two phases
        b = (j - tb) & 1
        sK = OFF_K0 + b * K_BYTES
        stage = sK + STAGE_OFF
        sSc = OFF_SC0 + b * SCALE_BYTES
        stage_tile(j, stage, sSc)
        kv = kl.tile(j)[2]
        sm.guard = (stage, sK + K_BYTES)  # phase 1 must write below the stage only
        for ptid in range(PRODUCER_THREADS):
            r_dq, h_dq = ptid & 63, ptid >> 6
            store_share(sK, kv, r_dq, h_dq, read_share(stage, sSc, kv, r_dq, h_dq))
        sm.guard = None
        # phase 2: every producer thread reads its share, the producer barrier, then the stores
        raws = [read_share(stage, sSc, kv, ptid & 63, 2 + (ptid >> 6)) for ptid in range(PRODUCER_THREADS)]
        for ptid in range(PRODUCER_THREADS):
            store_share(sK, kv, ptid & 63, 2 + (ptid >> 6), raws[ptid])

    # per-thread state: [warpgroup, warp in it, lane, ...]
    m_run = np.full((2, 4, 32, 2), -np.inf, np.float32)
    l_run = np.zeros((2, 4, 32, 2), np.float32)
    o_acc = np.zeros((2, 4, 32, 128), np.float32)
    s_red = np.zeros(128, np.float32)

    # The schedule is the earliest one the barriers allow the producer: tiles tb and tb+1
    # before any consumer work (no EMPTY wait), tile i+2 as soon as the P V of tile i has
    # released its buffer, i.e. before the consumers' S of tile i+1. A wrong buffer parity
    # or stage offset overwrites data the consumers still read.
    for j in range(tb, min(te, tb + 2)):
        produce(j)
    for i in range(tb, te):
        b = (i - tb) & 1
        sK = OFF_K0 + b * K_BYTES
        _, rows, kv = kl.tile(i)
        s_acc = np.zeros((2, 4, 32, 16), np.float32)
        for wg in range(2):
            skey0 = 32 * wg
            for ks in range(32):
                kofs = (ks >> 2) * BLOCK + (ks & 3) * 32
                wgmma(sm, s_acc[wg], desc_sw128(OFF_Q + kofs, 16, 1024),
                      desc_sw128(sK + skey0 * 128 + kofs, 16, 1024), 32, 0, 1)
        c_tile = np.float32(scale * LOG2E * (256.0 if kv else 1.0))
        pshift = np.float32(8.0 if kv else 0.0)
        mx_all = np.zeros((2, 4, 32, 2), np.float32)
        for wg in range(2):
            for wl in range(4):
                mx_all[wg, wl] = mx = scale_mask_rowmax(s_acc[wg, wl], 32 * wg, rows, c_tile)
                for lane in range(0, 32, 4):
                    s_red[wg * 64 + 16 * wl + lane // 4] = mx[lane, 0]
                    s_red[wg * 64 + 16 * wl + lane // 4 + 8] = mx[lane, 1]
        # B1
        for wg in range(2):
            skey0 = 32 * wg
            for wl in range(4):
                srow0 = 16 * wl
                other = np.stack([s_red[(wg ^ 1) * 64 + srow0 + G], s_red[(wg ^ 1) * 64 + srow0 + G + 8]], 1)
                alpha, m_use = update_row_max(m_run[wg, wl], mx_all[wg, wl], other)
                p = probabilities(s_acc[wg, wl], m_use, pshift)
                lsum = np.stack([p[:, [0, 1, 4, 5, 8, 9, 12, 13]].sum(1), p[:, [2, 3, 6, 7, 10, 11, 14, 15]].sum(1)], 1)
                for j in range(4):
                    chunk = (skey0 >> 3) + j
                    for lane in range(32):
                        r0 = srow0 + G[lane]
                        sm.st32(OFF_P + wg_off(r0, chunk) + 4 * Q[lane], *bf16_bits(p[lane, 4 * j:4 * j + 2]))
                        sm.st32(OFF_P + wg_off(r0 + 8, chunk) + 4 * Q[lane], *bf16_bits(p[lane, 4 * j + 2:4 * j + 4]))
                lscale = np.float32(1 / 256 if kv else 1)
                l_run[wg, wl] = l_run[wg, wl] * alpha + lsum * lscale
                o_acc[wg, wl, :, 0::4] *= alpha[:, :1]
                o_acc[wg, wl, :, 1::4] *= alpha[:, :1]
                o_acc[wg, wl, :, 2::4] *= alpha[:, 1:]
                o_acc[wg, wl, :, 3::4] *= alpha[:, 1:]
        # B2: P V
        for wg in range(2):
            for ks in range(4):
                wgmma(sm, o_acc[wg], desc_sw128(OFF_P + ks * 32, 16, 1024),
                      desc_sw128(sK + (4 * wg) * BLOCK + ks * 2048, BLOCK, 1024), 256, 1, 1)
        if i + 2 < te:  # EMPTY[b] -> the producer's iteration i+2
            produce(i + 2)
    # epilogue
    s_l = np.zeros(128, np.float32)
    for wg in range(2):
        for wl in range(4):
            lr = l_run[wg, wl].reshape(8, 4, 2).sum(1)
            for gg in range(8):
                s_l[wg * 64 + 16 * wl + gg] = lr[gg, 0]
                s_l[wg * 64 + 16 * wl + gg + 8] = lr[gg, 1]
    scale_row = np.zeros(64, np.float32)
    lse_row = np.zeros(64, np.float32)
    for wl in range(4):
        for gg in range(8):
            for rr in range(2):
                row = 16 * wl + gg + 8 * rr
                lse_row[row], scale_row[row] = row_lse_scale(s_l[row] + s_l[64 + row], m_run[0, wl, 4 * gg, rr],
                                                             sink[h0 + row], S > 1)
    out = np.full((64, 512), np.nan, np.float32)
    for wg in range(2):
        for wl in range(4):
            for rr in range(2):
                rows = 16 * wl + G + 8 * rr
                sc = scale_row[rows]
                for j in range(32):
                    x0 = (o_acc[wg, wl, :, 4 * j + 2 * rr] * sc).astype(np.float32)
                    x1 = (o_acc[wg, wl, :, 4 * j + 2 * rr + 1] * sc).astype(np.float32)
                    store_row_pair(out, rows, 32 * wg + j, x0, x1)
    return out, lse_row


def run(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, S=1):
    """All queries; splits merged as attention_combine.cu does."""
    return merge_splits(run_cta, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, S)
