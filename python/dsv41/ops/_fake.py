"""Fake (meta) kernels of the format ops defined in C++ (csrc/bindings/torch_ops.cpp): output
shapes and dtypes only, for torch.compile and FakeTensor. (The attention, indexer and top-k
ops keep their fake kernels beside their definitions: attention.py, selection.py.)"""
from __future__ import annotations

import torch

from ..formats import layout


def _register(spec: layout.BlockFormat) -> None:
    name, per_code, block = spec.name, spec.values_per_code, spec.block
    code_dtype, scale_dtype = spec.code_dtype, spec.scale_dtype

    def quantize_fake(x):
        torch._check(x.shape[-1] % block == 0, lambda: f"quantize_{name}: last dim % {block} != 0")
        lead = x.shape[:-1]
        return (x.new_empty((*lead, x.shape[-1] // per_code), dtype=code_dtype),
                x.new_empty((*lead, x.shape[-1] // block), dtype=scale_dtype))

    def quantize_into_fake(x, codes, scales):
        return None

    def dequantize_fake(codes, scales):
        return codes.new_empty((*codes.shape[:-1], codes.shape[-1] * per_code), dtype=torch.float32)

    torch.library.register_fake(f"dsv41::quantize_{name}")(quantize_fake)
    torch.library.register_fake(f"dsv41::quantize_{name}_into")(quantize_into_fake)
    torch.library.register_fake(f"dsv41::dequantize_{name}")(dequantize_fake)


for _spec in layout.BLOCK_FORMATS.values():
    _register(_spec)


def _register_fp8_v4() -> None:
    def quantize_fake(x, rope_dim, amax_floor):
        lay = layout.Fp8V4Layout(int(x.shape[-1]), rope_dim)
        return x.new_empty((*x.shape[:-1], lay.entry_bytes), dtype=torch.uint8)

    def quantize_into_fake(x, rope_dim, amax_floor, entries):
        return None

    def dequantize_fake(entries, head_dim, rope_dim):
        lay = layout.Fp8V4Layout(head_dim, rope_dim)
        torch._check(entries.shape[-1] == lay.entry_bytes,
                     lambda: f"dequantize_fp8_v4: entries need {lay.entry_bytes} bytes per row")
        return entries.new_empty((*entries.shape[:-1], head_dim), dtype=torch.float32)

    torch.library.register_fake("dsv41::quantize_fp8_v4")(quantize_fake)
    torch.library.register_fake("dsv41::quantize_fp8_v4_into")(quantize_into_fake)
    torch.library.register_fake("dsv41::dequantize_fp8_v4")(dequantize_fake)


_register_fp8_v4()
