"""StagingRows: reusable row buffers for blocks on their way from a lower tier into the
pool, so a promotion allocates nothing in the steady state.

A 64K-token promotion of v41-flash stages 1,024 blocks of 56,960 bytes (58 MB); allocating
that per call costs the allocation and a page fault per 4 KiB on first touch, and pinned
host memory (what a CUDA pool needs for one direct copy) costs far more to allocate. A
buffer is lent to one promotion at a time: take(n) returns the smallest free buffer of at
least n rows, or allocates one rounded up to a power of two of rows, and give() returns it;
at most `keep` buffers stay (the largest), so concurrent promotions each get their own and
memory stays bounded by `keep` times the largest promotion. The lock guards only the free
list, never a copy; a device buffer goes back only once the stream's copies out of it ran.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["StagingRows"]


class StagingRows:
    def __init__(self, row_bytes: int, device: str | torch.device = "cpu", pin: bool = False, keep: int = 2):
        self.row_bytes = int(row_bytes)
        self.device = torch.device(device)
        self.pin = pin and self.device.type == "cpu"
        self.keep = keep
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self.allocations = 0     # buffers allocated so far (a test checks reuse)

    def _new(self, rows: int) -> torch.Tensor:
        rows = 1 << max(0, rows - 1).bit_length()
        return torch.empty((rows, self.row_bytes), dtype=torch.uint8, device=self.device, pin_memory=self.pin)

    def take(self, n: int) -> torch.Tensor:
        with self._lock:
            fits = [b for b in self._free if b.shape[0] >= n]
            if fits:
                buf = min(fits, key=lambda b: b.shape[0])
                self._free.remove(buf)
                return buf
            self.allocations += 1
        return self._new(n)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: -b.shape[0])
            del self._free[self.keep:]

    @contextlib.contextmanager
    def rows(self, n: int) -> Iterator[torch.Tensor]:
        """A buffer's first n rows, uint8 [n, row_bytes], lent for the with block."""
        buf = self.take(n)
        try:
            yield buf[:n]
        finally:
            if buf.device.type == "cuda":
                # copies out of it may still be queued on the stream: the next user's reads
                # (cuFile) are not ordered after them
                torch.cuda.current_stream(buf.device).synchronize()
            self.give(buf)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)
