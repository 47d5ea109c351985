"""The model's cache writes: on CUDA the main-KV (NVFP4) and indexer-key (MXFP4) rows are
quantized in place by the cache-write kernels (dsv41::quantize_*_scatter, cache_write.cu);
on the CPU the path is the one it was (formats.quantize_* then stage). Same bits."""
from __future__ import annotations

import pytest
import torch

from dsv41 import formats
from dsv41.model import state
from dsv41.model.state import RowStore


STORES = {"nvfp4": (lambda dev: RowStore(64, torch.uint8, 8, torch.float8_e4m3fn, dev)),
          "mxfp4": (lambda dev: RowStore(64, torch.uint8, 4, torch.uint8, dev))}


def _spy(monkeypatch) -> list:
    calls = []
    real = state.cache_ops.quantize_scatter

    def spy(fmt, x, codes, scales, rows):
        calls.append((fmt, x.device.type))
        return real(fmt, x, codes, scales, rows)

    monkeypatch.setattr(state.cache_ops, "quantize_scatter", spy)
    return calls


def _bytes(store: RowStore):
    return [t.view(torch.uint8).cpu() for t in store.rows()]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cpu_writes_are_unchanged(monkeypatch, fmt, gen):
    calls = _spy(monkeypatch)
    xs = [torch.randn(m, 128, generator=gen) for m in (3, 20, 1)]  # 24 rows: grows past 16
    new, old = STORES[fmt]("cpu"), STORES[fmt]("cpu")
    for x in xs:
        new.stage_quantized(fmt, x)
        old.stage(*getattr(formats, f"quantize_{fmt}")(x))
    assert calls == []
    assert all(torch.equal(a, b) for a, b in zip(_bytes(new), _bytes(old)))
    new.rollback()
    assert new.rows()[0].shape[0] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_writes_go_through_the_scatter_kernel(monkeypatch, fmt, gen):
    calls = _spy(monkeypatch)
    xs = [torch.randn(m, 128, generator=gen) for m in (3, 20, 1)]
    dev, cpu = STORES[fmt]("cuda"), STORES[fmt]("cpu")
    for x in xs:
        dev.stage_quantized(fmt, x.cuda())
        cpu.stage_quantized(fmt, x)
    assert calls == [(fmt, "cuda")] * 3
    assert all(torch.equal(a, b) for a, b in zip(_bytes(dev), _bytes(cpu)))
