"""Shapes, dtypes and byte sizes of the stored KV formats (docs/design.md#formats): the one module
that states them.

Every byte count and row shape in dsv41 (the KV budget, the cache tiers, the model state,
the op checks and fake kernels) comes from here, and the numbers mirror what the codecs in
include/dsv41/formats.h actually write. Two kinds of format:

  * block formats (NVFP4, MXFP4, FP8 SWA): a codes row plus one scale per block, kept as
    two tensors; described by a `BlockFormat`;
  * the FP8 V4 main-KV entry (DeepSeek-V4, FlashMLA's MODEL1 FP8 sparse layout): one
    packed byte record per entry; described by `Fp8V4Layout`.

Nothing here is a hard-coded per-token constant: V4-Flash's 584 B and V4.1-Flash's 288 B
are computed from the head dims.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "BlockFormat", "NVFP4", "MXFP4", "FP8_SWA", "BLOCK_FORMATS", "NVFP4_BLOCK", "MXFP4_BLOCK",
    "FP8_SWA_BLOCK", "nvfp4_bytes", "mxfp4_bytes", "fp8_swa_bytes", "Fp8V4Layout",
    "FP8_V4_TILE", "FP8_V4_AMAX_FLOOR", "fp8_v4_layout", "fp8_v4_main_bytes",
    "MAIN_KV_FORMATS", "main_kv_entry_bytes",
]


@dataclass(frozen=True)
class BlockFormat:
    """A format stored as codes [..., code_cols(D)] and scales [..., scale_cols(D)]."""

    name: str
    codec_id: int               # the C++ `dsv41::Codec` value (include/dsv41/codec_ops.h)
    block: int                  # values per scale
    values_per_code: int        # values per element of the codes tensor: 2 for FP4, 1 for FP8
    code_dtype: torch.dtype
    scale_dtype: torch.dtype    # UE8M0 scales are uint8 exponents (float8_e8m0fnu accepted)
    what: str                   # one line for docs and errors

    def check_dim(self, dim: int) -> None:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0 or dim % self.block:
            raise ValueError(f"{self.name}: dim must be a positive multiple of {self.block}, "
                             f"got {dim!r}")

    def code_cols(self, dim: int) -> int:
        """Columns of the codes tensor for `dim` values."""
        return dim // self.values_per_code

    def scale_cols(self, dim: int) -> int:
        """Columns of the scales tensor (one per block) for `dim` values."""
        return dim // self.block

    def row_shapes(self, dim: int) -> tuple[int, int]:
        return self.code_cols(dim), self.scale_cols(dim)

    def bytes(self, dim: int) -> int:
        """Bytes of one stored vector of `dim` values: codes plus one-byte scales."""
        self.check_dim(dim)
        return (self.code_cols(dim) * self.code_dtype.itemsize
                + self.scale_cols(dim) * self.scale_dtype.itemsize)


NVFP4 = BlockFormat("nvfp4", 0, 16, 2, torch.uint8, torch.float8_e4m3fn,
                    "main global KV: E2M1 codes, one E4M3 scale per 16 values")
MXFP4 = BlockFormat("mxfp4", 1, 32, 2, torch.uint8, torch.uint8,
                    "indexer keys/queries: E2M1 codes, one UE8M0 scale per 32 values")
FP8_SWA = BlockFormat("fp8_swa", 2, 32, 1, torch.float8_e4m3fn, torch.uint8,
                      "SWA KV: E4M3 values, one UE8M0 scale per 32 values")
BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (NVFP4, MXFP4, FP8_SWA)}

# Spellings kept for existing callers.
NVFP4_BLOCK = NVFP4.block
MXFP4_BLOCK = MXFP4.block
FP8_SWA_BLOCK = FP8_SWA.block


def nvfp4_bytes(dim: int) -> int:
    """Bytes of one NVFP4 vector of `dim` values: dim/2 code bytes + dim/16 E4M3 scales."""
    return NVFP4.bytes(dim)


def mxfp4_bytes(dim: int) -> int:
    """Bytes of one MXFP4 vector: dim/2 code bytes + dim/32 UE8M0 scales."""
    return MXFP4.bytes(dim)


def fp8_swa_bytes(dim: int) -> int:
    """Bytes of one FP8 SWA vector: dim E4M3 bytes + dim/32 UE8M0 scales."""
    return FP8_SWA.bytes(dim)


# ---- FP8 V4 main KV ---------------------------------------------------------------------

FP8_V4_TILE = 64            # no-RoPE values per UE8M0 scale
FP8_V4_AMAX_FLOOR = 1e-4    # DeepSeek-V4's act_quant floor on a tile's amax (see formats.h)
_ENTRY_ALIGN = 8            # entries are padded to a multiple of 8 bytes


@dataclass(frozen=True)
class Fp8V4Layout:
    """Byte layout of one FP8 V4 main-KV entry of `head_dim` values whose last `rope_dim`
    are RoPE dims. V4-Flash (512, 64): codes [0, 448), bf16 RoPE [448, 576), scales
    [576, 583), pad [583, 584)."""

    head_dim: int
    rope_dim: int

    def __post_init__(self):
        h, r = self.head_dim, self.rope_dim
        for name, v in (("head_dim", h), ("rope_dim", r)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"fp8_v4: {name} must be an int, got {v!r}")
        if not 0 <= r < h:
            raise ValueError(f"fp8_v4: rope_dim must be in [0, head_dim={h}), got {r}")
        if (h - r) % FP8_V4_TILE:
            raise ValueError(f"fp8_v4: the no-RoPE dims (head_dim {h} - rope_dim {r} = {h - r}) "
                             f"must be a multiple of the {FP8_V4_TILE}-value scale tile")

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def n_tiles(self) -> int:
        return self.nope_dim // FP8_V4_TILE

    @property
    def rope_offset(self) -> int:
        """First byte of the bf16 RoPE dims (they follow the E4M3 codes)."""
        return self.nope_dim

    @property
    def scale_offset(self) -> int:
        return self.rope_offset + 2 * self.rope_dim

    @property
    def pad_offset(self) -> int:
        return self.scale_offset + self.n_tiles

    @property
    def entry_bytes(self) -> int:
        return -(-self.pad_offset // _ENTRY_ALIGN) * _ENTRY_ALIGN


def fp8_v4_layout(head_dim: int, rope_dim: int) -> Fp8V4Layout:
    return Fp8V4Layout(head_dim, rope_dim)


def fp8_v4_main_bytes(nope_dim: int, rope_dim: int) -> int:
    """Bytes of one FP8 V4 main-KV entry: nope E4M3 bytes, 2 * rope bf16 bytes, nope/64
    UE8M0 scales, padded to 8 bytes. V4-Flash: 448 + 128 + 7 + 1 pad = 584."""
    return Fp8V4Layout(nope_dim + rope_dim, rope_dim).entry_bytes


# ---- main-KV formats a config may name (ModelConfig.main_kv_format) ----------------------

MAIN_KV_FORMATS = ("nvfp4", "fp8_v4")


def main_kv_entry_bytes(fmt: str, head_dim: int, rope_dim: int) -> int:
    """Bytes of one stored main-KV entry of format `fmt`."""
    if fmt == "nvfp4":
        return NVFP4.bytes(head_dim)
    if fmt == "fp8_v4":
        return Fp8V4Layout(head_dim, rope_dim).entry_bytes
    raise ValueError(f"unknown main-KV format {fmt!r} (known: {MAIN_KV_FORMATS})")
