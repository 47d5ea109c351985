"""The tiered prefix cache (docs/design.md#tiers).

    hashing      block hash chain and cache keys (namespace, model fingerprint, format)
    layout       the byte layout of one block's payload, from a ModelConfig
    global_pool  GlobalKVPool: paged, ref-counted global KV blocks on the GPU
    swa_pool     SwaSnapshotPool: exact SWA snapshots in host DRAM, with a TTL
    store        PersistentStore: verified, crash-safe global KV blocks on SSD (a package)
    manager      PrefixCache: lookup across tiers, insert, adopt, snapshots; for_model/bind
                 tie it to one model (config, KV options, weights identity)
    match        PrefixMatch: one request's cached prefix (referenced pool pages)
    tiers        the tier protocol (lookup, load, put, evict) and one adapter per tier:
                 promotion into pool pages, admission, write-behind
    metrics      counters and histograms (dict and Prometheus text)
    io           the C++ I/O engine (O_DIRECT pread/pwrite, CRC-32C, GDS)
    interop      pool blocks and SWA snapshots as CuPy arrays, no copy (CuPy optional)
    cli          `dsv41 cache stats|verify|gc`

This package never imports the model (it takes a model's identity by duck typing);
engine/cache_adapter.py converts model states to block payloads and snapshots.
docs/cache.md describes the design and the on-disk format.
"""
from __future__ import annotations

from .errors import (CacheError, LayoutError, PayloadError, PoolFullError, StoreError, StoreLockedError,
                     StoreMismatchError, StoreReadOnlyError)
from .global_pool import GlobalKVPool
from .hashing import BlockHasher, CacheKey, model_fingerprint, sha256
from .layout import DEFAULT_BLOCK_TOKENS, PAYLOAD_FORMAT_VERSION, BlockLayout
from .manager import CacheConfig, PrefixCache, PrefixMatch, StoreDisabledWarning
from .metrics import CacheMetrics, MetricsRegistry
from .store import PersistentStore, StoreIdentity
from .swa_pool import SwaSnapshotPool, TensorSnapshot

__all__ = ["BlockHasher", "CacheKey", "model_fingerprint", "sha256", "BlockLayout", "DEFAULT_BLOCK_TOKENS",
           "PAYLOAD_FORMAT_VERSION", "GlobalKVPool", "TensorSnapshot", "SwaSnapshotPool", "PersistentStore",
           "StoreIdentity", "CacheConfig", "PrefixCache", "PrefixMatch", "StoreDisabledWarning", "CacheMetrics",
           "MetricsRegistry", "CacheError", "LayoutError", "PayloadError", "PoolFullError", "StoreError", "StoreLockedError",
           "StoreMismatchError", "StoreReadOnlyError"]
