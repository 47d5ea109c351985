"""SwaSnapshotPool: the host-DRAM tier of exact SWA state, short-lived.

A snapshot is everything a sequence needs, besides its block-aligned global KV, to resume
exactly where it stopped: the SWA windows of all layers, the global KV of the tail past the
last full block, and the compressors' partial state. The cache does not look inside: a
`TensorSnapshot` is a dict of named tensors plus JSON-able metadata, with its byte size
(engine/cache_adapter.py converts the model's `dsv41.model.SwaSnapshot` to and from it).

Snapshots are keyed by the exact token prefix they cover (and the cache key). They are
indexed under the chain hash of their last full block, so a lookup probes one dict entry
per block boundary of the request, longest first, and compares the stored token ids in full
before it serves one: a hash collision is a miss.

Capacity (default 10% of physical RAM) and TTL (default 5 minutes, counted from the last
put or get: expire-after-access) are both configurable; within the TTL the least recently
used snapshot goes first when room is needed. `get` returns a copy, so a resumed session
can never modify what the pool holds.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .errors import PayloadError
from .hashing import BlockHasher, as_token_array
from .metrics import CacheMetrics

__all__ = ["TensorSnapshot", "SwaSnapshotPool", "default_swa_capacity"]

DEFAULT_TTL_S = 300.0
_ENTRY_OVERHEAD = 512  # bookkeeping bytes charged per snapshot


def default_swa_capacity(fraction: float = 0.10) -> int:
    """`fraction` of this host's physical RAM."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction)


@dataclass
class TensorSnapshot:
    """A sequence's non-block state after `num_tokens` tokens: named tensors + metadata."""

    num_tokens: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.num_tokens, int) or self.num_tokens < 0:
            raise PayloadError(f"num_tokens must be an int >= 0, got {self.num_tokens!r}")
        for name, t in self.tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise PayloadError(f"snapshot tensors must map str -> torch.Tensor, got {name!r}: {type(t).__name__}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def clone(self, device: str | torch.device = "cpu", pin: bool = False) -> "TensorSnapshot":
        """A deep copy on `device` (contiguous tensors, same dtypes and shapes)."""
        out = {}
        for name, t in self.tensors.items():
            c = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin and torch.device(device).type == "cpu")
            c.copy_(t)
            out[name] = c
        import copy
        return TensorSnapshot(self.num_tokens, out, copy.deepcopy(self.meta))


_ALIGN = 64  # every tensor starts 64-byte aligned inside the flat buffer (view(dtype) needs it)


class _Packed:
    """A snapshot held as one flat host buffer plus (name, dtype, shape, offset) per tensor:
    put is one copy per tensor into a single allocation, get one copy of the whole buffer
    and free views."""

    __slots__ = ("num_tokens", "meta", "flat", "specs", "nbytes")

    def __init__(self, snap: TensorSnapshot, pin: bool, spare: Callable[[int], torch.Tensor | None] = lambda n: None):
        specs, off = [], 0
        for name, t in snap.tensors.items():
            n = t.numel() * t.element_size()
            specs.append((name, t.dtype, tuple(t.shape), off, n))
            off += -(-n // _ALIGN) * _ALIGN
        reuse = spare(max(off, 1))  # a buffer of an evicted snapshot: its pages are already mapped
        self.flat = reuse if reuse is not None else torch.empty(max(off, 1), dtype=torch.uint8, pin_memory=pin)
        flat = self.flat.numpy()
        for (name, _, _, o, n), t in zip(specs, snap.tensors.values()):
            if not n:
                continue
            if t.device.type == "cpu" and t.dim() and not t.requires_grad and t.is_contiguous():
                # A plain memcpy, with as few torch calls as possible (each costs microseconds,
                # and torch's copy_ may wake its thread pool).
                src = t.numpy() if t.dtype == torch.uint8 else t.view(torch.uint8).numpy()
                flat[o: o + n] = src.reshape(-1)
                continue
            src = t.detach().contiguous().reshape(-1)
            if src.dtype != torch.uint8:
                src = src.view(torch.uint8)
            if src.device.type == "cpu":
                flat[o: o + n] = src.numpy()
            else:
                self.flat[o: o + n].copy_(src)
        import copy
        self.num_tokens, self.meta, self.specs, self.nbytes = snap.num_tokens, copy.deepcopy(snap.meta), specs, snap.nbytes

    def unpack(self, device: str | torch.device = "cpu") -> TensorSnapshot:
        tensors = {}
        if torch.device(device).type == "cpu":
            flat = self.flat.numpy().copy()
            for name, dtype, shape, o, n in self.specs:
                t = torch.from_numpy(flat[o: o + n].reshape(shape if dtype == torch.uint8 else -1))
                tensors[name] = t if dtype == torch.uint8 else t.view(dtype).view(shape)
        else:
            flat = self.flat.to(device, non_blocking=self.flat.is_pinned())
            for name, dtype, shape, o, n in self.specs:
                tensors[name] = flat[o: o + n].view(dtype).view(shape)
        import copy
        return TensorSnapshot(self.num_tokens, tensors, copy.deepcopy(self.meta))


class _Entry:
    __slots__ = ("key", "tokens", "snap", "nbytes", "atime", "anchor")

    def __init__(self, key, tokens, snap, nbytes, atime, anchor):
        self.key, self.tokens, self.snap, self.nbytes, self.atime, self.anchor = \
            key, tokens, snap, nbytes, atime, anchor


class SwaSnapshotPool:
    def __init__(self, hasher: BlockHasher, capacity_bytes: int | None = None, ttl_s: float | None = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic, metrics: CacheMetrics | None = None,
                 pin_memory: bool = False):
        self.hasher = hasher
        self.block_tokens = hasher.block_tokens
        self.capacity_bytes = default_swa_capacity() if capacity_bytes is None else int(capacity_bytes)
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.ttl_s = ttl_s
        self.clock = clock
        self.metrics = metrics or CacheMetrics()
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._lock = threading.RLock()
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._by_anchor: dict[bytes, set[int]] = {}
        self._next_id = 1
        self.used_bytes = 0
        self._spare: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._lru)

    def _anchor(self, key: bytes, tokens: np.ndarray, hashes: Sequence[bytes] | None) -> bytes:
        k = tokens.size // self.block_tokens
        if k == 0:
            return self.hasher.root(key)
        if hashes is not None and len(hashes) >= k:
            return hashes[k - 1]
        return self.hasher.hash_blocks(tokens[: k * self.block_tokens], key)[-1]

    def _expired(self, e: _Entry, now: float) -> bool:
        return self.ttl_s is not None and now - e.atime > self.ttl_s

    def _take_spare(self, size: int) -> torch.Tensor | None:
        with self._lock:
            for i, t in enumerate(self._spare):
                if t.numel() == size:
                    return self._spare.pop(i)
        return None

    def _remove(self, eid: int, cause: str) -> None:
        e = self._lru.pop(eid)
        if len(self._spare) < 4:  # get() hands out copies, so nothing else refers to it
            self._spare.append(e.snap.flat)
        ids = self._by_anchor.get(e.anchor)
        if ids is not None:
            ids.discard(eid)
            if not ids:
                del self._by_anchor[e.anchor]
        self.used_bytes -= e.nbytes
        self.metrics.evictions.inc(tier="swa", cause=cause)

    def sweep(self) -> int:
        """Drops every expired snapshot; returns how many."""
        with self._lock:
            now = self.clock()
            dead = [eid for eid, e in self._lru.items() if self._expired(e, now)]
            for eid in dead:
                self._remove(eid, "ttl")
            self._update_gauges()
            return len(dead)

    def put(self, key: bytes, tokens, snapshot: TensorSnapshot, hashes: Sequence[bytes] | None = None) -> bool:
        """Stores a copy of `snapshot`, the state after exactly `tokens` (len(tokens) ==
        snapshot.num_tokens). Replaces a snapshot of the same prefix. Returns False (and
        stores nothing) when the snapshot alone exceeds the capacity."""
        t0 = time.perf_counter()
        arr = as_token_array(tokens)
        if arr.size != snapshot.num_tokens:
            raise PayloadError(f"snapshot covers {snapshot.num_tokens} tokens but {arr.size} token ids were given")
        nbytes = snapshot.nbytes + arr.nbytes + len(key) + _ENTRY_OVERHEAD
        if nbytes > self.capacity_bytes:
            return False
        anchor = self._anchor(key, arr, hashes)
        copy = _Packed(snapshot, self.pin_memory, self._take_spare)
        with self._lock:
            now = self.clock()
            for eid in list(self._by_anchor.get(anchor, ())):
                e = self._lru[eid]
                if e.key == key and e.tokens.size == arr.size and np.array_equal(e.tokens, arr):
                    self._remove(eid, "replaced")
            for eid in [eid for eid, e in self._lru.items() if self._expired(e, now)]:
                self._remove(eid, "ttl")
            while self.used_bytes + nbytes > self.capacity_bytes:
                self._remove(next(iter(self._lru)), "capacity")
            eid = self._next_id
            self._next_id += 1
            self._lru[eid] = _Entry(key, arr.copy(), copy, nbytes, now, anchor)
            self._by_anchor.setdefault(anchor, set()).add(eid)
            self.used_bytes += nbytes
            self._update_gauges()
        self.metrics.inserted_blocks.inc(tier="swa")
        self.metrics.bytes_written.inc(snapshot.nbytes, tier="swa")
        self.metrics.snapshot_seconds.observe(time.perf_counter() - t0, op="put")
        return True

    def get(self, key: bytes, tokens, hashes: Sequence[bytes] | None = None, max_tokens: int | None = None,
            min_tokens: int = 0, device: str | torch.device = "cpu") -> TensorSnapshot | None:
        """A copy of the snapshot of the longest prefix of `tokens` (at most max_tokens,
        at least min_tokens long) stored under `key`, or None."""
        t0 = time.perf_counter()
        arr = as_token_array(tokens)
        limit = arr.size if max_tokens is None else min(arr.size, max_tokens)
        B = self.block_tokens
        if hashes is None or len(hashes) < limit // B:
            hashes = self.hasher.hash_blocks(arr[: limit // B * B], key)
        found = None
        with self._lock:
            now = self.clock()
            for k in range(limit // B, -1, -1):
                if (k + 1) * B <= min_tokens:
                    break
                anchor = self._anchor(key, arr[: k * B], hashes)
                best = None
                for eid in self._by_anchor.get(anchor, ()):
                    e = self._lru[eid]
                    n = e.tokens.size
                    if n > limit or n < min_tokens or e.key != key or (best is not None and n <= best[1].tokens.size):
                        continue
                    if self._expired(e, now):
                        continue
                    if np.array_equal(e.tokens, arr[:n]):
                        best = (eid, e)
                    elif not np.array_equal(e.tokens[: k * B], arr[: k * B]):
                        # Same anchor hash, other full blocks: a hash collision. (A different
                        # tail after the same blocks is just another snapshot.)
                        self.metrics.collisions.inc(tier="swa")
                if best is not None:
                    eid, e = best
                    e.atime = now
                    self._lru.move_to_end(eid)
                    found = e.snap
                    break
        if found is None:
            return None
        out = found.unpack(device)
        self.metrics.bytes_read.inc(found.nbytes, tier="swa")
        self.metrics.snapshot_seconds.observe(time.perf_counter() - t0, op="get")
        return out

    def _update_gauges(self) -> None:
        self.metrics.entries.set(len(self._lru), tier="swa")
        self.metrics.bytes.set(self.used_bytes, tier="swa")

    def stats(self) -> dict:
        with self._lock:
            return {"snapshots": len(self._lru), "used_bytes": self.used_bytes,
                    "capacity_bytes": self.capacity_bytes, "ttl_s": self.ttl_s}
