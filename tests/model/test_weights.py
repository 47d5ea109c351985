"""Quantized checkpoint weights in DeepSeek's layouts, on public sample bytes of the
V4.1-Flash release (quoted with their decoded values by a public loader's tests:
layers.0.attn.wkv.weight/.scale and layers.0.ffn.experts.0.w1.weight/.scale)."""
from __future__ import annotations

import pytest
import torch

from dsv41.model.weights import WeightError, dequantize_all

FP8_ROW = bytes.fromhex("d871f2797069f0e55370eee3dcd8776d6bdc6bf25b66716b5c6d71d0eae7e062")
FP8_FIRST8 = [-0.00390625, 0.03515625, -0.0390625, 0.0703125, 0.03125, 0.017578125,
              -0.03125, -0.0126953125]
FP4_BYTES = bytes.fromhex("a0a8ec4aadaf42aa")
FP4_FIRST16 = [0.0, -0.0078125, 0.0, -0.0078125, -0.015625, -0.03125, -0.0078125, 0.015625,
               -0.0234375, -0.0078125, -0.046875, -0.0078125, 0.0078125, 0.015625,
               -0.0078125, -0.0078125]


def test_fp8_block_weight_sample_bytes():
    w = torch.tensor(list(FP8_ROW), dtype=torch.uint8).view(torch.float8_e4m3fn)[None]
    out = dequantize_all({"a.weight": w, "a.scale": torch.tensor([[0x73]], dtype=torch.uint8)},
                         {"weight_block_size": [32, 32]})
    assert out["a.weight"][0, :8].tolist() == FP8_FIRST8 and "a.scale" not in out


def test_fp4_expert_weight_sample_bytes():
    packed = torch.tensor(list(FP4_BYTES) + [0] * 8, dtype=torch.uint8).view(torch.int8)[None]
    scale = torch.tensor([[0x78]], dtype=torch.uint8)
    out = dequantize_all({"e.weight": packed, "e.scale": scale}, {"expert_dtype": "fp4"})
    assert out["e.weight"].shape == (1, 32)
    assert out["e.weight"][0, :16].tolist() == FP4_FIRST16


def test_errors_name_the_tensor():
    w = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(WeightError, match="layers.0.attn.wq_a.weight"):
        dequantize_all({"layers.0.attn.wq_a.weight": w,
                        "layers.0.attn.wq_a.scale": torch.ones(3, 3)}, None)
    with pytest.raises(WeightError, match="layers.1.x.weight.*expert_dtype"):
        dequantize_all({"layers.1.x.weight": torch.zeros(2, 16, dtype=torch.int8),
                        "layers.1.x.scale": torch.ones(2, 1)}, {"expert_dtype": "fp8"})
