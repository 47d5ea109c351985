"""The byte layout of one cache block's payload, derived from a ModelConfig alone.

A block covers `block_tokens` consecutive tokens. For every layer that owns global KV
(a "Full" KV source of compress ratio m) it holds block_tokens / m compressed entries:

    main_codes    uint8          [entries, head_dim / 2]        NVFP4 E2M1 codes
    main_scales   float8_e4m3fn  [entries, head_dim / 16]       NVFP4 scales
    index_codes   uint8          [entries, index_head_dim / 2]  MXFP4 E2M1 codes
    index_scales  uint8 (UE8M0)  [entries, index_head_dim / 32] MXFP4 scales

(indexer keys only for layers that own them: dense layers have none). V4 models
(main_kv_format fp8_v4) store their main entry as one uint8 row of
`formats.layout.Fp8V4Layout(head_dim, rope_dim).entry_bytes` bytes in `main_codes`
(`main_scales` has width 0: the entry holds its own scales). The arrays lie
back to back in layer order, in the order above, in one flat uint8 buffer of
`block_bytes` bytes; no padding, so block_bytes == block_tokens x the config's global
KV bytes per token (890 x 64 = 56,960 for v41-flash). block_tokens must be a multiple of
every compress ratio, so a block never splits a compressed entry.

The cache tiers move these flat buffers without looking inside; `pack`/`unpack` convert
between them and per-layer entry tensors, and `view` gives typed views into a block.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Mapping

import torch

from ..budget import index_key_bytes, main_entry_bytes
from ..config import ModelConfig
from ..formats import layout as fmt
from .errors import LayoutError, PayloadError

__all__ = ["PAYLOAD_FORMAT_VERSION", "DEFAULT_BLOCK_TOKENS", "KINDS", "PayloadArray", "BlockLayout"]

# Version of the payload bytes (codecs of docs/design.md#codecs + this layout). Part of
# every cache key and of the persistent store's manifest: bump it when either changes.
PAYLOAD_FORMAT_VERSION = 1
DEFAULT_BLOCK_TOKENS = 64
KINDS = ("main_codes", "main_scales", "index_codes", "index_scales")
_DTYPES = {"main_codes": fmt.NVFP4.code_dtype, "main_scales": fmt.NVFP4.scale_dtype,
           "index_codes": fmt.MXFP4.code_dtype, "index_scales": fmt.MXFP4.scale_dtype}


@dataclass(frozen=True)
class PayloadArray:
    """One (layer, kind) array inside a block: `entries` rows of `width` bytes. (Not a
    store segment file, nor the model's Segment of a forward batch.)"""

    layer: int
    kind: str
    ratio: int
    offset: int
    entries: int
    width: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.entries * self.width

    def to_dict(self) -> dict:
        return {"layer": self.layer, "kind": self.kind, "ratio": self.ratio, "offset": self.offset,
                "entries": self.entries, "width": self.width, "dtype": str(self.dtype).replace("torch.", "")}


class BlockLayout:
    """Payload layout of one block of `block_tokens` tokens for `config`."""

    def __init__(self, config: ModelConfig, block_tokens: int = DEFAULT_BLOCK_TOKENS):
        if not isinstance(block_tokens, int) or block_tokens <= 0:
            raise LayoutError(f"block_tokens must be a positive int, got {block_tokens!r}")
        ratios = sorted({p.compress_ratio for p in config.layer_plan() if p.owns_kv})
        bad = [m for m in ratios if block_tokens % m]
        if bad:
            raise LayoutError(f"block_tokens={block_tokens} is not a multiple of compress ratio(s) "
                              f"{bad} of {config.name} (ratios {ratios}): a block would split a "
                              f"compressed entry")
        self.config = config
        self.block_tokens = block_tokens
        dtypes = dict(_DTYPES)
        if config.main_kv_format == "nvfp4":
            main_c, main_s = fmt.NVFP4.row_shapes(config.head_dim)
            main_w = fmt.nvfp4_bytes(config.head_dim)
        else:
            # One packed uint8 record per entry (codes, bf16 RoPE dims and scales together).
            main_w = main_c = fmt.fp8_v4_layout(config.head_dim, config.rope_head_dim).entry_bytes
            main_s = 0
            dtypes["main_scales"] = torch.uint8
        idx_w = fmt.mxfp4_bytes(config.index_head_dim)
        assert main_w == main_entry_bytes(config) and idx_w == index_key_bytes(config)
        idx_c, idx_s = fmt.MXFP4.row_shapes(config.index_head_dim)
        widths = {"main_codes": main_c, "main_scales": main_s, "index_codes": idx_c,
                  "index_scales": idx_s}
        arrays: list[PayloadArray] = []
        offset = 0
        for p in config.layer_plan():
            if not p.owns_kv:
                continue
            entries = block_tokens // p.compress_ratio
            kinds = KINDS if p.owns_indexer_keys else KINDS[:2]
            for kind in kinds:
                arr = PayloadArray(p.layer, kind, p.compress_ratio, offset, entries, widths[kind], dtypes[kind])
                arrays.append(arr)
                offset += arr.nbytes
        if not arrays:
            raise LayoutError(f"{config.name} has no layer that owns global KV: nothing to cache")
        self.arrays: tuple[PayloadArray, ...] = tuple(arrays)
        self.block_bytes = offset
        self._by_key = {(s.layer, s.kind): s for s in arrays}

    # ---- description ------------------------------------------------------------------

    @property
    def layers(self) -> list[int]:
        return sorted({s.layer for s in self.arrays})

    @property
    def bytes_per_token(self) -> float:
        return self.block_bytes / self.block_tokens

    def to_dict(self) -> dict:
        # The key stays "segments" (the arrays' old name): this dict is hashed into the
        # layout fingerprint that every store manifest records.
        return {"payload_format_version": PAYLOAD_FORMAT_VERSION, "block_tokens": self.block_tokens,
                "block_bytes": self.block_bytes, "segments": [s.to_dict() for s in self.arrays]}

    def fingerprint(self) -> str:
        """sha256 of the canonical layout description: equal iff the bytes mean the same."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    def array(self, layer: int, kind: str) -> PayloadArray:
        try:
            return self._by_key[(layer, kind)]
        except KeyError:
            raise KeyError(f"layer {layer} has no {kind!r} in this layout "
                           f"(layers {self.layers})") from None

    def __repr__(self) -> str:
        return (f"BlockLayout({self.config.name}, block_tokens={self.block_tokens}, "
                f"block_bytes={self.block_bytes}, layers={self.layers})")

    # ---- buffers ----------------------------------------------------------------------

    def check_blocks(self, blocks: torch.Tensor, what: str = "blocks") -> torch.Tensor:
        """`blocks` as [n, block_bytes] uint8 (a single [block_bytes] block gets n = 1)."""
        if not isinstance(blocks, torch.Tensor):
            raise PayloadError(f"{what} must be a torch.Tensor, got {type(blocks).__name__}")
        if blocks.dtype != torch.uint8:
            raise PayloadError(f"{what} must be uint8, got {blocks.dtype}")
        if blocks.dim() == 1:
            blocks = blocks.unsqueeze(0)
        if blocks.dim() != 2 or blocks.shape[1] != self.block_bytes:
            raise PayloadError(f"{what} must have shape [n, {self.block_bytes}] (block_bytes of "
                               f"{self.config.name} at {self.block_tokens} tokens), got "
                               f"{tuple(blocks.shape)}")
        return blocks

    def empty(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty((n, self.block_bytes), dtype=torch.uint8, device=device)

    def view(self, blocks: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        """Typed view [n, entries, width] of one array of every block in `blocks`."""
        blocks = self.check_blocks(blocks)
        s = self.array(layer, kind)
        raw = blocks[:, s.offset: s.offset + s.nbytes].unflatten(1, (s.entries, s.width))
        return raw.view(s.dtype) if s.dtype != torch.uint8 else raw

    def _check_source(self, s: PayloadArray, t: torch.Tensor, need_entries: int, what: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise PayloadError(f"{what}: expected a tensor, got {type(t).__name__}")
        if t.dtype not in (s.dtype, torch.uint8) and not (
                s.kind == "index_scales" and t.dtype == torch.float8_e8m0fnu):
            raise PayloadError(f"{what}: dtype {t.dtype}, expected {s.dtype}")
        if t.dim() != 2 or t.shape[1] != s.width or t.shape[0] < need_entries:
            raise PayloadError(f"{what}: shape {tuple(t.shape)}, expected [>= {need_entries}, {s.width}]")
        return t.view(torch.uint8) if t.dtype != torch.uint8 else t

    def pack(self, sources: Mapping[tuple[int, str], torch.Tensor], start_block: int, n_blocks: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks [start_block, start_block + n_blocks) of a sequence as [n_blocks, block_bytes].

        `sources[(layer, kind)]` holds that layer's entries for the whole sequence,
        [entries, width] (entry j covers tokens [j m, (j + 1) m)); they must reach at least
        to the end of the last block.
        """
        if start_block < 0 or n_blocks < 0:
            raise ValueError(f"start_block and n_blocks must be >= 0, got {start_block}, {n_blocks}")
        device = next(iter(sources.values())).device if sources else "cpu"
        out = self.empty(n_blocks, device) if out is None else self.check_blocks(out, "out")
        if out.shape[0] != n_blocks:
            raise PayloadError(f"out has {out.shape[0]} blocks, expected {n_blocks}")
        for s in self.arrays:
            key = (s.layer, s.kind)
            if key not in sources:
                raise PayloadError(f"pack: sources lack {key}")
            lo, hi = start_block * s.entries, (start_block + n_blocks) * s.entries
            src = self._check_source(s, sources[key], hi, f"sources[{key}]")
            out[:, s.offset: s.offset + s.nbytes].copy_(src[lo:hi].reshape(n_blocks, s.nbytes))
        return out

    def unpack(self, blocks: torch.Tensor, dest: Mapping[tuple[int, str], torch.Tensor],
               start_block: int = 0) -> None:
        """The inverse of pack: writes the blocks' entries into dest[(layer, kind)] at the
        rows of blocks [start_block, start_block + n)."""
        blocks = self.check_blocks(blocks)
        n = blocks.shape[0]
        for s in self.arrays:
            key = (s.layer, s.kind)
            if key not in dest:
                raise PayloadError(f"unpack: dest lacks {key}")
            lo, hi = start_block * s.entries, (start_block + n) * s.entries
            dst = self._check_source(s, dest[key], hi, f"dest[{key}]")
            dst[lo:hi].copy_(blocks[:, s.offset: s.offset + s.nbytes].reshape(n * s.entries, s.width))
