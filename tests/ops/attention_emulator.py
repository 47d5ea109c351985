"""A line-by-line numpy emulation of csrc/cuda/attention_mma.cuh (one CTA at a time), for
every head dim it is instantiated for (64, 128, 512) and any head count.

Why: the CUDA kernel cannot run on the machines this was written on. Its riskiest parts
are index arithmetic: the XOR-swizzled shared-memory layouts, the raw staging layout that
cp.async writes and the dequantizer reads, the permuted dim order, the lane addresses
given to ldmatrix, the warp roles of each head dim and the padding head rows. This
emulator executes the kernel's own expressions for those (copied from the .cuh file, per
warp and lane) against a byte-addressed model of shared memory laid out by the compiled
config.h (attention_cta.config), with ldmatrix / mma.sync m16n8k16 modelled on the PTX ISA
fragment layouts, so a slip in any address or fragment shows up as a wrong result. It does
not model timing, barriers or the hardware's rounding beyond bf16 conversions and float32
accumulation.
"""
from __future__ import annotations

import numpy as np

from .attention_cta import (LANES, LOG2E, G, KeyList, Pools, Q, Smem, bf16_bits, bits_bf16, config,
                            decode_fp8_bytes, decode_nvfp4_bytes, merge_splits, probabilities, row_lse_scale,
                            scale_mask_rowmax, store_group, store_q, store_row_pair, update_row_max)


def qk_off(c, r, ch):
    return r * c["kRowBytes"] + ((ch ^ (r & 7)) << 4)


def p_off(r, c):
    return r * 128 + ((c ^ (r & 7)) << 4)


def ldmatrix_x4(sm: Smem, addr):  # addr[32] -> regs[32, 4]; reg j = row lane/4 of matrix j
    addr = np.asarray(addr)
    return np.stack([sm.u32(addr[8 * j + G] + 4 * Q) for j in range(4)], axis=1)


def ldmatrix_x4_trans(sm: Smem, addr):  # reg j of lane l = (row 2(l%4), col l/4), (row 2(l%4)+1, col l/4)
    addr = np.asarray(addr)
    regs = []
    for j in range(4):
        lo = sm.u16(addr[8 * j + 2 * Q] + 2 * G)
        hi = sm.u16(addr[8 * j + 2 * Q + 1] + 2 * G)
        regs.append(lo.astype(np.uint32) | (hi.astype(np.uint32) << 16))
    return np.stack(regs, axis=1)


def _halves(r):
    return bits_bf16((r & 0xFFFF).astype(np.uint16)), bits_bf16((r >> 16).astype(np.uint16))


def mma(acc, a, b0, b1):
    """acc[32, 4] += A(a[32, 4]) @ B(b0, b1) per the m16n8k16 .row.col fragment layouts."""
    A = np.zeros((16, 16), np.float32)
    B = np.zeros((16, 8), np.float32)
    for reg, (roff, coff) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
        lo, hi = _halves(a[:, reg])
        A[G + roff, 2 * Q + coff] = lo
        A[G + roff, 2 * Q + coff + 1] = hi
    for reg, koff in ((b0, 0), (b1, 8)):
        lo, hi = _halves(reg)
        B[2 * Q + koff, G] = lo
        B[2 * Q + koff + 1, G] = hi
    C = A.astype(np.float64) @ B.astype(np.float64)
    acc[:, 0] += C[G, 2 * Q]
    acc[:, 1] += C[G, 2 * Q + 1]
    acc[:, 2] += C[G + 8, 2 * Q]
    acc[:, 3] += C[G + 8, 2 * Q + 1]


def run_cta(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, t, S=1, split=0, h0=0):
    """One CTA (query t, heads h0.., split `split` of S). Returns (out [n_heads, D],
    lse [n_heads]) for S == 1, else the partial (normalised O, lse)."""
    T, H, D = q.shape
    c = config(D)
    n_heads = min(64, H - h0)
    sm = Smem(c["kOffStats"])
    pools = Pools(swa_values, swa_scales, kv_codes, kv_scales)
    OFF_Q, OFF_K, OFF_RAW0, OFF_P, RAW_BYTES = c["kOffQ"], c["kOffK"], c["kOffRaw0"], c["kOffP"], c["kRawBytes"]
    ROW = c["kRowBytes"]
    store_q(sm, q[t, h0:h0 + n_heads].numpy(), n_heads, D, lambda h, g: OFF_Q + qk_off(c, h, g))
    kl = KeyList(swa_idx[t], kv_idx[t], pools.swa_v.shape[0], pools.kv_c.shape[0], S, split)
    s_idx, tb, te = kl.s_idx, kl.tb, kl.te

    def copy_scales(n, dst, src, ok):  # copy_scales<kBytes>: 16, 8, 4 (cp.async) or 2 bytes
        assert n in (2, 4, 8, 16) and len(src) == n
        sm.b[dst:dst + n] = src if ok else 0

    def issue_raw(i, raw):
        if i >= te:
            return
        first, rows, kv = kl.tile(i)
        if not kv:
            per = c["kFp8Chunks"] + 1
            for u in range(64 * per):
                r, ch = u // per, u % per
                ok = r < rows
                row = s_idx[first + r] if ok else 0
                if ch < c["kFp8Chunks"]:
                    dst = raw + r * D + ((ch ^ (r & c["kFp8Swz"])) << 4)
                    sm.b[dst:dst + 16] = pools.swa_v[row, 16 * ch:16 * ch + 16] if ok else 0
                else:
                    n = c["kFp8ScaleBytes"]
                    copy_scales(n, raw + c["kRawFp8Values"] + r * c["kFp8ScaleStride"], pools.swa_s[row, :n], ok)
        else:
            piece = c["kNvfp4ScalePiece"]
            per = c["kNvfp4Chunks"] + c["kNvfp4ScaleBytes"] // piece
            for u in range(64 * per):
                r, ch = u // per, u % per
                ok = r < rows
                row = s_idx[first + r] if ok else 0
                if ch < c["kNvfp4Chunks"]:
                    dst = raw + r * (D // 2) + ((ch ^ (r & c["kNvfp4Swz"])) << 4)
                    sm.b[dst:dst + 16] = pools.kv_c[row, 16 * ch:16 * ch + 16] if ok else 0
                else:
                    k = ch - c["kNvfp4Chunks"]
                    copy_scales(piece, raw + c["kRawNvfp4Codes"] + r * c["kNvfp4ScaleStride"] + piece * k,
                                pools.kv_s[row, piece * k:piece * k + piece], ok)

    def dequant(i, raw):
        _, _, kv = kl.tile(i)
        U = c["kDqUnits"]
        for tid in range(256):
            r, qq = tid & 63, tid >> 6
            u0 = U * qq
            if not kv:
                sw = int(sm.u32(raw + c["kRawFp8Values"] + r * c["kFp8ScaleStride"] + 4 * (u0 >> 3))) >> (8 * ((u0 >> 1) & 3))
                for jb in range((U + 1) // 2):
                    f = (sw >> (8 * jb)) & 0xFF
                    for jc in range(min(U, 2)):
                        ch = u0 + 2 * jb + jc
                        a = raw + r * D + ((ch ^ (r & c["kFp8Swz"])) << 4)
                        vals = decode_fp8_bytes(sm.b[a:a + 16], f)
                        store_group(sm, OFF_K + qk_off(c, r, 2 * ch), vals[:8])
                        store_group(sm, OFF_K + qk_off(c, r, 2 * ch + 1), vals[8:])
            elif U >= 2:
                sa = raw + c["kRawNvfp4Codes"] + r * c["kNvfp4ScaleStride"] + 8 * (u0 >> 3)
                s64 = int(sm.b[sa:sa + 8].view(np.uint64)[0]) >> (8 * (u0 & 7))  # (sc.y << 32 | sc.x)
                for jc in range(U // 2):
                    ch = (u0 >> 1) + jc
                    a = raw + r * (D // 2) + ((ch ^ (r & c["kNvfp4Swz"])) << 4)
                    f0 = (s64 >> (16 * jc)) & 0xFF
                    f1 = (s64 >> (16 * jc + 8)) & 0xFF
                    v0 = decode_nvfp4_bytes(sm.b[a:a + 8], f0)
                    v1 = decode_nvfp4_bytes(sm.b[a + 8:a + 16], f1)
                    for x, vals in enumerate((v0[:8], v0[8:], v1[:8], v1[8:])):
                        store_group(sm, OFF_K + qk_off(c, r, 4 * ch + x), vals)
            else:
                ch = u0 >> 1
                a = raw + r * (D // 2) + ((ch ^ (r & c["kNvfp4Swz"])) << 4) + 8 * (u0 & 1)
                f = (int(sm.u32(raw + c["kRawNvfp4Codes"] + r * c["kNvfp4ScaleStride"] + 4 * (u0 >> 2)))
                     >> (8 * (u0 & 3))) & 0xFF
                vals = decode_nvfp4_bytes(sm.b[a:a + 8], f)
                store_group(sm, OFF_K + qk_off(c, r, 2 * u0), vals[:8])
                store_group(sm, OFF_K + qk_off(c, r, 2 * u0 + 1), vals[8:])

    # per-thread state, vectorised over lanes per warp
    OMT, ONT, DIMG = c["kOMt"], c["kONt"], c["kPvDimGroups"]
    m_run = np.full((8, 32, 2), -np.inf, np.float32)
    l_run = np.zeros((8, 32, 2), np.float32)
    o_acc = np.zeros((8, OMT, ONT, 32, 4), np.float64)
    s_red = np.zeros(128, np.float32)
    s_alpha = np.zeros(64, np.float32)

    issue_raw(tb, OFF_RAW0)
    issue_raw(tb + 1, OFF_RAW0 + RAW_BYTES)
    if tb < te:
        dequant(tb, OFF_RAW0)
    for i in range(tb, te):
        buf = (i - tb) & 1
        issue_raw(i + 2, OFF_RAW0 + buf * RAW_BYTES)
        _, rows, kv = kl.tile(i)
        c_tile = np.float32(scale * LOG2E * (256.0 if kv else 1.0))
        pshift = np.float32(8.0 if kv else 0.0)
        s_all, mx_all = {}, {}
        for w in range(8):
            srow0, skey0 = 16 * (w & 3), 32 * (w >> 2)
            s_acc = np.zeros((32, 16), np.float64)
            if srow0 < n_heads:  # s_live
                a_row = srow0 + (LANES & 15)
                a_base = OFF_Q + a_row * ROW
                b_row = skey0 + (LANES & 7) + ((LANES >> 4) << 3)
                b_base = OFF_K + b_row * ROW
                a_off = [((2 * j + (LANES >> 4)) ^ (a_row & 7)) << 4 for j in range(4)]
                b_off = [((2 * j + ((LANES >> 3) & 1)) ^ (b_row & 7)) << 4 for j in range(4)]
                for ks in range(D // 16):
                    kofs = 128 * (ks >> 2)
                    a = ldmatrix_x4(sm, a_base + kofs + a_off[ks & 3])
                    b0 = ldmatrix_x4(sm, b_base + kofs + b_off[ks & 3])
                    b1 = ldmatrix_x4(sm, b_base + 16 * ROW + kofs + b_off[ks & 3])
                    mma(s_acc[:, 0:4], a, b0[:, 0], b0[:, 1])
                    mma(s_acc[:, 4:8], a, b0[:, 2], b0[:, 3])
                    mma(s_acc[:, 8:12], a, b1[:, 0], b1[:, 1])
                    mma(s_acc[:, 12:16], a, b1[:, 2], b1[:, 3])
            s_acc = s_acc.astype(np.float32)
            mx = scale_mask_rowmax(s_acc, skey0, rows, c_tile)
            for lane in range(0, 32, 4):
                s_red[(w >> 2) * 64 + srow0 + lane // 4] = mx[lane, 0]
                s_red[(w >> 2) * 64 + srow0 + lane // 4 + 8] = mx[lane, 1]
            s_all[w], mx_all[w] = s_acc, mx
        # B1
        for w in range(8):
            srow0, skey0, khalf = 16 * (w & 3), 32 * (w >> 2), w >> 2
            other = np.stack([s_red[(khalf ^ 1) * 64 + srow0 + G], s_red[(khalf ^ 1) * 64 + srow0 + G + 8]], 1)
            alpha, m_use = update_row_max(m_run[w], mx_all[w], other)
            p = probabilities(s_all[w], m_use, pshift)
            lsum = np.stack([p[:, [0, 1, 4, 5, 8, 9, 12, 13]].sum(1), p[:, [2, 3, 6, 7, 10, 11, 14, 15]].sum(1)], 1)
            for nt in range(4):
                chunk = (skey0 >> 3) + nt
                for lane in range(32):
                    r0 = srow0 + G[lane]
                    sm.st32(OFF_P + p_off(r0, chunk) + 4 * Q[lane], *bf16_bits(p[lane, 4 * nt:4 * nt + 2]))
                    sm.st32(OFF_P + p_off(r0 + 8, chunk) + 4 * Q[lane], *bf16_bits(p[lane, 4 * nt + 2:4 * nt + 4]))
            lscale = np.float32(1 / 256 if kv else 1)
            l_run[w] = l_run[w] * alpha + lsum * lscale
            if w < 4:
                for lane in range(0, 32, 4):
                    s_alpha[srow0 + lane // 4] = alpha[lane, 0]
                    s_alpha[srow0 + lane // 4 + 8] = alpha[lane, 1]
        # B2: PV
        lx = LANES & 7
        pa_base = OFF_P + (LANES & 15) * 128
        v_key = (LANES & 7) + (((LANES >> 3) & 1) << 3)
        v_base = OFF_K + v_key * ROW
        for w in range(8):
            mt0, oc0 = (w // DIMG) * OMT, (w % DIMG) * ONT
            for mt in range(OMT):
                o_acc[w, mt, :, :, 0:2] *= s_alpha[16 * (mt0 + mt) + G][None, :, None]
                o_acc[w, mt, :, :, 2:4] *= s_alpha[16 * (mt0 + mt) + G + 8][None, :, None]
            for ks in range(4):
                pa = {mt: ldmatrix_x4(sm, pa_base + (mt0 + mt) * 16 * 128 + (((2 * ks + (LANES >> 4)) ^ lx) << 4))
                      for mt in range(OMT) if 16 * (mt0 + mt) < n_heads}
                for np_ in range(ONT // 2):
                    vb = ldmatrix_x4_trans(sm, v_base + ks * 16 * ROW + (((oc0 + 2 * np_ + (LANES >> 4)) ^ lx) << 4))
                    for mt in pa:
                        mma(o_acc[w, mt, 2 * np_], pa[mt], vb[:, 0], vb[:, 1])
                        mma(o_acc[w, mt, 2 * np_ + 1], pa[mt], vb[:, 2], vb[:, 3])
        # B3
        if i + 1 < te:
            dequant(i + 1, OFF_RAW0 + (buf ^ 1) * RAW_BYTES)
    # epilogue
    s_l = np.zeros(128, np.float32)
    for w in range(8):
        srow0, khalf = 16 * (w & 3), w >> 2
        lr = l_run[w].reshape(8, 4, 2).sum(1)  # shuffle-xor 1, 2
        for gg in range(8):
            s_l[khalf * 64 + srow0 + gg] = lr[gg, 0]
            s_l[khalf * 64 + srow0 + gg + 8] = lr[gg, 1]
    scale_row = np.zeros(64, np.float32)
    lse_row = np.full(64, np.nan, np.float32)  # rows past n_heads: never written
    for w in range(4):
        for gg in range(8):
            for rr in range(2):
                row = 16 * w + gg + 8 * rr
                if row >= n_heads:
                    continue
                lse_row[row], scale_row[row] = row_lse_scale(s_l[row] + s_l[64 + row], m_run[w, 4 * gg, rr],
                                                             sink[h0 + row], S > 1)
    out = np.full((65, D), np.nan, np.float32)  # row 64: where padding rows' lanes point
    for w in range(8):
        mt0, oc0 = (w // DIMG) * OMT, (w % DIMG) * ONT
        for mt in range(OMT):
            if 16 * (mt0 + mt) >= n_heads:
                continue
            for rr in range(2):
                rows = 16 * (mt0 + mt) + G + 8 * rr
                live = rows < n_heads
                sc = np.where(live, scale_row[np.minimum(rows, 63)], 0)
                for nt in range(ONT):
                    x0 = (o_acc[w, mt, nt, :, 2 * rr] * sc).astype(np.float32)
                    x1 = (o_acc[w, mt, nt, :, 2 * rr + 1] * sc).astype(np.float32)
                    store_row_pair(out, np.where(live, rows, 64), oc0 + nt, x0, x1)
    return out[:n_heads], lse_row[:n_heads]


def run(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, S=1):
    """All queries and head groups through the emulated CTAs, splits merged as
    attention_combine.cu does."""
    return merge_splits(run_cta, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, S)
