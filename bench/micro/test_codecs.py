"""Each KV codec, quantize and dequantize: the C++ CPU op beside the float32 torch
reference (`reference=True`), same input, same bits (checked once before timing)."""
from __future__ import annotations

import pytest
import torch

from dsv41 import formats

ROWS, DIM = 1024, 512          # 1024 tokens of one 512-wide KV head
CODECS = ("nvfp4", "mxfp4", "fp8_swa")


def _x() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("codec", CODECS)
def test_quantize(benchmark, codec, impl):
    benchmark.group = f"codec-{codec}-quantize"
    q = getattr(formats, f"quantize_{codec}")
    x = _x()
    ref = q(x, reference=True)
    got = q(x, reference=impl == "reference")
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, ref))
    benchmark(q, x, reference=impl == "reference")


@pytest.mark.parametrize("impl", ["op", "reference"])
@pytest.mark.parametrize("codec", CODECS)
def test_dequantize(benchmark, codec, impl):
    benchmark.group = f"codec-{codec}-dequantize"
    codes, scales = getattr(formats, f"quantize_{codec}")(_x())
    dq = getattr(formats, f"dequantize_{codec}")
    assert torch.equal(dq(codes, scales), dq(codes, scales, reference=True))
    benchmark(dq, codes, scales, reference=impl == "reference")
