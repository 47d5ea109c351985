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
    with pytest.raises(ValueError, match="not consecutive"):
        interop.pool_blocks(cache.pool, [m.block_ids[0], m.block_ids[0] + 2])
    with pytest.raises(IndexError):
        interop.pool_block(cache.pool, cache.pool.num_blocks)
    with pytest.raises(TypeError, match="GlobalKVPool"):
        interop.pool_block(cache, 0)
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
def test_pool_blocks_are_shared_not_copied(cp):
    cache = _cache("cuda")
    m, payloads = _filled(cache)
    bid = m.block_ids[1]
    view = interop.pool_block(cache.pool, bid)
    assert view.data.ptr == cache.pool.storage[bid].data_ptr() and view.dtype == cp.uint8
    assert np.array_equal(cp.asnumpy(view), payloads[1].numpy())
    view[:8] = 7                                          # a CuPy write lands in the pool
    assert (cache.read_blocks([bid], device="cpu")[0, :8] == 7).all()
    # a CuPy user moving a block: into a free slot of the pool, then back to torch
    free = next(b for b in range(cache.pool.num_blocks) if b not in m.block_ids)
    dst = interop.pool_block(cache.pool, free)
    dst[...] = interop.pool_block(cache.pool, m.block_ids[2])
    cp.cuda.Device().synchronize()
    assert torch.equal(cache.pool.storage[free].cpu(), payloads[2])
    t = interop.from_cupy(dst)
    assert t.data_ptr() == dst.data.ptr and t.device.type == "cuda"
    run = sorted(m.block_ids)
    if run == list(range(run[0], run[0] + len(run))):
        rows = interop.pool_blocks(cache.pool, run)
        assert rows.shape == (len(run), cache.layout.block_bytes)
        assert rows.data.ptr == cache.pool.storage[run[0]].data_ptr()
    assert interop.pool_blocks(cache.pool).data.ptr == cache.pool.storage.data_ptr()
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
def test_kvikio_cufile_reads_into_a_pool_block(cp, tmp_path):
    kvikio = pytest.importorskip("kvikio")
    cache = _cache("cuda")
    m, payloads = _filled(cache)
    src = interop.pool_block(cache.pool, m.block_ids[0])
    path = str(tmp_path / "block.bin")
    with kvikio.CuFile(path, "w") as f:
        assert f.write(src) == src.nbytes
    free = next(b for b in range(cache.pool.num_blocks) if b not in m.block_ids)
    with kvikio.CuFile(path, "r") as f:
        assert f.read(interop.pool_block(cache.pool, free)) == src.nbytes
    assert torch.equal(cache.pool.storage[free].cpu(), payloads[0])
    cache.release(m)
