"""What the CPU emulators of the two tensor-core attention kernels share
(attention_emulator.py: mma.sync; attention_wgmma_emulator.py: wgmma), the counterpart of
csrc/cuda/attention_cta.cuh plus the byte-addressed shared memory both run on.

The tile constants come from the extension (`dsv41._C.kernels.attention_config`, i.e.
include/dsv41/attention/config.h as compiled), never copied by hand: a changed layout
changes the emulation with it.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from dsv41 import formats
from dsv41._ext import _C

LOG2E = 1.4426950408889634
NVFP4_SHIFT = 8  # NVFP4 keys decode as value * 2^-8 (the folded constant, dsv41/dequant.h)
LANES = np.arange(32)
G, Q = LANES >> 2, LANES & 3


@functools.lru_cache(maxsize=None)
def config(head_dim: int) -> dict:
    """config.h's constants for this head dim, by their C++ names (kOffRaw0, kWgStageOff, ...)."""
    return dict(_C.kernels.attention_config(head_dim))


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (torch's conversion)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).bfloat16().view(torch.int16).numpy().view(np.uint16)


def bits_bf16(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


class Smem:
    """Shared memory as bytes. guard = (lo, hi): a 16-byte store into [lo, hi) fails (a
    layout bug: the wgmma producer's live stage)."""

    def __init__(self, size: int):
        self.b = np.zeros(size, dtype=np.uint8)
        self.guard = None

    def st16(self, addr, halves):  # 8 bf16 values (uint16) at addr
        if self.guard is not None:
            assert not (self.guard[0] - 16 < addr < self.guard[1]), f"store at {addr} hits the stage {self.guard}"
        self.b[addr:addr + 16] = np.asarray(halves, dtype=np.uint16).view(np.uint8)

    def st32(self, addr, lo, hi):
        self.b[addr:addr + 4] = np.array([lo, hi], dtype=np.uint16).view(np.uint8)

    def ld(self, addr, n):
        return self.b[addr:addr + n].copy()

    def u32(self, addrs):
        a = np.asarray(addrs)
        w = self.b[a[..., None] + np.arange(4)].astype(np.uint32)
        return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)

    def u16(self, addrs):
        a = np.asarray(addrs)
        return (self.b[a].astype(np.uint16) | (self.b[a + 1].astype(np.uint16) << 8))

    def bf16_at(self, addrs):
        return bits_bf16(self.u16(addrs))


# ---- inputs -> bytes, the codecs' values --------------------------------------------------

class Pools:
    """The op's pool tensors as byte arrays (what cp.async reads)."""

    def __init__(self, swa_values, swa_scales, kv_codes, kv_scales):
        self.swa_v = swa_values.view(torch.uint8).numpy()
        self.swa_s = swa_scales.view(torch.uint8).numpy()
        self.kv_c = kv_codes.numpy()
        self.kv_s = kv_scales.view(torch.uint8).numpy()


def decode_fp8_bytes(v: np.ndarray, scale: int) -> np.ndarray:
    """Codec values of up to 32 E4M3 bytes sharing one UE8M0 scale."""
    buf = np.zeros(32, np.uint8)
    buf[:len(v)] = v
    vals = formats.dequantize_fp8_swa(torch.from_numpy(buf)[None].view(torch.float8_e4m3fn),
                                      torch.tensor([[scale]], dtype=torch.uint8))
    return vals[0, :len(v)].numpy()


def decode_nvfp4_bytes(c: np.ndarray, scale: int) -> np.ndarray:
    """Codec values of one NVFP4 block (8 code bytes, one E4M3 scale), times 2^-8 as the
    kernels decode them."""
    vals = formats.dequantize_nvfp4(torch.from_numpy(c.copy())[None],
                                    torch.tensor([[scale]], dtype=torch.uint8).view(torch.float8_e4m3fn))[0]
    return vals.numpy() * 2.0 ** -NVFP4_SHIFT


def store_group(sm: Smem, addr: int, vals: np.ndarray):
    """8 decoded values (natural order) -> bf16 in the permuted pair order at addr."""
    perm = np.empty(8, np.float32)
    perm[0::2], perm[1::2] = vals[:4], vals[4:]
    sm.st16(addr, bf16_bits(perm))


def store_q(sm: Smem, q_t: np.ndarray, n_heads: int, head_dim: int, off):
    """q of one query -> bf16 permuted pairs at off(h, chunk); rows past n_heads are zeros."""
    for h in range(64):
        for g in range(head_dim // 8):
            if h < n_heads:
                lo, hi = q_t[h, 8 * g:8 * g + 4], q_t[h, 8 * g + 4:8 * g + 8]
                sm.st16(off(h, g), bf16_bits(np.stack([lo, hi], 1).reshape(-1)))
            else:
                sm.st16(off(h, g), np.zeros(8, np.uint16))


# ---- attention_cta.cuh --------------------------------------------------------------------

class KeyList:
    """build_key_list: the compacted valid keys (SWA first, then global) and the tiles
    [tb, te) of split `split` of S."""

    def __init__(self, swa_idx_t, kv_idx_t, ns: int, ng: int, S: int, split: int):
        sidx = [int(v) for v in swa_idx_t.tolist() if 0 <= v < ns]
        kidx = [int(v) for v in kv_idx_t.tolist() if 0 <= v < ng]
        self.s_idx = sidx + kidx
        self.n_swa, self.n_kv = len(sidx), len(kidx)
        self.swa_tiles = (self.n_swa + 63) // 64
        n_tiles = self.swa_tiles + (self.n_kv + 63) // 64
        per = (n_tiles + S - 1) // S
        self.tb = min(n_tiles, split * per)
        self.te = min(n_tiles, self.tb + per)

    def tile(self, i):
        """(first, rows, kv) of tile i."""
        if i < self.swa_tiles:
            return 64 * i, min(64, self.n_swa - 64 * i), False
        j = i - self.swa_tiles
        return self.n_swa + 64 * j, min(64, self.n_kv - 64 * j), True


def scale_mask_rowmax(s: np.ndarray, skey0: int, rows: int, c_tile) -> np.ndarray:
    """s [32 lanes, 16] (s[:, 4j + 2h + e] = S[row g + 8h][key skey0 + 8j + 2qd + e]) scaled and
    masked in place; returns the row maxima [32, 2] (the same in a row's 4 lanes)."""
    mx = np.full((32, 2), -np.inf, np.float32)
    for j in range(4):
        for e in range(2):
            valid = skey0 + 8 * j + 2 * Q + e < rows
            s[:, 4 * j + e] = np.where(valid, s[:, 4 * j + e] * c_tile, -np.inf)
            s[:, 4 * j + 2 + e] = np.where(valid, s[:, 4 * j + 2 + e] * c_tile, -np.inf)
            mx[:, 0] = np.fmax(mx[:, 0], s[:, 4 * j + e])
            mx[:, 1] = np.fmax(mx[:, 1], s[:, 4 * j + 2 + e])
    for rr in range(2):  # shuffle-xor 1, 2 = max over the 4 lanes of a row
        mx[:, rr] = mx[:, rr].reshape(8, 4).max(1).repeat(4)
    return mx


def update_row_max(m_run: np.ndarray, mx: np.ndarray, other: np.ndarray):
    """m_run [32, 2] updated in place; returns (alpha, m_use)."""
    m_new = np.fmax(m_run, np.fmax(mx, other))
    m_use = np.where(m_new == -np.inf, 0, m_new).astype(np.float32)
    alpha = np.exp2(m_run - m_use).astype(np.float32)
    m_run[...] = m_new
    return alpha, m_use


def probabilities(s: np.ndarray, m_use: np.ndarray, pshift) -> np.ndarray:
    """p [32, 16] = 2^(s - (m - pshift)) per row of the fragment."""
    p = np.empty_like(s)
    for j in range(4):
        for h in range(2):
            for e in range(2):
                p[:, 4 * j + 2 * h + e] = np.exp2(s[:, 4 * j + 2 * h + e] - (m_use[:, h] - pshift))
    return p


def row_lse_scale(lt, m, sink, split: bool):
    if lt == 0:
        return -np.inf, 0.0
    if np.isnan(lt):
        return (np.nan if split else -np.inf), np.nan
    lse = (m + np.log2(lt)) * np.log(2.0)
    sc = 1.0 / lt
    if not split:
        sc *= 1.0 / (1.0 + np.exp(float(sink) - lse))
    return lse, sc


def store_row_pair(out: np.ndarray, rows: np.ndarray, group: int, x0: np.ndarray, x1: np.ndarray):
    """The shuffle store of one accumulator column pair: x0, x1 [32 lanes] hold stored
    positions 2qd, 2qd+1 of 8-dim group `group` of row rows[lane]; written at natural dims."""
    for lane in range(32):
        qd, base = Q[lane], lane & ~3  # __shfl_sync(..., width 4)
        src0, src1, hi = (2 * qd) & 3, (2 * qd + 1) & 3, qd >> 1
        dim = 8 * group + 2 * qd
        out[rows[lane], dim] = (x1 if hi else x0)[base + src0]
        out[rows[lane], dim + 1] = (x1 if hi else x0)[base + src1]


def merge_splits(run_cta, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale, S=1):
    """Every query through run_cta (one emulated kernel's CTA, per 64-head group), splits
    merged as attention_combine.cu does."""
    T, H, D = q.shape
    out = np.zeros((T, H, D), np.float32)
    lse = np.zeros((T, H), np.float32)
    args = (q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink, scale)
    for t in range(T):
        for h0 in range(0, H, 64):
            hs = slice(h0, min(H, h0 + 64))
            if S == 1:
                o, ls = run_cta(*args, t, h0=h0)
                out[t, hs], lse[t, hs] = o, ls
                continue
            parts = [run_cta(*args, t, S, s, h0=h0) for s in range(S)]
            ls_s = np.stack([p[1] for p in parts])  # [S, heads]
            os_ = np.stack([p[0] for p in parts])
            for j in range(ls_s.shape[1]):
                h = h0 + j
                v = ls_s[:, j]
                if np.isnan(v).any():
                    lse[t, h], out[t, h] = -np.inf, np.nan
                    continue
                m = v.max()
                if m == -np.inf:
                    lse[t, h], out[t, h] = -np.inf, 0.0
                    continue
                lt = m + np.log(np.exp(v - m).sum())
                f = 1.0 / (1.0 + np.exp(float(sink[h]) - lt))
                lse[t, h] = lt
                out[t, h] = sum(np.exp(v[s] - lt) * f * os_[s, j] for s in range(S) if np.exp(v[s] - lt) * f != 0)
    return out, lse
