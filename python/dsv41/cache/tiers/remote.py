"""The remote tier (cache/remote: Mooncake for blocks, Redis for snapshots) as a block tier
and a snapshot tier of the prefix cache. Both share one RemoteTier (its connections, its
breakers and its one background writer); the prefix cache opens it with open_remote."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..hashing import BlockHasher
from ..match import PrefixMatch
from ..metrics import CacheMetrics
from ..remote.base import RemoteUnavailable
from ..remote.metrics import RemoteMetrics
from ..remote.tier import RemoteConfig, RemoteTier
from ..swa_pool import TensorSnapshot
from .base import BlockRows, BlockTier, SnapshotTier
from .pool import PoolTier

__all__ = ["open_remote", "RemoteBlockTier", "RemoteSnapshotTier"]


def open_remote(cc, *, fingerprint: str, block_tokens: int, block_bytes: int, metrics: CacheMetrics) -> RemoteTier:
    """The RemoteTier of a CacheConfig's remote_* settings."""
    rc = RemoteConfig(blocks=cc.remote_blocks, snapshots=cc.remote_snapshots,
                      lookup_timeout_s=cc.remote_lookup_timeout_s, write_timeout_s=cc.remote_write_timeout_s,
                      snapshot_ttl_s=cc.remote_snapshot_ttl_s, queue_items=cc.remote_queue_items,
                      breaker_failures=cc.remote_breaker_failures, breaker_cooldown_s=cc.remote_breaker_cooldown_s)
    return RemoteTier(rc, fingerprint=fingerprint, block_tokens=block_tokens, block_bytes=block_bytes,
                      metrics=RemoteMetrics.of(metrics.registry))


class RemoteBlockTier(BlockTier):
    """Global KV blocks in the remote store, one verified record per block."""

    name = "remote"

    def __init__(self, remote: RemoteTier, gpu: PoolTier, hasher: BlockHasher, metrics: CacheMetrics):
        self.remote, self.gpu, self.hasher, self.metrics = remote, gpu, hasher, metrics

    def lookup(self, m: PrefixMatch, start: int) -> int:
        """Blocks start.. whose keys exist in the remote store (one exists call under the
        lookup deadline; a fault or an open breaker is 0). Values are not fetched or
        verified, so a lookup never counts a hit or a miss."""
        r = self.remote
        want = min(len(m.hashes) - start, r.rc.max_lookup_blocks)
        if r.blocks is None or want <= 0:
            return 0
        try:
            have = r.blocks.call("exists", r.rc.lookup_timeout_s, r.block_keys(m.namespace, m.hashes[start: start + want]))
        except RemoteUnavailable:
            return 0
        return next((i for i, ok in enumerate(have) if not ok), len(have))

    def load(self, m: PrefixMatch) -> int:
        """The longest run the remote store holds past m, verified (RemoteTier.load_blocks),
        filled into new pool pages."""
        g = m.num_blocks
        rows = self.remote.load_blocks(m.key, m.namespace, m.hashes, m.token_rows(), g, self.hasher.root(m.key))
        if not len(rows):
            return 0
        n = self.gpu.fill(m, torch.from_numpy(rows))
        self.metrics.promotions.inc(n)
        return n

    def put(self, m: PrefixMatch, start: int, rows: BlockRows | None) -> None:
        """Queues computed blocks start.. for the background writer (blocks a lookup served
        came from a tier that has them already: not written). Adopted pages are read by the
        writer when it gets to them, and only when the store lacks some of them."""
        r = self.remote
        if rows is None or r.blocks is None or start >= len(m.hashes):
            return
        tok = m.token_rows()
        root = self.hasher.root(m.key)
        if rows.deferred:
            rows.hold()
            r.enqueue_blocks(m.key, m.namespace, m.hashes, tok, start, rows.host, root, on_done=rows.release)
        else:
            r.enqueue_blocks(m.key, m.namespace, m.hashes, tok, start, rows.host(stable=True), root)

    def evict(self) -> int:
        """0: the remote stores evict by their own policy (Mooncake's LRU, Redis TTLs and
        maxmemory), and their entries are shared with other servers."""
        return 0

    def stats(self) -> dict:
        return self.remote.stats()


class RemoteSnapshotTier(SnapshotTier):
    """SWA snapshots in the remote store, one verified record per snapshot."""

    name = "remote_swa"

    def __init__(self, remote: RemoteTier, hasher: BlockHasher):
        self.remote, self.hasher = remote, hasher

    def load(self, m: PrefixMatch, limit: int) -> TensorSnapshot | None:
        return self.remote.get_snapshot(m.key, m.namespace, m.tokens, m.hashes, self.hasher.root(m.key),
                                        max_blocks=m.num_blocks, limit=limit)

    def put(self, key: bytes, namespace: str, tokens: np.ndarray, snapshot: TensorSnapshot,
            hashes: Sequence[bytes] | None) -> bool:
        """Queues the snapshot for the background writer; False when it was not queued."""
        B = self.hasher.block_tokens
        arr = tokens[: snapshot.num_tokens]
        nb = arr.size // B
        if hashes is None or len(hashes) < nb:
            hashes = self.hasher.hash_blocks(arr[: nb * B], key)
        return self.remote.enqueue_snapshot(key, namespace, arr, list(hashes[:nb]), self.hasher.root(key), snapshot)

    def evict(self) -> int:
        """0: snapshots expire in the remote store (snapshot_ttl_s) on their own."""
        return 0
