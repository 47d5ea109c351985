"""The device paths of the cache: batched block copies, the CRC-32C kernel, the pool on the
GPU, and promotion from the SSD into device memory (GPUDirect Storage when the machine
has it, else pinned staging). Skipped without a GPU; the project's CI has none, so these
run only where scripts/gpu_check.sh runs them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41 import _C
from dsv41.cache import CacheConfig, PrefixCache, io

from .helpers import B, LAYOUT, TINY, WEIGHTS_ID, chain_payloads, rand_tokens

pytestmark = pytest.mark.gpu


def test_batched_block_copies_between_host_and_device():
    eng = io.IOEngine(4)
    n, P = 37, LAYOUT.block_bytes
    host = torch.randint(0, 256, (n, P), dtype=torch.uint8).pin_memory()
    dev = torch.zeros((2 * n, P), dtype=torch.uint8, device="cuda")
    dst_idx = [2 * i for i in range(n)][::-1]  # scattered and reversed: no run merges
    eng.copy_blocks(dev, dst_idx, host, list(range(n)))
    back = torch.zeros_like(host).pin_memory()
    eng.copy_blocks(back, list(range(n)), dev, dst_idx)
    torch.cuda.synchronize()
    assert torch.equal(back, host)
    assert not dev[1::2].any()
    # Consecutive indices on both sides merge into one copy; device to device works too.
    dev2 = torch.zeros_like(dev)
    eng.copy_blocks(dev2, list(range(5, 15)), dev, list(range(0, 10)))
    torch.cuda.synchronize()
    assert torch.equal(dev2[5:15], dev[0:10])


def test_device_crc32c_matches_the_host():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 200_000, dtype=np.uint8)
    ranges = [(0, 0), (0, 1), (3, 4095), (100, 61_440), (7, 199_993), (4096, 56_960)]
    dev = torch.from_numpy(data).cuda()
    off = torch.tensor([o for o, _ in ranges], dtype=torch.long, device="cuda")
    ln = torch.tensor([n for _, n in ranges], dtype=torch.long, device="cuda")
    got = [c & 0xFFFFFFFF for c in _C.io.crc32c_device(dev, off, ln).cpu().tolist()]
    assert got == [io.crc32c(data[o:o + n]) for o, n in ranges]


@pytest.mark.parametrize("gds", [False, True])
def test_ssd_hits_are_promoted_into_device_memory_bit_exact(tmp_path, gds, monkeypatch):
    if gds and not io.io_info()["gds_available"]:
        pytest.skip("GPUDirect Storage unavailable: " + io.io_info()["gds_detail"])
    cache = PrefixCache(TINY, CacheConfig(block_tokens=B, gpu_capacity_bytes=32 * LAYOUT.block_bytes,
                                          device="cuda", swa_capacity_bytes=0, store_dir=str(tmp_path / "s")),
                        weights_id=WEIGHTS_ID)
    if not gds:
        monkeypatch.setattr(type(cache.store), "gds_available", property(lambda self: False))
    assert cache.pool.arrays and all(a.is_cuda for a in cache.pool.arrays.values())
    rng = np.random.default_rng(1)
    prompt = rand_tokens(rng, 6 * B)
    want = torch.from_numpy(chain_payloads(prompt, cache.key("a")))
    cache.release(cache.insert(prompt, want.cuda(), "a"))
    cache.flush()  # the background SSD writes are acknowledged
    cache.pool.evict_all()
    m = cache.match(prompt, "a")
    assert (m.gpu_blocks, m.ssd_blocks) == (0, 6)
    assert torch.equal(cache.read_blocks(m, device="cpu"), want)
    if gds:  # served by the device path itself, not by the host path it falls back to
        assert cache.store.device_path_reason is None, cache.store.device_path_reason
    cache.release(m)
    cache.close()
