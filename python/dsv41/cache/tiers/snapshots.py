"""The local snapshot tiers: the host SWA snapshot pool (swa_pool.SwaSnapshotPool) and V4's
SWA checkpoints on the SSD (swa_checkpoints.SwaCheckpointStore)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..hashing import BlockHasher
from ..match import PrefixMatch
from ..swa_checkpoints import SwaCheckpointStore
from ..swa_pool import SwaSnapshotPool, TensorSnapshot
from .base import SnapshotTier

__all__ = ["SwaPoolTier", "CheckpointTier"]


class SwaPoolTier(SnapshotTier):
    """Exact SWA snapshots in host memory, short-lived (TTL since last use)."""

    name = "swa"

    def __init__(self, swa: SwaSnapshotPool):
        self.swa = swa

    def load(self, m: PrefixMatch, limit: int) -> TensorSnapshot | None:
        """The pool's longest snapshot of m's tokens within limit, when m holds the global
        KV of all its full blocks (else None: resuming from it would miss global KV)."""
        snap = self.swa.get(m.key, m.tokens, m.hashes, max_tokens=limit)
        if snap is not None and snap.num_tokens // m.block_tokens <= m.num_blocks:
            return snap
        return None

    def put(self, key: bytes, namespace: str, tokens: np.ndarray, snapshot: TensorSnapshot,
            hashes: Sequence[bytes] | None) -> bool:
        """Stores a copy; False when it does not fit (tokens: exactly the snapshot's)."""
        return self.swa.put(key, tokens, snapshot, hashes)

    def evict(self) -> int:
        """Drops the expired snapshots (capacity evicts on put)."""
        return self.swa.sweep()

    def stats(self) -> dict:
        return self.swa.stats()


class CheckpointTier(SnapshotTier):
    """V4's SWA checkpoints: one verified record file per checkpoint beside the block store."""

    name = "ssd_swa"

    def __init__(self, checkpoints: SwaCheckpointStore, hasher: BlockHasher):
        self.checkpoints, self.hasher = checkpoints, hasher

    def load(self, m: PrefixMatch, limit: int) -> TensorSnapshot | None:
        return self.checkpoints.get(m.key, m.tokens, m.hashes, self.hasher.root(m.key),
                                    max_blocks=m.num_blocks, limit=limit)

    def put(self, key: bytes, namespace: str, tokens: np.ndarray, snapshot: TensorSnapshot,
            hashes: Sequence[bytes] | None) -> int:
        """Writes the checkpoint of the state after tokens[:snapshot.num_tokens]; returns
        the bytes written."""
        B = self.hasher.block_tokens
        arr = tokens[: snapshot.num_tokens]
        nb = arr.size // B
        if hashes is None or len(hashes) < nb:
            hashes = self.hasher.hash_blocks(arr[: nb * B], key)
        return self.checkpoints.put(key, arr, snapshot, list(hashes[:nb]), self.hasher.root(key))

    def evict(self) -> int:
        """Drops the oldest checkpoint files beyond the byte budget; returns how many."""
        return self.checkpoints.trim()

    def stats(self) -> dict:
        return self.checkpoints.stats()
