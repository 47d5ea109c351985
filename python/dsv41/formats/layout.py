"""Byte sizes of the stored KV formats (SPEC section 3), per token and per layer.

Every byte count in dsv41 (the KV budget, the cache tiers, the model state) comes from
these functions, which mirror what the codecs actually write: codes plus one scale per
block. Nothing here is a hard-coded per-token constant.
"""
from __future__ import annotations

NVFP4_BLOCK = 16    # E2M1 codes, one E4M3 scale per 16 values (main global KV)
MXFP4_BLOCK = 32    # E2M1 codes, one UE8M0 scale per 32 values (indexer keys/queries)
FP8_SWA_BLOCK = 32  # E4M3 values, one UE8M0 scale per 32 values (SWA KV)


def _check_dim(dim: int, block: int, name: str) -> None:
    if not isinstance(dim, int) or dim <= 0 or dim % block:
        raise ValueError(f"{name}: dim must be a positive multiple of {block}, got {dim!r}")


def nvfp4_bytes(dim: int) -> int:
    """Bytes of one NVFP4 vector of `dim` values: dim/2 code bytes + dim/16 E4M3 scales."""
    _check_dim(dim, NVFP4_BLOCK, "nvfp4")
    return dim // 2 + dim // NVFP4_BLOCK


def mxfp4_bytes(dim: int) -> int:
    """Bytes of one MXFP4 vector: dim/2 code bytes + dim/32 UE8M0 scales."""
    _check_dim(dim, MXFP4_BLOCK, "mxfp4")
    return dim // 2 + dim // MXFP4_BLOCK


def fp8_swa_bytes(dim: int) -> int:
    """Bytes of one FP8 SWA vector: dim E4M3 bytes + dim/32 UE8M0 scales."""
    _check_dim(dim, FP8_SWA_BLOCK, "fp8_swa")
    return dim + dim // FP8_SWA_BLOCK


def fp8_v4_main_bytes(nope_dim: int, rope_dim: int) -> int:
    """DeepSeek-V4's FP8 main-KV entry, for comparison only (not a dsv41 format):
    E4M3 no-RoPE dims, bf16 RoPE dims, one UE8M0 scale per 64 no-RoPE dims, padded to 8 bytes.
    V4-Flash: 448 + 128 + 7 + 1 pad = 584."""
    if nope_dim % 64:
        raise ValueError(f"fp8_v4_main: nope_dim must be a multiple of 64, got {nope_dim}")
    raw = nope_dim + 2 * rope_dim + nope_dim // 64
    return (raw + 7) // 8 * 8
