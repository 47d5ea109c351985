"""PrefixMatch: one request's verified cached prefix, the unit every tier works on.

A match names a chain of full blocks (the cache key, the chain hash and token ids of each
block) and holds one GlobalKVPool reference on each page in `block_ids`, block 0 onward,
until PrefixCache.release(). Because a match references every page of its chain from the
first, none of them can be evicted or orphaned while it lives (the pool orphans a
referenced page only when it evicts an unreferenced ancestor of it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .swa_pool import TensorSnapshot

__all__ = ["PrefixMatch"]


@dataclass
class PrefixMatch:
    """A verified cached prefix of one request, holding references on its GPU blocks until
    PrefixCache.release()."""

    key: bytes
    namespace: str
    tokens: np.ndarray            # the request's token ids, uint32
    hashes: list[bytes]           # chain hashes of the request's full blocks
    block_ids: list[int]          # referenced GlobalKVPool blocks, one per cached block
    block_tokens: int
    gpu_blocks: int = 0           # blocks found in the GPU pool
    ssd_blocks: int = 0           # blocks loaded from the SSD tier into the pool
    remote_blocks: int = 0        # blocks loaded from the remote tier into the pool
    remote_snapshot: bool = False  # the snapshot came from the remote tier
    checkpoint_snapshot: bool = False  # the snapshot came from an SWA checkpoint on the SSD
    snapshot: TensorSnapshot | None = None
    released: bool = field(default=False, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def cached_tokens(self) -> int:
        """Tokens whose global KV the match holds (a multiple of block_tokens, hence of
        every compress ratio)."""
        return len(self.block_ids) * self.block_tokens

    @property
    def snapshot_tokens(self) -> int:
        return self.snapshot.num_tokens if self.snapshot is not None else 0

    def token_rows(self, n: int | None = None) -> np.ndarray:
        """The token ids of the chain's first n full blocks (default: every hashed block),
        uint32 [n, block_tokens]: a view."""
        n = len(self.hashes) if n is None else n
        return self.tokens[: n * self.block_tokens].reshape(n, self.block_tokens)
