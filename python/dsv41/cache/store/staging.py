"""StagingPool: the aligned host buffers a store's reads and writes go through.

A writer allocates its pool once, at open (STAGING_CHUNKS slices of one huge-page-backed
allocation, so each chunk write is one disk request); a read takes the smallest buffer
that fits, or a fresh one, and hands it back. Allocating and zeroing these is a
once-per-store cost that a commit or a lookup must not pay.
"""
from __future__ import annotations

import threading

import numpy as np

from .. import io as _io

__all__ = ["StagingPool"]


class StagingPool:
    def __init__(self, keep: int):
        self._keep = keep  # buffers kept when handed back (the writer's chunks, and two more)
        self._lock = threading.Lock()
        self._free: list[tuple[_io.AlignedBuffer, np.ndarray]] = []
        self._backing = None  # the writer's one allocation, sliced into its chunk buffers

    def preallocate(self, chunks: int, chunk_bytes: int) -> None:
        """`chunks` buffers of chunk_bytes, slices of one allocation (from 2 MiB on it is
        backed by huge pages: io.AlignedBuffer)."""
        self._backing, pool = _io.staging(chunks * chunk_bytes)
        with self._lock:
            self._free = [(pool[i * chunk_bytes: (i + 1) * chunk_bytes],) * 2 for i in range(chunks)]

    def get(self, size: int) -> tuple[_io.AlignedBuffer, np.ndarray]:
        """(buffer, uint8 view) of at least `size` bytes; give it back with put()."""
        with self._lock:
            for i, (buf, _) in enumerate(self._free):
                if buf.size >= size:
                    return self._free.pop(i)
        return _io.staging(max(size, _io.HUGE_BYTES))  # huge-page backed: one disk request per 1 MiB read

    def put(self, item: tuple[_io.AlignedBuffer, np.ndarray]) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(item)
