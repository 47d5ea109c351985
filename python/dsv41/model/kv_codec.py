"""How a model stores its KV state: main global KV, SWA KV and indexer keys.

`kv_dtype="stored"` (the default) keeps each in the format a server stores: V4.1
(main_kv_format nvfp4) NVFP4 main KV, FP8 SWA, MXFP4 indexer keys, read directly by the
attention and indexer ops; V4 (fp8_v4) its 584-byte FP8 entry for main and SWA KV and
MXFP4 indexer keys. `kv_dtype="float32"` is the reference mode: everything unquantized
float32, for comparisons against an unquantized implementation (transformers) and for
measuring what the stored formats cost. It is never cached (Model.kv_fingerprint refuses).

Every codec stores rows as a (codes, scales) pair so `RowStore` and the SWA rings hold any
of them; formats without separate scales have zero scale columns. `stage_main` /
`stage_index` write float32 rows into a RowStore: NVFP4 and MXFP4 through
`RowStore.stage_quantized` (the CUDA cache-write kernel quantizes in place), the others by
encoding and staging.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import formats
from ..config import ModelConfig
from ..formats.layout import FP8_SWA, MXFP4, NVFP4, BlockFormat

__all__ = ["KV_DTYPES", "KVCodec", "RowSpec", "codec_for"]

KV_DTYPES = ("stored", "float32")


class RowSpec(NamedTuple):
    code_cols: int
    code_dtype: torch.dtype
    scale_cols: int
    scale_dtype: torch.dtype


class KVCodec:
    """float32 reference: values stored as they are."""

    name = "float32"
    # True when attention and the indexer read the stored bytes through dsv41.ops
    # (V4.1's formats); otherwise rows are decoded to float32 and attended in torch.
    ops_read_stored = False
    quantized_index = False

    def __init__(self, config: ModelConfig):
        self.config = config

    def main_spec(self) -> RowSpec:
        return RowSpec(self.config.head_dim, torch.float32, 0, torch.uint8)

    swa_spec = main_spec

    def index_spec(self) -> RowSpec:
        return RowSpec(self.config.index_head_dim, torch.float32, 0, torch.uint8)

    def _plain(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.float().clone(), x.new_zeros((*x.shape[:-1], 0), dtype=torch.uint8)

    def encode_main(self, x):
        return self._plain(x)

    def decode_main(self, codes, scales):
        return codes

    encode_swa, decode_swa = encode_main, decode_main

    def encode_index(self, x):
        return self._plain(x)

    def stage_main(self, store, x: torch.Tensor) -> None:
        """Encode main-KV entries x [n, D] and stage them as the next rows of `store`."""
        store.stage(*self.encode_main(x))

    def stage_index(self, store, x: torch.Tensor) -> None:
        """Encode indexer keys x [n, Di] and stage them as the next rows of `store`."""
        store.stage(*self.encode_index(x))


class NVFP4Codec(KVCodec):
    """V4.1's stored formats (docs/design.md#formats)."""

    name = "nvfp4"
    ops_read_stored = True
    quantized_index = True

    @staticmethod
    def _spec(fmt: BlockFormat, dim: int) -> RowSpec:
        return RowSpec(fmt.code_cols(dim), fmt.code_dtype, fmt.scale_cols(dim), fmt.scale_dtype)

    def main_spec(self) -> RowSpec:
        return self._spec(NVFP4, self.config.head_dim)

    def swa_spec(self) -> RowSpec:
        return self._spec(FP8_SWA, self.config.head_dim)

    def index_spec(self) -> RowSpec:
        return self._spec(MXFP4, self.config.index_head_dim)

    def encode_main(self, x):
        return formats.quantize_nvfp4(x)

    def decode_main(self, codes, scales):
        return formats.dequantize_nvfp4(codes, scales)

    def encode_swa(self, x):
        return formats.quantize_fp8_swa(x)

    def decode_swa(self, codes, scales):
        return formats.dequantize_fp8_swa(codes, scales)

    def encode_index(self, x):
        return formats.quantize_mxfp4(x)

    def stage_main(self, store, x):
        store.stage_quantized("nvfp4", x)

    def stage_index(self, store, x):
        store.stage_quantized("mxfp4", x)


class FP8V4Codec(NVFP4Codec):
    """DeepSeek-V4's stored formats: the 584-byte FP8 entry (main and SWA KV), MXFP4
    indexer keys."""

    name = "fp8_v4"
    ops_read_stored = False

    def main_spec(self) -> RowSpec:
        c = self.config
        return RowSpec(formats.fp8_v4_layout(c.head_dim, c.rope_head_dim).entry_bytes,
                       torch.uint8, 0, torch.uint8)

    swa_spec = main_spec

    def encode_main(self, x):
        codes = formats.quantize_fp8_v4(x, rope_dim=self.config.rope_head_dim)
        return codes, codes.new_zeros((*codes.shape[:-1], 0))

    def decode_main(self, codes, scales):
        c = self.config
        return formats.dequantize_fp8_v4(codes, head_dim=c.head_dim, rope_dim=c.rope_head_dim)

    encode_swa, decode_swa = encode_main, decode_main

    def stage_main(self, store, x):  # no in-place kernel for this entry: encode, then stage
        store.stage(*self.encode_main(x))


def codec_for(config: ModelConfig, kv_dtype: str) -> KVCodec:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    if kv_dtype == "float32":
        return KVCodec(config)
    return NVFP4Codec(config) if config.main_kv_format == "nvfp4" else FP8V4Codec(config)
