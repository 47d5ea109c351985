"""The top-k kernel's algorithm (tests/ops/topk_emulator.py) against a direct statement of
the contract: the k best of scores[:visible] by (score desc, index asc), returned in
ascending index order, -1 padded; candidate_blocks over block maxima with the newest block
kept. Covers ties, signed zeros, infinities, every cluster size, early whole-bin stops."""
from __future__ import annotations

import numpy as np
import pytest

from . import topk_emulator as emu


def oracle(row, vis, k):
    vis = min(max(vis, 0), len(row))
    v = np.where(row[:vis] == 0, 0.0, row[:vis]).astype(np.float64)
    order = sorted(range(vis), key=lambda i: (-v[i], i))[:k]
    out = np.full(k, -1, np.int64)
    out[:len(order)] = sorted(order)
    return out


def oracle_blocks(row, vis, block, n_blocks):
    vis = min(max(vis, 0), len(row))
    nb = -(-vis // block)
    best = np.array([row[b * block:min((b + 1) * block, vis)].max() for b in range(nb)], np.float64)
    if nb:
        best[nb - 1] = np.inf
    blocks = oracle(best, nb, n_blocks)
    out = np.full(n_blocks * block, -1, np.int64)
    for s, b in enumerate(blocks):
        if b >= 0:
            pos = b * block + np.arange(block)
            out[s * block:(s + 1) * block] = np.where(pos < vis, pos, -1)
    return out


def _rows(rng, N, kind):
    if kind == "distinct":
        return (rng.permutation(N).astype(np.float32) - N / 3) * 0.37
    if kind == "ties":
        r = rng.integers(-5, 6, N).astype(np.float32) * 0.5
        r[r == 0] = -0.0
        r[::7] = 0.0
        return r
    if kind == "inf":
        r = rng.standard_normal(N).astype(np.float32)
        r[::11] = np.inf
        r[::5] = -np.inf
        return r
    return np.full(N, 3.0, np.float32)  # all equal


@pytest.mark.parametrize("N", [1, 600, 8193, 20000, 70000])
@pytest.mark.parametrize("kind", ["distinct", "ties", "inf", "equal"])
def test_topk_algorithm(N, kind):
    rng = np.random.default_rng(N)
    row = _rows(rng, N, kind)
    C = emu.cluster_size(N, 1)
    for k in (1, 64, 512):
        for vis in {0, k, k + 1, N // 2, N}:
            got = emu.select_row(row, vis, k, 1, C)
            assert np.array_equal(got, oracle(row, vis, k)), (N, kind, k, vis)


@pytest.mark.parametrize("N", [5, 17, 3000, 100000])
def test_candidate_blocks_algorithm(N):
    rng = np.random.default_rng(N + 1)
    row = _rows(rng, N, "distinct")
    C = emu.cluster_size(N, 8)
    for n_blocks in (2, 64):
        for vis in {1, N - 3, N // 2 + 1, N}:
            got = emu.select_row(row, vis, n_blocks, 8, C)
            assert np.array_equal(got, oracle_blocks(row, vis, 8, n_blocks)), (N, n_blocks, vis)


def test_every_cluster_size():
    rng = np.random.default_rng(3)
    row = _rows(rng, 40000, "ties")
    for C in range(1, 9):
        assert np.array_equal(emu.select_row(row, 40000, 512, 1, C), oracle(row, 40000, 512))


def test_signed_zeros_tie_at_the_threshold():
    row = np.zeros(300, np.float32)
    row[::2] = -0.0
    row[250:260] = 1.0
    for k in (15, 100):
        assert np.array_equal(emu.select_row(row, 300, k, 1, 1), oracle(row, 300, k))


_TRANSCRIBED = [  # csrc/cuda/topk.cu expressions the emulator mirrors
    "const uint32_t b = __float_as_uint(x == 0.f ? 0.f : x);",
    "return (b & 0x80000000u) ? ~b : (b | 0x80000000u);",
    "if (j == n_eff - 1) return order_key(INFINITY);",
    "const int bits = pass < 2 ? 11 : 10;",
    "const int shift = 32 - nbits - bits;",
    "for (int e = 0; e < 4; ++e) cnt[e] += h[4 * tid + e];",
    "if (above < need && above + mine >= need) {",
    "whole_bin = s_misc[2] == need;",
    "prefix = (prefix << bits) | bstar;",
    "if (is_gt) slot = gt_before + min(need, tie_before);",
    "else if (is_tie && tie_before < need) slot = gt_before + tie_before;",
    "out[slot * p.block + x] = pos < vis ? static_cast<int32_t>(pos) : -1;",
    "out[j] = j < vis ? static_cast<int32_t>(j) : -1;",
]


def test_emulator_tracks_the_kernel_source():
    from pathlib import Path

    src = (Path(__file__).resolve().parents[2] / "csrc" / "cuda" / "topk.cu").read_text()
    missing = [e for e in _TRANSCRIBED if e not in src]
    assert not missing, f"topk.cu changed; update tests/ops/topk_emulator.py: {missing}"
