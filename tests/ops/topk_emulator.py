"""A numpy emulation of csrc/cuda/topk.cu's algorithm for one row: the cluster's slices,
the three radix passes over order-preserving uint32 keys (2048-bin histograms summed over
the cluster, 4 bins per thread, the crossing thread found from an exclusive suffix sum),
the early stop on a whole bin, and the ascending-order compaction from per-CTA and
per-warp prefix counts with the tie rule. Thread-level loops become array operations; the
arithmetic (digits, shifts, prefixes, slot formula) is the kernel's."""
from __future__ import annotations

import numpy as np

THREADS, WARPS, BINS = 512, 16, 2048


def order_key(x: np.ndarray) -> np.ndarray:
    x = np.where(x == 0, np.float32(0), x).astype(np.float32)
    b = x.view(np.uint32)
    return np.where(b & 0x80000000, ~b, b | 0x80000000).astype(np.uint32)


def keys_of_row(row: np.ndarray, vis: int, block: int) -> np.ndarray:
    if block == 1:
        return order_key(row[:vis])
    n_eff = -(-vis // block)
    pad = np.full(n_eff * block, -np.inf, np.float32)
    pad[:vis] = row[:vis]
    m = pad.reshape(n_eff, block).max(1)
    m[n_eff - 1] = np.inf
    return order_key(m)


def select_row(row: np.ndarray, vis: int, k: int, block: int, C: int) -> np.ndarray:
    N = row.shape[0]
    vis = min(max(vis, 0), N)
    n_eff = vis if block == 1 else -(-vis // block)
    out = np.full(k * block, -1, np.int64)
    if n_eff <= k:
        j = np.arange(k * block)
        return np.where(j < vis, j, -1)
    keys = keys_of_row(row, vis, block)
    per = -(-n_eff // C)
    slices = [keys[min(n_eff, r * per):min(n_eff, min(n_eff, r * per) + per)] for r in range(C)]
    prefix, nbits, need, whole = 0, 0, k, False
    for p in range(3):
        if whole:
            break
        bits = 11 if p < 2 else 10
        shift = 32 - nbits - bits
        hist = np.zeros(BINS, np.int64)
        for s in slices:
            sel = s if nbits == 0 else s[(s >> np.uint32(32 - nbits)) == prefix]
            np.add.at(hist, ((sel >> np.uint32(shift)) & np.uint32((1 << bits) - 1)).astype(np.int64), 1)
        cnt = hist.reshape(THREADS, 4)
        mine = cnt.sum(1)
        above = np.concatenate((np.cumsum(mine[::-1])[::-1][1:], [0]))  # exclusive suffix
        t = np.nonzero((above < need) & (above + mine >= need))[0]
        assert len(t) == 1
        t = int(t[0])
        acc = int(above[t])
        for e in (3, 2, 1, 0):
            if acc + cnt[t, e] >= need:
                bstar, gt, cb = 4 * t + e, acc, int(cnt[t, e])
                break
            acc += int(cnt[t, e])
        need -= gt
        whole = cb == need
        prefix = (prefix << bits) | bstar
        nbits += bits

    def top(u):
        return u if nbits >= 32 else (u >> np.uint32(32 - nbits))

    gt_base = tie_base = 0
    for r, s in enumerate(slices):
        c0 = min(n_eff, r * per)
        ts = top(s).astype(np.int64)
        is_gt, is_tie = ts > prefix, ts == prefix
        gt_before = gt_base + np.cumsum(is_gt) - is_gt
        tie_before = tie_base + np.cumsum(is_tie) - is_tie
        slot = np.where(is_gt, gt_before + np.minimum(need, tie_before),
                        np.where(is_tie & (tie_before < need), gt_before + tie_before, -1))
        for j in np.nonzero(slot >= 0)[0]:
            e = c0 + int(j)
            if block == 1:
                out[slot[j]] = e
            else:
                pos = e * block + np.arange(block)
                out[slot[j] * block:(slot[j] + 1) * block] = np.where(pos < vis, pos, -1)
        gt_base += int(is_gt.sum())
        tie_base += int(is_tie.sum())
    return out


def cluster_size(N: int, block: int) -> int:
    n_eff_max = N if block == 1 else -(-N // block)
    return int(min(8, max(1, -(-n_eff_max // 8192))))
