"""GlobalKVPool's block moves: a CUDA pool moves blocks with the dsv41::copy_blocks kernel
(block_copy.cu), so a GPU run exercises what the runtime does; a CPU pool keeps indexing."""
from __future__ import annotations

import pytest
import torch

from dsv41.cache import global_pool
from dsv41.cache.global_pool import GlobalKVPool

from .helpers import LAYOUT


def _payloads(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, LAYOUT.block_bytes), generator=g, dtype=torch.int64).to(torch.uint8)


def _spy(monkeypatch) -> list:
    calls = []
    real = global_pool.cache_ops.copy_blocks

    def spy(src, src_idx, dst, dst_idx, engine="auto"):
        calls.append((src.device.type, dst.device.type))
        return real(src, src_idx, dst, dst_idx, engine)

    monkeypatch.setattr(global_pool.cache_ops, "copy_blocks", spy)
    return calls


def test_cpu_pool_keeps_its_indexing_path(monkeypatch):
    calls = _spy(monkeypatch)
    pool = GlobalKVPool(LAYOUT, 10 * LAYOUT.block_bytes, device="cpu")
    pays = _payloads(4, 0)
    pool.write([7, 2, 9, 0], pays)
    assert torch.equal(pool.storage[[7, 2, 9, 0]], pays)
    assert torch.equal(pool.read([9, 7]), pays[[2, 0]])
    assert torch.equal(pool.read([], device="cpu"), pays[:0])
    assert calls == []  # the kernel is for CUDA pools only


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["pinned", "pageable", "cuda"])
def test_cuda_pool_moves_blocks_with_copy_blocks(monkeypatch, source):
    calls = _spy(monkeypatch)
    pool = GlobalKVPool(LAYOUT, 12 * LAYOUT.block_bytes, device="cuda")
    pays = _payloads(5, 1)
    src = {"pinned": pays.pin_memory(), "pageable": pays, "cuda": pays.cuda()}[source]
    pool.write([11, 0, 5, 6, 3], src)
    assert torch.equal(pool.storage.cpu()[[11, 0, 5, 6, 3]], pays)
    on_dev = pool.read([5, 11])
    to_host = pool.read([3, 0, 6], device="cpu")
    assert on_dev.is_cuda and torch.equal(on_dev.cpu(), pays[[2, 0]])
    assert to_host.device.type == "cpu" and torch.equal(to_host, pays[[4, 1, 3]])
    assert len(calls) == 3 and calls[1] == ("cuda", "cuda") and calls[2] == ("cuda", "cpu")
