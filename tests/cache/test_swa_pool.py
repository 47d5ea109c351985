"""SwaSnapshotPool: exact prefixes, TTL (injectable clock), LRU under a byte cap, copies."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41.cache.errors import PayloadError
from dsv41.cache.hashing import BlockHasher
from dsv41.cache.swa_pool import TensorSnapshot, SwaSnapshotPool, default_swa_capacity

from .helpers import B, key, rand_tokens, weak_hash


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def snap(n: int, seed: int, size: int = 64) -> TensorSnapshot:
    g = torch.Generator().manual_seed(seed)
    return TensorSnapshot(n, {"swa.0": torch.randint(0, 255, (size,), dtype=torch.uint8, generator=g),
                           "tail_kv": torch.randn(3, 4, generator=g),
                           "comp_state": torch.randn(2, 8, generator=g, dtype=torch.float64)},
                       {"positions": n, "layers": [0, 1]})


def same(a: TensorSnapshot, b: TensorSnapshot) -> bool:
    return a.num_tokens == b.num_tokens and a.meta == b.meta and a.tensors.keys() == b.tensors.keys() and all(
        a.tensors[k].dtype == b.tensors[k].dtype and torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_longest_exact_prefix_is_served_as_a_copy():
    pool = SwaSnapshotPool(BlockHasher(B), 1 << 20)
    rng = np.random.default_rng(0)
    t = rand_tokens(rng, 5 * B + 7)
    prompt, turn = 2 * B + 3, 4 * B  # end of prompt, end of output
    s1, s2 = snap(prompt, 1), snap(turn, 2)
    assert pool.put(key(), t[:prompt], s1) and pool.put(key(), t[:turn], s2)
    got = pool.get(key(), t)
    assert same(got, s2)
    assert same(pool.get(key(), t, max_tokens=turn - 1), s1)
    assert pool.get(key(), t, min_tokens=turn + 1) is None
    # Diverging inside the longer one's tail: the prompt snapshot still serves.
    u = t.copy()
    u[3 * B] += 1
    assert same(pool.get(key(), u), s1)
    # Another namespace never sees them.
    assert pool.get(key("other"), t) is None
    # Mutating what get returned does not touch the pool.
    got.tensors["swa.0"].zero_()
    assert same(pool.get(key(), t), s2)
    with pytest.raises(PayloadError, match="covers"):
        pool.put(key(), t[:10], snap(11, 3))


def test_every_dtype_shape_and_layout_round_trips_bit_exact():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 32, generator=g)
    s = TensorSnapshot(B, {"fp8": base.to(torch.float8_e4m3fn), "bf16": base.to(torch.bfloat16),
                        "f32_t": base.t(),  # not contiguous
                        "empty": torch.zeros(0, 7), "flag": base > 0, "i64": torch.arange(5),
                        "scalar": torch.tensor(3.5)}, {"nested": {"a": [1, 2]}})
    pool = SwaSnapshotPool(BlockHasher(B), 1 << 20)
    t = np.arange(B, dtype="<u4")
    assert pool.put(key(), t, s)
    got = pool.get(key(), t)
    for name, want in s.tensors.items():
        have = got.tensors[name]
        assert have.dtype == want.dtype and have.shape == want.shape, name
        assert torch.equal(have.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else have,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want), name
    assert got.meta == s.meta and got.meta is not s.meta


def test_ttl_counts_from_the_last_use():
    clock = Clock()
    pool = SwaSnapshotPool(BlockHasher(B), 1 << 20, ttl_s=300, clock=clock)
    t = np.arange(3 * B, dtype="<u4")
    pool.put(key(), t[:B], snap(B, 1))
    pool.put(key(), t[: 2 * B], snap(2 * B, 2))
    clock.t += 200
    assert pool.get(key(), t[: 2 * B]).num_tokens == 2 * B  # refreshes the 2B one only
    clock.t += 200  # B-snapshot is 400 s old, the 2B one 200 s
    assert pool.get(key(), t[: B + 3]) is None
    assert pool.get(key(), t).num_tokens == 2 * B
    clock.t += 301
    assert pool.get(key(), t) is None
    assert pool.sweep() == 2 and len(pool) == 0 and pool.used_bytes == 0
    assert pool.metrics.evictions.value(tier="swa", cause="ttl") == 2


def test_lru_within_capacity():
    s = snap(B, 0)
    per = s.nbytes + B * 4 + len(key()) + 512
    pool = SwaSnapshotPool(BlockHasher(B), 3 * per + 10)
    rng = np.random.default_rng(1)
    seqs = [rand_tokens(rng, B) for _ in range(4)]
    for i in range(3):
        pool.put(key(), seqs[i], snap(B, i))
    pool.get(key(), seqs[0])  # 0 is now the most recent: 1 is the LRU
    pool.put(key(), seqs[3], snap(B, 3))
    assert pool.get(key(), seqs[1]) is None
    assert all(pool.get(key(), seqs[i]) is not None for i in (0, 2, 3))
    assert pool.used_bytes <= pool.capacity_bytes
    assert not pool.put(key(), rng.integers(0, 9, B), snap(B, 9, size=10 * per))  # larger than the pool
    assert pool.metrics.evictions.value(tier="swa", cause="capacity") == 1


def test_collisions_and_replacement():
    pool = SwaSnapshotPool(BlockHasher(B, weak_hash, "weak"), 1 << 22)
    rng = np.random.default_rng(2)
    seqs = [rand_tokens(rng, 2 * B + 1) for _ in range(300)]  # > 256 anchors: collisions certain
    for i, s in enumerate(seqs):
        pool.put(key(), s, snap(s.size, i, size=8))
    for i, s in enumerate(seqs):
        assert same(pool.get(key(), s), snap(s.size, i, size=8))
    pool.put(key(), seqs[0], snap(seqs[0].size, 999, size=8))  # same prefix: replaced
    assert same(pool.get(key(), seqs[0]), snap(seqs[0].size, 999, size=8)) and len(pool) == 300


def test_default_capacity_is_a_tenth_of_ram():
    import os
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_swa_capacity() == int(ram * 0.1)
    assert SwaSnapshotPool(BlockHasher(B)).capacity_bytes == default_swa_capacity()
