"""The remote tier's side of PrefixCache (cache/manager.py calls these at four points:
construction, after the SSD lookup, after the SWA lookup, and on insert / put_snapshot)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from ..hashing import as_token_array
from ..swa_pool import TensorSnapshot
from .metrics import RemoteMetrics
from .tier import RemoteConfig, RemoteTier

if TYPE_CHECKING:
    from ..manager import PrefixCache, PrefixMatch

__all__ = ["open_tier", "promote_blocks", "find_snapshot", "put_snapshot"]


def open_tier(cache: PrefixCache) -> RemoteTier:
    cc = cache.cache_config
    rc = RemoteConfig(blocks=cc.remote_blocks, snapshots=cc.remote_snapshots,
                      lookup_timeout_s=cc.remote_lookup_timeout_s, write_timeout_s=cc.remote_write_timeout_s,
                      snapshot_ttl_s=cc.remote_snapshot_ttl_s, queue_items=cc.remote_queue_items,
                      breaker_failures=cc.remote_breaker_failures, breaker_cooldown_s=cc.remote_breaker_cooldown_s)
    return RemoteTier(rc, fingerprint=cache.fingerprint, block_tokens=cache.block_tokens,
                      block_bytes=cache.layout.block_bytes, metrics=RemoteMetrics.of(cache.metrics.registry))


def promote_blocks(cache: PrefixCache, m: PrefixMatch, tok: np.ndarray) -> int:
    """Continues the match from the remote tier; returns how many blocks it added."""
    g, pool = m.num_blocks, cache.pool
    rows = cache.remote.load_blocks(m.key, m.namespace, m.hashes, tok, g, cache.hasher.root(m.key))
    if not len(rows):
        return 0
    n = len(rows)
    with pool.lock:
        new = pool.insert_many(m.key, m.block_ids[-1] if g else None, m.hashes[g: g + n], tok[g: g + n], g,
                               torch.from_numpy(rows))
    m.block_ids.extend(new)
    cache.metrics.promotions.inc(len(new))
    return len(new)


def find_snapshot(cache: PrefixCache, m: PrefixMatch, arr: np.ndarray, limit: int) -> None:
    snap = cache.remote.get_snapshot(m.key, m.namespace, arr, m.hashes, cache.hasher.root(m.key),
                                     max_blocks=m.num_blocks, limit=limit)
    if snap is None:
        return
    m.snapshot, m.remote_snapshot = snap, True
    if cache.swa is not None:  # promoted: the next turn of this session finds it locally
        cache.swa.put(m.key, arr[: snap.num_tokens], snap, m.hashes[: snap.num_tokens // cache.block_tokens])


def put_snapshot(cache: PrefixCache, tokens, snapshot: TensorSnapshot, namespace: str,
                 extra: Sequence[tuple[str, str]], hashes: Sequence[bytes] | None) -> None:
    key = cache.key(namespace, extra)
    arr = as_token_array(tokens)[: snapshot.num_tokens]
    nb = arr.size // cache.block_tokens
    if hashes is None or len(hashes) < nb:
        hashes = cache.hasher.hash_blocks(arr[: nb * cache.block_tokens], key)
    cache.remote.enqueue_snapshot(key, namespace, arr, list(hashes[:nb]), cache.hasher.root(key), snapshot)

