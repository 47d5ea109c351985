"""GlobalKVPool's page moves: flat payloads scatter into the per-(layer, kind) arrays the
kernels read, and gather back, on the CPU and on a GPU (from pinned, pageable and device
sources)."""
from __future__ import annotations

import pytest
import torch

from dsv41.cache.global_pool import GlobalKVPool

from .helpers import LAYOUT


def _payloads(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, LAYOUT.block_bytes), generator=g, dtype=torch.int64).to(torch.uint8)


def _bytes_of(pool: GlobalKVPool, bid: int) -> torch.Tensor:
    """Page bid's payload assembled by hand from the pool's arrays (not through read())."""
    parts = []
    for a in pool.layout.arrays:
        e = pool.entries_per_block(a.layer)
        rows = pool.array(a.layer, a.kind)[bid * e: (bid + 1) * e]
        parts.append(rows.contiguous().view(torch.uint8).reshape(-1).cpu())
    return torch.cat(parts)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pages_scatter_into_per_layer_arrays_and_gather_back(device):
    pool = GlobalKVPool(LAYOUT, 12 * LAYOUT.block_bytes, device=device)
    assert set(pool.arrays) == {(a.layer, a.kind) for a in LAYOUT.arrays}
    for a in LAYOUT.arrays:
        arr = pool.array(a.layer, a.kind)
        assert arr.shape == (12 * a.entries, a.width) and arr.dtype == a.dtype and arr.is_contiguous()
    pays = _payloads(5, 1)
    sources = [pays] if device == "cpu" else [pays.pin_memory(), pays, pays.cuda()]
    for src in sources:
        pool.write([11, 0, 5, 6, 3], src)
        for i, bid in enumerate([11, 0, 5, 6, 3]):
            assert torch.equal(_bytes_of(pool, bid), pays[i])
        on_dev = pool.read([5, 11])
        to_host = pool.read([3, 0, 6], device="cpu")
        assert on_dev.device.type == device and torch.equal(on_dev.cpu(), pays[[2, 0]])
        assert to_host.device.type == "cpu" and torch.equal(to_host, pays[[4, 1, 3]])
        if device == "cuda":
            assert to_host.is_pinned()
    assert torch.equal(pool.read([], device="cpu"), pays[:0])
