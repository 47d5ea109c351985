"""SWA snapshot pack (put into the host pool's one flat buffer) and unpack (one copy out,
views per tensor), beside the reference: TensorSnapshot.clone(), a copy per tensor. The
snapshot has V4.1-Flash's shape: 40 layers x 128 tokens of FP8 values (512) + UE8M0 scales
(16), 2.7 MB."""
from __future__ import annotations

import pytest
import torch

from dsv41.cache.swa_pool import TensorSnapshot, _Packed

LAYERS, WINDOW, DIM = 40, 128, 512


def _snapshot() -> TensorSnapshot:
    g = torch.Generator().manual_seed(0)
    tensors = {"tokens": torch.arange(4096, dtype=torch.int64)}
    for layer in range(LAYERS):
        tensors[f"swa_values.{layer}"] = torch.randint(0, 256, (WINDOW, DIM), dtype=torch.uint8,
                                                       generator=g).view(torch.float8_e4m3fn)
        tensors[f"swa_scales.{layer}"] = torch.randint(0, 256, (WINDOW, DIM // 32), dtype=torch.uint8,
                                                       generator=g)
    return TensorSnapshot(4096, tensors, {"format": "bench"})


def _same(a: TensorSnapshot, b: TensorSnapshot) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(
        torch.equal(a.tensors[k].view(torch.uint8), b.tensors[k].view(torch.uint8)) for k in a.tensors)


@pytest.mark.parametrize("impl", ["pack", "clone"])
def test_snapshot_pack(benchmark, impl):
    benchmark.group = "swa-snapshot-pack"
    snap = _snapshot()
    if impl == "pack":
        assert _same(benchmark(_Packed, snap, False).unpack(), snap)
    else:
        assert _same(benchmark(snap.clone), snap)


@pytest.mark.parametrize("impl", ["unpack", "clone"])
def test_snapshot_unpack(benchmark, impl):
    benchmark.group = "swa-snapshot-unpack"
    snap = _snapshot()
    if impl == "unpack":
        assert _same(benchmark(_Packed(snap, False).unpack), snap)
    else:
        held = snap.clone()
        assert _same(benchmark(held.clone), snap)
