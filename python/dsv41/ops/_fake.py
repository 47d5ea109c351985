"""Fake (meta) kernels: output shapes and dtypes only, for torch.compile and FakeTensor."""
from __future__ import annotations

import torch

# name -> (values per code byte, values per scale, code dtype, scale dtype)
_CODECS = {
    "nvfp4": (2, 16, torch.uint8, torch.float8_e4m3fn),
    "mxfp4": (2, 32, torch.uint8, torch.uint8),
    "fp8_swa": (1, 32, torch.float8_e4m3fn, torch.uint8),
}


def _register(name: str, per_code: int, block: int, code_dtype, scale_dtype) -> None:
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


for _name, _spec in _CODECS.items():
    _register(_name, *_spec)
