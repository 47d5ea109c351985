"""dsv41.cache.interop: KV blocks and SWA snapshots as CuPy arrays without a copy.

The zero-copy tests need CuPy and a CUDA GPU and skip cleanly elsewhere (scripts/gpu_check.sh
runs them on a GPU machine with CuPy installed); the argument checks run everywhere."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41.cache import CacheConfig, PrefixCache, TensorSnapshot, interop

from .helpers import B, TINY


def _cache(device: str) -> PrefixCache:
    return PrefixCache(TINY, CacheConfig(block_tokens=B, device=device, gpu_capacity_bytes=1 << 22,
                                         swa_capacity_bytes=0))


def _filled(cache: PrefixCache, n: int = 4):
    tok = np.arange(n * B, dtype="<u4")
    payloads = torch.randint(0, 256, (n, cache.layout.block_bytes), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(0))
    m = cache.insert(tok, payloads.to(cache.pool.device))
    return m, payloads


def test_refusals_without_cupy_or_gpu():
    assert isinstance(interop.cupy_available(), bool)
    with pytest.raises(ValueError, match="CUDA memory"):
        interop.to_cupy(torch.zeros(4))
    with pytest.raises(TypeError, match="torch.Tensor"):
        interop.to_cupy(np.zeros(4))
    cache = _cache("cpu")
    m, _ = _filled(cache)
    arr = cache.pool.layout.arrays[0]
    with pytest.raises(IndexError):
        interop.pool_page(cache.pool, arr.layer, arr.kind, cache.pool.num_blocks)
    with pytest.raises(KeyError, match="no 'nope' array"):
        interop.pool_array(cache.pool, arr.layer, "nope")
    with pytest.raises(TypeError, match="GlobalKVPool"):
        interop.pool_page(cache, arr.layer, arr.kind, 0)
    with pytest.raises(ValueError, match="CUDA memory"):    # a CPU pool has no CuPy view
        interop.pool_page(cache.pool, arr.layer, arr.kind, 0)
    with pytest.raises(ValueError, match="disagree"):
        interop.snapshot_from_cupy({"a": None}, {"b": torch.uint8}, 0)
    cache.release(m)


def test_the_way_back_takes_any_dlpack_array_without_a_copy():
    """from_cupy / snapshot_from_cupy accept anything with __dlpack__: numpy shows on the
    CPU what CuPy does on the GPU (same memory, FP8 viewed back from its bytes)."""
    raw = np.arange(16, dtype=np.uint8)
    t = interop.from_cupy(raw, torch.float8_e4m3fn)
    assert t.dtype == torch.float8_e4m3fn and t.data_ptr() == raw.ctypes.data
    snap = interop.snapshot_from_cupy({"swa_values.0": raw, "tokens": np.arange(4)},
                                      {"swa_values.0": torch.float8_e4m3fn, "tokens": torch.int64},
                                      4, {"format": "t"})
    assert snap.num_tokens == 4 and snap.meta == {"format": "t"}
    assert snap.tensors["swa_values.0"].data_ptr() == raw.ctypes.data
    raw[0] = 0x38                                          # 1.0 in E4M3, seen through the view
    assert float(snap.tensors["swa_values.0"][0]) == 1.0



@pytest.fixture
def cp():
    cupy = pytest.importorskip("cupy")
    if not interop.cupy_available():
        pytest.skip("CuPy sees no CUDA device")
    return cupy


@pytest.mark.gpu
def test_pool_pages_are_shared_not_copied(cp):
    cache = _cache("cuda")
    m, payloads = _filled(cache)
    pool, bid = cache.pool, m.block_ids[1]
    arr = pool.layout.arrays[0]
    key = (arr.layer, arr.kind)
    page = interop.pool_page(pool, *key, bid)
    e = pool.entries_per_block(arr.layer)
    assert page.data.ptr == pool.array(*key)[bid * e].data_ptr() and page.dtype == cp.uint8
    want = payloads[1, arr.offset: arr.offset + arr.nbytes].numpy().reshape(e, arr.width)
    assert np.array_equal(cp.asnumpy(page), want)
    page[0, :8] = 7                                      # a CuPy write lands in the pool
    assert (cache.read_blocks([bid], device="cpu")[0, arr.offset: arr.offset + 8] == 7).all()
    whole = interop.pool_array(pool, *key)
    assert whole.data.ptr == pool.array(*key).data_ptr()
    assert whole.shape == (pool.num_blocks * e, arr.width)
    t = interop.from_cupy(page)
    assert t.data_ptr() == page.data.ptr and t.device.type == "cuda"
    cache.release(m)


@pytest.mark.gpu
def test_snapshot_round_trip_shares_memory(cp):
    g = torch.Generator().manual_seed(1)
    vals = torch.randint(0, 256, (128, 64), dtype=torch.uint8, generator=g).cuda().view(torch.float8_e4m3fn)
    snap = TensorSnapshot(128, {"swa_values.0": vals,
                             "swa_scales.0": torch.randint(0, 256, (128, 2), dtype=torch.uint8, generator=g).cuda(),
                             "tokens": torch.arange(128, device="cuda")}, {"format": "t"})
    arrays, dtypes = interop.snapshot_to_cupy(snap)
    assert arrays["swa_values.0"].dtype == cp.uint8            # FP8 travels as its bytes
    assert all(arrays[n].data.ptr == t.data_ptr() for n, t in snap.tensors.items())
    back = interop.snapshot_from_cupy(arrays, dtypes, snap.num_tokens, snap.meta)
    assert back.tensors["swa_values.0"].dtype == torch.float8_e4m3fn
    assert all(back.tensors[n].data_ptr() == t.data_ptr() for n, t in snap.tensors.items())
    arrays["tokens"] += 1                                      # one allocation, seen by torch
    assert torch.equal(snap.tensors["tokens"].cpu(), torch.arange(1, 129))


@pytest.mark.gpu
def test_kvikio_cufile_reads_into_a_pool_page(cp, tmp_path):
    kvikio = pytest.importorskip("kvikio")
    cache = _cache("cuda")
    m, payloads = _filled(cache)
    arr = cache.pool.layout.arrays[0]
    src = interop.pool_page(cache.pool, arr.layer, arr.kind, m.block_ids[0])
    path = str(tmp_path / "page.bin")
    with kvikio.CuFile(path, "w") as f:
        assert f.write(src) == src.nbytes
    free = next(b for b in range(cache.pool.num_blocks) if b not in m.block_ids)
    with kvikio.CuFile(path, "r") as f:
        assert f.read(interop.pool_page(cache.pool, arr.layer, arr.kind, free)) == src.nbytes
    got = cache.pool.read([free], device="cpu")[0, arr.offset: arr.offset + arr.nbytes]
    assert torch.equal(got, payloads[0, arr.offset: arr.offset + arr.nbytes])
    cache.release(m)
