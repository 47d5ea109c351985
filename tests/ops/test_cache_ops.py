"""Quantize-on-write into pool rows and batched block copies: bit-exact against the
contiguous codecs and plain indexing, on the CPU and (when present) the GPU."""
from __future__ import annotations

import pytest
import torch

from dsv41 import formats
from dsv41.ops import cache_ops


_FORMATS = {  # fmt -> (values per code byte, block, code dtype, scale dtype)
    "nvfp4": (2, 16, torch.uint8, torch.float8_e4m3fn),
    "mxfp4": (2, 32, torch.uint8, torch.uint8),
    "fp8_swa": (1, 32, torch.float8_e4m3fn, torch.uint8),
}


def _pool(fmt, rows, d, device="cpu"):
    per, block, cdt, sdt = _FORMATS[fmt]
    codes = torch.full((rows, d // per), 0x5A, dtype=torch.uint8, device=device).view(cdt)
    scales = torch.full((rows, d // block), 0x33, dtype=torch.uint8, device=device).view(sdt)
    return codes, scales


def _bits(t):
    return t.view(torch.uint8).cpu()


def _scatter_case(fmt, gen, device):
    d = 512 if fmt != "mxfp4" else 128
    x = torch.randn(7, d, generator=gen) * 3
    x[2, :40] = 0.0
    x[3, 5] = float("nan")  # a poisoned block: same bits as the contiguous codec
    rows = torch.tensor([9, -1, 0, 4, 12, 3, 7])
    codes, scales = _pool(fmt, 13, d, device)
    before = (_bits(codes).clone(), _bits(scales).clone())
    cache_ops.quantize_scatter(fmt, x.to(device), codes, scales, rows.to(device))
    want_c, want_s = getattr(formats, f"quantize_{fmt}")(x)
    for i, r in enumerate(rows.tolist()):
        if r < 0:
            continue
        assert torch.equal(_bits(codes)[r], _bits(want_c)[i])
        assert torch.equal(_bits(scales)[r], _bits(want_s)[i])
    untouched = [r for r in range(13) if r not in rows.tolist()]
    assert torch.equal(_bits(codes)[untouched], before[0][untouched])
    assert torch.equal(_bits(scales)[untouched], before[1][untouched])


@pytest.mark.parametrize("fmt", list(_FORMATS))
def test_quantize_scatter_cpu(fmt, gen):
    _scatter_case(fmt, gen, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(_FORMATS))
def test_quantize_scatter_cuda(fmt, gen):
    _scatter_case(fmt, gen, "cuda")


def test_quantize_scatter_checks():
    codes, scales = _pool("fp8_swa", 4, 64)
    with pytest.raises(RuntimeError, match="outside"):
        cache_ops.quantize_scatter("fp8_swa", torch.randn(2, 64), codes, scales, torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cache_ops.quantize_scatter("fp8_swa", torch.randn(2, 48), codes, scales, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="one per row"):
        cache_ops.quantize_scatter("fp8_swa", torch.randn(2, 64), codes, scales, torch.tensor([0]))
    with pytest.raises(ValueError):
        cache_ops.quantize_scatter("int4", torch.randn(2, 64), codes, scales, torch.tensor([0, 1]))


def test_copy_blocks_cpu(gen):
    src = torch.randint(0, 256, (10, 4104), generator=gen, dtype=torch.int64).to(torch.uint8)
    dst = torch.zeros(6, 4104, dtype=torch.uint8)
    cache_ops.copy_blocks(src, [3, 9, 0], dst, [5, 0, 2])
    assert torch.equal(dst[5], src[3]) and torch.equal(dst[0], src[9]) and torch.equal(dst[2], src[0])
    assert not dst[[1, 3, 4]].any()
    with pytest.raises(RuntimeError, match="outside"):
        cache_ops.copy_blocks(src, [10], dst, [0])
    with pytest.raises(RuntimeError, match="block sizes differ"):
        cache_ops.copy_blocks(src, [0], torch.zeros(2, 8, dtype=torch.uint8), [0])
    with pytest.raises(RuntimeError, match="engine"):
        cache_ops.copy_blocks(src, [0], dst, [0], "dma")
    cache_ops.copy_blocks(src, [], dst, [])  # no pairs: nothing happens


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["kernel", "copy_engine", "auto"])
@pytest.mark.parametrize("block", [4104, 57344, 100, 7])  # 16-byte, 4-byte and byte paths
def test_copy_blocks_cuda_bit_exact(block, engine, gen):
    n_dev, n_host = 40, 30
    dev = torch.randint(0, 256, (n_dev, block), generator=gen, dtype=torch.int64).to(torch.uint8).cuda()
    host = torch.randint(0, 256, (n_host, block), generator=gen, dtype=torch.int64).to(torch.uint8).pin_memory()
    # clone() allocates pageable memory even from a pinned tensor; the host -> device copy
    # below reads host0, and the op refuses pageable host pools, so pin the snapshot.
    dev0, host0 = dev.clone(), host.clone().pin_memory()
    assert host.is_pinned() and host0.is_pinned()
    # device -> pinned host
    cache_ops.copy_blocks(dev, [0, 17, 39, 5, 6], host, [29, 0, 3, 4, 5], engine)  # 5, 6 -> 4, 5: one run
    torch.cuda.synchronize()
    want = host0.clone()
    want[[29, 0, 3, 4, 5]] = dev0.cpu()[[0, 17, 39, 5, 6]]
    assert torch.equal(host, want)
    # pinned host -> device
    cache_ops.copy_blocks(host0, [1, 2, 28], dev, [38, 0, 7], engine)
    torch.cuda.synchronize()
    want_d = dev0.cpu().clone()
    want_d[[38, 0, 7]] = host0[[1, 2, 28]]
    assert torch.equal(dev.cpu(), want_d)
    # device -> device, indices on the device
    other = torch.zeros_like(dev)
    if engine != "copy_engine":  # device indices: the kernel only
        cache_ops.copy_blocks(dev, torch.tensor([3, 4]).cuda(), other, torch.tensor([1, 0]).cuda(), engine)
        assert torch.equal(other[1], dev[3]) and torch.equal(other[0], dev[4])
    cache_ops.copy_blocks(dev, [8, 9], other, [10, 11], engine)
    assert torch.equal(other[10:12], dev[8:10])


@pytest.mark.gpu
def test_copy_blocks_rejects_pageable_host():
    dev = torch.zeros(2, 64, dtype=torch.uint8, device="cuda")
    host = torch.zeros(2, 64, dtype=torch.uint8)  # not pinned
    assert not host.is_pinned()
    with pytest.raises(RuntimeError, match="pinned"):
        cache_ops.copy_blocks(dev, [0], host, [1])  # device -> pageable host
    with pytest.raises(RuntimeError, match="pinned"):
        cache_ops.copy_blocks(host, [0], dev, [1])  # pageable host -> device
    for engine in ("kernel", "copy_engine"):
        with pytest.raises(RuntimeError, match="pinned"):
            cache_ops.copy_blocks(host.clone(), [0], dev, [1], engine)  # a clone is pageable
