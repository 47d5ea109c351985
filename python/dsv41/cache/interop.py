"""KV blocks and SWA snapshots handed to CuPy (and back) without a copy.

    from dsv41.cache import interop
    rows = interop.pool_array(cache.pool, layer, "main_codes")   # cupy [pages * entries, width]
    page = interop.pool_page(cache.pool, layer, "main_codes", bid)  # one page's rows
    arrays, dtypes = interop.snapshot_to_cupy(snap)          # {name: cupy array}
    snap = interop.snapshot_from_cupy(arrays, dtypes, snap.num_tokens, snap.meta)
    a = interop.to_cupy(tensor); t = interop.from_cupy(a)    # any CUDA tensor / array

Every conversion goes through DLPack (`cupy.from_dlpack`, `torch.from_dlpack`): the CuPy
array and the torch tensor share one allocation, so a CuPy kernel or a kvikio CuFile read
(kvikio takes any object with `__cuda_array_interface__`) writes straight into dsv41's
GPU pool. The pool keeps one array per (layer, kind) (cache/global_pool.py), so a page is
a run of rows in each array, not one flat buffer; `pool.read`/`pool.write` convert to and
from the flat payload. A page view stays valid while its page is pinned (a PrefixMatch
that holds it, not yet released); after release the pool may hand it to another prefix.

FP8 tensors (the SWA values) travel as their uint8 bytes (CuPy has no FP8 dtype): the
returned dtypes map lets snapshot_from_cupy view them back. Only CUDA memory can be a CuPy
array; a CPU tensor is refused with the reason (use numpy: `tensor.numpy()` shares it).
CuPy is optional: this module imports without it and says how to install it when called.
docs/profiling.md ("CuPy") shows a user moving a block and why the GDS path does not use it.
"""
from __future__ import annotations

from typing import Any

import torch

from .global_pool import GlobalKVPool
from .swa_pool import TensorSnapshot

__all__ = ["cupy_available", "to_cupy", "from_cupy", "pool_array", "pool_page",
           "snapshot_to_cupy", "snapshot_from_cupy"]

# dtypes CuPy cannot hold: passed as their raw bytes (same element size, so same shape)
_AS_BYTES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu}


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise ImportError("dsv41.cache.interop needs CuPy on a CUDA machine: pip install "
                          "cupy-cuda13x (or the build matching your CUDA)") from e
    return cupy


def cupy_available() -> bool:
    """CuPy importable and a CUDA device visible."""
    try:
        cp = _cupy()
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def to_cupy(t: torch.Tensor) -> Any:
    """The CUDA tensor `t` as a CuPy array over the same memory (FP8 as uint8 bytes)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_cupy: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(f"to_cupy: CuPy arrays live in CUDA memory; this tensor is on {t.device} "
                         "(tensor.numpy() shares a CPU tensor with numpy)")
    if t.dtype in _AS_BYTES:
        t = t.view(torch.uint8)
    return _cupy().from_dlpack(t.detach())


def from_cupy(a: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A CuPy array (or anything with __dlpack__) as a torch tensor over the same memory;
    dtype views the bytes as that dtype (e.g. torch.float8_e4m3fn for uint8 SWA values)."""
    t = torch.from_dlpack(a)
    return t if dtype is None or t.dtype == dtype else t.view(dtype)


def _check_pool(pool: GlobalKVPool) -> None:
    if not isinstance(pool, GlobalKVPool):
        raise TypeError(f"expected a GlobalKVPool (cache.pool), got {type(pool).__name__}")


def pool_array(pool: GlobalKVPool, layer: int, kind: str) -> Any:
    """Every page's rows of one (layer, kind) array, [num_blocks * entries, width], as a
    CuPy view (FP8 scales as their bytes)."""
    _check_pool(pool)
    return to_cupy(pool.array(layer, kind))


def pool_page(pool: GlobalKVPool, layer: int, kind: str, block_id: int) -> Any:
    """Page `block_id`'s rows [entries, width] of one (layer, kind) array, as a CuPy view."""
    _check_pool(pool)
    if not 0 <= int(block_id) < pool.num_blocks:
        raise IndexError(f"block id {block_id} outside the pool's [0, {pool.num_blocks})")
    e = pool.entries_per_block(layer)
    return to_cupy(pool.array(layer, kind)[int(block_id) * e: (int(block_id) + 1) * e])


def snapshot_to_cupy(snap: TensorSnapshot) -> tuple[dict[str, Any], dict[str, torch.dtype]]:
    """A snapshot whose tensors are in CUDA memory (SwaSnapshotPool.get(..., device="cuda")
    or adapter.snapshot_to_cache of a GPU state) as CuPy arrays over the same memory, and
    each tensor's torch dtype."""
    arrays = {name: to_cupy(t) for name, t in snap.tensors.items()}
    return arrays, {name: t.dtype for name, t in snap.tensors.items()}


def snapshot_from_cupy(arrays: dict[str, Any], dtypes: dict[str, torch.dtype], num_tokens: int,
                       meta: dict | None = None) -> TensorSnapshot:
    """The inverse: a TensorSnapshot whose tensors share the CuPy arrays' memory."""
    missing = arrays.keys() ^ dtypes.keys()
    if missing:
        raise ValueError(f"snapshot_from_cupy: arrays and dtypes disagree on {sorted(missing)}")
    return TensorSnapshot(int(num_tokens), {n: from_cupy(a, dtypes[n]) for n, a in arrays.items()},
                       dict(meta or {}))
