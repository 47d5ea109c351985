"""Cache writes and block copies (torch ops `dsv41::quantize_*_scatter`, `dsv41::copy_blocks`).

    quantize_scatter("fp8_swa", x, values, scales, slots)   # new tokens' SWA rows into ring slots
    quantize_scatter("nvfp4", x, codes, scales, rows)       # global-KV rows into a paged pool
    copy_blocks(src_pool, src_idx, dst_pool, dst_idx)        # dst[dst_idx[i]] = src[src_idx[i]]

quantize_scatter writes row i of x [n, D] (float32) into row rows[i] of the pool, with the
same bits as quantize_<fmt>(x[i]); rows[i] == -1 skips a row. copy_blocks moves whole
rows of 2-D pools [n_blocks, block] between the GPU and pinned host memory (either way)
or within one device, in one kernel; on the CPU it is a memcpy loop. Pairs must not
overlap. Indices given on the CPU are range-checked (IndexError-style RuntimeError);
device indices are not (out-of-range entries are skipped, never read or written).
"""
from __future__ import annotations

import torch

from .._ext import _C  # noqa: F401  (registers the ops)
from .. import profiling
from ..formats import layout

FORMATS = tuple(layout.BLOCK_FORMATS)


@profiling.op("op.quantize_scatter", lambda fmt, x, *a, **k: {"tokens": x.shape[0]})
def quantize_scatter(fmt: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     rows: torch.Tensor) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"quantize_scatter: fmt must be one of {FORMATS}, got {fmt!r}")
    getattr(torch.ops.dsv41, f"quantize_{fmt}_scatter")(x, codes, scales, rows)


@profiling.op("op.copy_blocks", lambda src, src_idx, *a, **k: {"blocks": len(src_idx)})
def copy_blocks(src: torch.Tensor, src_idx, dst: torch.Tensor, dst_idx, engine: str = "auto") -> None:
    """engine: "kernel" (one SM kernel moves every pair), "copy_engine" (the pairs, merged
    into contiguous runs, go to the DMA engines in one cudaMemcpyBatchAsync; CPU indices
    only) or "auto" (copy engines for blocks >= 1 MiB with CPU indices, else the kernel).
    On the CPU it is a memcpy loop whatever the engine."""
    src_idx = torch.as_tensor(src_idx, dtype=torch.int64)
    dst_idx = torch.as_tensor(dst_idx, dtype=torch.int64)
    torch.ops.dsv41.copy_blocks(src, src_idx, dst, dst_idx, engine)


def dequant_tricks(fmt: str, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernels' fast bf16 decoders run on their own (a self-check: must equal
    dequantize_<fmt> wherever the value is a normal bf16; see include/dsv41/dequant.h)."""
    return torch.ops.dsv41._dequant_tricks(codes.view(torch.uint8), scales.view(torch.uint8),
                                           layout.BLOCK_FORMATS[fmt].codec_id)


def _register_fakes() -> None:
    for fmt in FORMATS:
        torch.library.register_fake(f"dsv41::quantize_{fmt}_scatter")(
            lambda x, codes, scales, rows: None)
    torch.library.register_fake("dsv41::copy_blocks")(lambda src, src_idx, dst, dst_idx, engine="auto": None)

    @torch.library.register_fake("dsv41::_dequant_tricks")
    def _(codes, scales, fmt):
        per_code = next(f.values_per_code for f in layout.BLOCK_FORMATS.values()
                        if f.codec_id == fmt)
        return codes.new_empty((codes.shape[0], codes.shape[1] * per_code), dtype=torch.float32)


_register_fakes()
