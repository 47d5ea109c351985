"""How often a CUDA op ran its slow generic kernel instead of a tensor-core one, and why.

The attention and indexer ops record each such call here (`dsv41.ops.fallbacks`); the
first call for each (op, reason) is logged as a warning on the `dsv41.ops` logger, the
rest only counted. The engine and the server read the counts:

    from dsv41 import ops
    ops.fallbacks.total()        # calls that fell back, all ops
    ops.fallbacks.counts()       # {"sparse_attention: W + K > 4096 keys per query": 3, ...}

What is counted: calls issued from Python. A CUDA graph replays its captured kernels
without Python, so a captured step counts once, at capture. A kernel asked for by name
(the generic kernel through a plan, say) is a choice, not a fallback, and is not counted.
"""
from __future__ import annotations

import logging
import threading

__all__ = ["KernelFallbacks", "fallbacks"]

log = logging.getLogger("dsv41.ops")


class KernelFallbacks:
    """Counts per (op, reason); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def record(self, op: str, reason: str) -> None:
        with self._lock:
            n = self._counts.get((op, reason), 0)
            self._counts[(op, reason)] = n + 1
        if n == 0:
            log.warning("%s: running the generic CUDA kernel (%s); counted in dsv41.ops.fallbacks, "
                        "logged once", op, reason)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {f"{op}: {reason}": n for (op, reason), n in sorted(self._counts.items())}

    def items(self) -> list[tuple[str, str, int]]:
        """(op, reason, calls) of every kind seen, for metrics labels."""
        with self._lock:
            return [(op, reason, n) for (op, reason), n in sorted(self._counts.items())]

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def clear(self) -> None:
        """Forget every count (the next fallback of each kind is logged again)."""
        with self._lock:
            self._counts.clear()


fallbacks = KernelFallbacks()
