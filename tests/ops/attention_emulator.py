"""A line-by-line numpy emulation of csrc/cuda/attention_mma.cu (one CTA at a time).

Why: the CUDA kernel cannot run on the machines this was written on. Its riskiest parts
are index arithmetic: the XOR-swizzled shared-memory layouts, the raw staging layout that
cp.async writes and the dequantizer reads, the permuted dim order, and the lane addresses
given to ldmatrix. This emulator executes the kernel's own expressions for those (copied
from the .cu file, per warp and lane) against a byte-addressed model of shared memory, with
ldmatrix / mma.sync m16n8k16 modelled on the PTX ISA fragment layouts, so a slip in any
address or fragment shows up as a wrong result. It does not model timing, barriers or the
hardware's rounding beyond bf16 conversions and float32 accumulation.
"""
from __future__ import annotations

import numpy as np
import torch

from dsv41 import formats

# attention/config.h
TILE, D, HEADS = 64, 512, 64
OFF_Q, OFF_K = 0, 65536
OFF_RAW0 = 131072
RAW_BYTES = 33792
RAW_FP8_VALUES = 32768
RAW_NVFP4_CODES = 16384
OFF_P = OFF_RAW0 + 2 * RAW_BYTES
SMEM = OFF_P + 8192
NVFP4_SHIFT = 8
LOG2E = 1.4426950408889634


def qk_off(r, c):
    return r * 1024 + ((c ^ (r & 7)) << 4)


def p_off(r, c):
    return r * 128 + ((c ^ (r & 7)) << 4)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (torch's conversion)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).bfloat16().view(torch.int16).numpy().view(np.uint16)


def bits_bf16(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


class Smem:
    def __init__(self):
        self.b = np.zeros(SMEM, dtype=np.uint8)

    def st16(self, addr, halves):  # 8 bf16 values (uint16) at addr
        self.b[addr:addr + 16] = np.asarray(halves, dtype=np.uint16).view(np.uint8)

    def st32(self, addr, lo, hi):
        self.b[addr:addr + 4] = np.array([lo, hi], dtype=np.uint16).view(np.uint8)

    def u32(self, addrs):
        a = np.asarray(addrs)
        w = self.b[a[..., None] + np.arange(4)].astype(np.uint32)
        return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)

    def u16(self, addrs):
        a = np.asarray(addrs)
        return (self.b[a].astype(np.uint16) | (self.b[a + 1].astype(np.uint16) << 8))


LANES = np.arange(32)
G, Q = LANES >> 2, LANES & 3


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


def _decode_fp8_bytes(v: np.ndarray, scale: int) -> np.ndarray:
    """Codec values of up to 32 E4M3 bytes sharing one UE8M0 scale."""
    buf = np.zeros(32, np.uint8)
    buf[:len(v)] = v
    vals = formats.dequantize_fp8_swa(torch.from_numpy(buf)[None].view(torch.float8_e4m3fn),
                                      torch.tensor([[scale]], dtype=torch.uint8))
    return vals[0, :len(v)].numpy()


def _decode_nvfp4_bytes(c: np.ndarray, scale: int) -> np.ndarray:
    """Codec values of one NVFP4 block (8 code bytes, one E4M3 scale)."""
    return formats.dequantize_nvfp4(torch.from_numpy(c.copy())[None],
                                    torch.tensor([[scale]], dtype=torch.uint8).view(torch.float8_e4m3fn))[0].numpy()


def run_cta(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, t, S=1, split=0):
    """One CTA (query t, heads 0..63, split `split` of S). Returns (out [64, 512], lse [64])
    for S == 1, else the partial (normalised O, lse)."""
    sm = Smem()
    swa_v = swa_values.view(torch.uint8).numpy()
    swa_s = swa_scales.view(torch.uint8).numpy()
    kv_c = kv_codes.numpy()
    kv_s = kv_scales.view(torch.uint8).numpy()
    # q -> bf16 permuted pairs
    qt = q[t].numpy()
    for h in range(64):
        for g in range(64):
            lo, hi = qt[h, 8 * g:8 * g + 4], qt[h, 8 * g + 4:8 * g + 8]
            sm.st16(OFF_Q + qk_off(h, g), bf16_bits(np.stack([lo, hi], 1).reshape(-1)))
    # compaction (stable)
    ns, ng = swa_v.shape[0], kv_c.shape[0]
    sidx = [int(v) for v in swa_idx[t].tolist() if 0 <= v < ns]
    kidx = [int(v) for v in kv_idx[t].tolist() if 0 <= v < ng]
    s_idx = sidx + kidx
    n_swa, n_kv = len(sidx), len(kidx)
    swa_tiles = (n_swa + 63) // 64
    n_tiles = swa_tiles + (n_kv + 63) // 64
    tb, te = 0, n_tiles
    if S > 1:
        per = (n_tiles + S - 1) // S
        tb = min(n_tiles, split * per)
        te = min(n_tiles, tb + per)

    def tile(i):
        if i < swa_tiles:
            return 64 * i, min(64, n_swa - 64 * i), False
        j = i - swa_tiles
        return n_swa + 64 * j, min(64, n_kv - 64 * j), True

    def issue_raw(i, raw):
        if i >= te:
            return
        first, rows, kv = tile(i)
        if not kv:
            for u in range(64 * 33):
                r, c = u // 33, u % 33
                ok = r < rows
                row = s_idx[first + r] if ok else 0
                if c < 32:
                    src = swa_v[row, 16 * c:16 * c + 16]
                    dst = raw + r * 512 + ((c ^ (r & 7)) << 4)
                else:
                    src = swa_s[row, :16]
                    dst = raw + RAW_FP8_VALUES + r * 16
                sm.b[dst:dst + 16] = src if ok else 0
        else:
            for u in range(64 * 18):
                r, c = u // 18, u % 18
                ok = r < rows
                row = s_idx[first + r] if ok else 0
                if c < 16:
                    src = kv_c[row, 16 * c:16 * c + 16]
                    dst = raw + r * 256 + ((c ^ (r & 7)) << 4)
                else:
                    src = kv_s[row, 16 * (c - 16):16 * (c - 16) + 16]
                    dst = raw + RAW_NVFP4_CODES + r * 32 + 16 * (c - 16)
                sm.b[dst:dst + 16] = src if ok else 0

    def store_group(r, group, vals):  # 8 decoded values (natural order) -> permuted pairs
        perm = np.empty(8, np.float32)
        perm[0::2], perm[1::2] = vals[:4], vals[4:]
        sm.st16(OFF_K + qk_off(r, group), bf16_bits(perm))

    def dequant(i, raw):
        _, _, kv = tile(i)
        for tid in range(256):
            r, qq = tid & 63, tid >> 6
            if not kv:
                sc = int(sm.u32(raw + RAW_FP8_VALUES + r * 16 + 4 * qq))
                for jb in range(4):
                    for jc in range(2):
                        c = 8 * qq + 2 * jb + jc
                        a = raw + r * 512 + ((c ^ (r & 7)) << 4)
                        vals = _decode_fp8_bytes(sm.b[a:a + 16], (sc >> (8 * jb)) & 0xFF)
                        store_group(r, 2 * c, vals[:8])
                        store_group(r, 2 * c + 1, vals[8:])
            else:
                sc = sm.b[raw + RAW_NVFP4_CODES + r * 32 + 8 * qq: raw + RAW_NVFP4_CODES + r * 32 + 8 * qq + 8]
                scx = int(sc[:4].view(np.uint32)[0])  # uint2 sc: .x = bytes 0..3, .y = 4..7
                scy = int(sc[4:].view(np.uint32)[0])
                for jc in range(4):
                    c = 4 * qq + jc
                    a = raw + r * 256 + ((c ^ (r & 7)) << 4)
                    sw = scx if jc < 2 else scy
                    f0 = (sw >> (16 * (jc & 1))) & 0xFF
                    f1 = (sw >> (16 * (jc & 1) + 8)) & 0xFF
                    v0 = _decode_nvfp4_bytes(sm.b[a:a + 8], f0) * 2.0 ** -NVFP4_SHIFT
                    v1 = _decode_nvfp4_bytes(sm.b[a + 8:a + 16], f1) * 2.0 ** -NVFP4_SHIFT
                    for x, vals in enumerate((v0[:8], v0[8:], v1[:8], v1[8:])):
                        store_group(r, 4 * c + x, vals)

    # per-thread state, vectorised over lanes per warp
    m_run = np.full((8, 32, 2), -np.inf, np.float32)
    l_run = np.zeros((8, 32, 2), np.float32)
    o_acc = np.zeros((8, 4, 8, 32, 4), np.float64)
    s_red = np.zeros(128, np.float32)
    s_alpha = np.zeros(64, np.float32)

    issue_raw(tb, OFF_RAW0)
    issue_raw(tb + 1, OFF_RAW0 + RAW_BYTES)
    if tb < te:
        dequant(tb, OFF_RAW0)
    for i in range(tb, te):
        buf = (i - tb) & 1
        issue_raw(i + 2, OFF_RAW0 + buf * RAW_BYTES)
        _, rows, kv = tile(i)
        c_tile = np.float32(scale * LOG2E * (256.0 if kv else 1.0))
        pshift = np.float32(8.0 if kv else 0.0)
        s_all, mx_all = {}, {}
        for w in range(8):
            srow0, skey0 = 16 * (w & 3), 32 * (w >> 2)
            a_row = srow0 + (LANES & 15)
            a_base = OFF_Q + a_row * 1024
            b_row = skey0 + (LANES & 7) + ((LANES >> 4) << 3)
            b_base = OFF_K + b_row * 1024
            a_off = [((2 * j + (LANES >> 4)) ^ (a_row & 7)) << 4 for j in range(4)]
            b_off = [((2 * j + ((LANES >> 3) & 1)) ^ (b_row & 7)) << 4 for j in range(4)]
            s_acc = np.zeros((4, 32, 4), np.float64)
            for ks in range(32):
                kofs = 128 * (ks >> 2)
                a = ldmatrix_x4(sm, a_base + kofs + a_off[ks & 3])
                b0 = ldmatrix_x4(sm, b_base + kofs + b_off[ks & 3])
                b1 = ldmatrix_x4(sm, b_base + 16 * 1024 + kofs + b_off[ks & 3])
                mma(s_acc[0], a, b0[:, 0], b0[:, 1])
                mma(s_acc[1], a, b0[:, 2], b0[:, 3])
                mma(s_acc[2], a, b1[:, 0], b1[:, 1])
                mma(s_acc[3], a, b1[:, 2], b1[:, 3])
            s_acc = s_acc.astype(np.float32)
            mx = np.full((32, 2), -np.inf, np.float32)
            for nt in range(4):
                for e in range(2):
                    valid = skey0 + 8 * nt + 2 * Q + e < rows
                    s_acc[nt, :, e] = np.where(valid, s_acc[nt, :, e] * c_tile, -np.inf)
                    s_acc[nt, :, 2 + e] = np.where(valid, s_acc[nt, :, 2 + e] * c_tile, -np.inf)
                    mx[:, 0] = np.fmax(mx[:, 0], s_acc[nt, :, e])
                    mx[:, 1] = np.fmax(mx[:, 1], s_acc[nt, :, 2 + e])
            for rr in range(2):  # shuffle-xor 1, 2 = max over the 4 lanes of a row
                mx[:, rr] = mx[:, rr].reshape(8, 4).max(1).repeat(4)
            for lane in range(0, 32, 4):
                s_red[(w >> 2) * 64 + srow0 + lane // 4] = mx[lane, 0]
                s_red[(w >> 2) * 64 + srow0 + lane // 4 + 8] = mx[lane, 1]
            s_all[w], mx_all[w] = s_acc, mx
        # B1
        for w in range(8):
            srow0, skey0, khalf = 16 * (w & 3), 32 * (w >> 2), w >> 2
            s_acc, mx = s_all[w], mx_all[w]
            alpha = np.zeros((32, 2), np.float32)
            m_use = np.zeros((32, 2), np.float32)
            for rr in range(2):
                other = s_red[(khalf ^ 1) * 64 + srow0 + G + 8 * rr]
                m_new = np.fmax(m_run[w, :, rr], np.fmax(mx[:, rr], other))
                m_use[:, rr] = np.where(m_new == -np.inf, 0, m_new)
                alpha[:, rr] = np.exp2(m_run[w, :, rr] - m_use[:, rr])
                m_run[w, :, rr] = m_new
            lsum = np.zeros((32, 2), np.float32)
            for nt in range(4):
                p00 = np.exp2(s_acc[nt, :, 0] - (m_use[:, 0] - pshift))
                p01 = np.exp2(s_acc[nt, :, 1] - (m_use[:, 0] - pshift))
                p10 = np.exp2(s_acc[nt, :, 2] - (m_use[:, 1] - pshift))
                p11 = np.exp2(s_acc[nt, :, 3] - (m_use[:, 1] - pshift))
                lsum[:, 0] += p00 + p01
                lsum[:, 1] += p10 + p11
                chunk = (skey0 >> 3) + nt
                for lane in range(32):
                    r0 = srow0 + G[lane]
                    sm.st32(OFF_P + p_off(r0, chunk) + 4 * Q[lane], *bf16_bits(np.array([p00[lane], p01[lane]])))
                    sm.st32(OFF_P + p_off(r0 + 8, chunk) + 4 * Q[lane], *bf16_bits(np.array([p10[lane], p11[lane]])))
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
        for w in range(8):
            v_base = OFF_K + v_key * 1024 + 128 * w
            for mt in range(4):
                o_acc[w, mt, :, :, 0:2] *= s_alpha[16 * mt + G][None, :, None]
                o_acc[w, mt, :, :, 2:4] *= s_alpha[16 * mt + G + 8][None, :, None]
            for ks in range(4):
                pa = [ldmatrix_x4(sm, pa_base + mt * 16 * 128 + (((2 * ks + (LANES >> 4)) ^ lx) << 4)) for mt in range(4)]
                for np_ in range(4):
                    vb = ldmatrix_x4_trans(sm, v_base + ks * 16 * 1024 + (((2 * np_ + (LANES >> 4)) ^ lx) << 4))
                    for mt in range(4):
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
    lse_row = np.zeros(64, np.float32)
    for w in range(4):
        srow0 = 16 * w
        for gg in range(8):
            for rr in range(2):
                row = srow0 + gg + 8 * rr
                lt = s_l[row] + s_l[64 + row]
                m = m_run[w, 4 * gg, rr]
                if lt == 0:
                    lse, sc = -np.inf, 0.0
                elif np.isnan(lt):
                    lse, sc = (np.nan if S > 1 else -np.inf), np.nan
                else:
                    lse = (m + np.log2(lt)) * np.log(2.0)
                    sc = 1.0 / lt
                    if S == 1:
                        sc *= 1.0 / (1.0 + np.exp(float(sink[row]) - lse))
                scale_row[row], lse_row[row] = sc, lse
    out = np.full((64, D), np.nan, np.float32)
    for w in range(8):
        for mt in range(4):
            for rr in range(2):
                for nt in range(8):
                    sc = scale_row[16 * mt + G + 8 * rr]
                    x0 = (o_acc[w, mt, nt, :, 2 * rr] * sc).astype(np.float32)
                    x1 = (o_acc[w, mt, nt, :, 2 * rr + 1] * sc).astype(np.float32)
                    for lane in range(32):
                        qd, base = Q[lane], lane & ~3  # __shfl_sync(..., width 4)
                        src0, src1, hi = (2 * qd) & 3, (2 * qd + 1) & 3, qd >> 1
                        lo_v = (x1 if hi else x0)[base + src0]
                        hi_v = (x1 if hi else x0)[base + src1]
                        row = 16 * mt + G[lane] + 8 * rr
                        dim = 8 * (8 * w + nt) + 2 * qd
                        out[row, dim], out[row, dim + 1] = lo_v, hi_v
    return out, lse_row


def run(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, S=1):
    """All queries through the emulated CTAs, splits merged as attention_combine.cu does."""
    return merge_splits(run_cta, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, S)


def merge_splits(run_cta, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, S=1):
    """Every query through run_cta (one emulated kernel's CTA), splits merged as
    attention_combine.cu does."""
    T = q.shape[0]
    out = np.zeros((T, 64, D), np.float32)
    lse = np.zeros((T, 64), np.float32)
    for t in range(T):
        if S == 1:
            out[t], lse[t] = run_cta(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, t)
            continue
        parts = [run_cta(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, t, S, s)
                 for s in range(S)]
        ls = np.stack([p[1] for p in parts])  # [S, 64]
        os_ = np.stack([p[0] for p in parts])
        for h in range(64):
            v = ls[:, h]
            if np.isnan(v).any():
                lse[t, h], out[t, h] = -np.inf, np.nan
                continue
            m = v.max()
            if m == -np.inf:
                lse[t, h], out[t, h] = -np.inf, 0.0
                continue
            l = m + np.log(np.exp(v - m).sum())
            f = 1.0 / (1.0 + np.exp(float(sink[h]) - l))
            lse[t, h] = l
            out[t, h] = sum(np.exp(v[s] - l) * f * os_[s, h] for s in range(S) if np.exp(v[s] - l) * f != 0)
    return out, lse
