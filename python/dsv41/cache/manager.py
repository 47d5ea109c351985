"""PrefixCache: the tiers of the prefix cache behind one interface a server can call.

    cache = PrefixCache.for_model(model, CacheConfig(store_dir="/ssd/dsv41"))
    m = cache.match(prompt_ids, namespace="tenant-a")    # verified, pinned, SSD hits promoted
    m.cached_tokens       # block-aligned global KV now in the GPU pool (m.block_ids)
    m.snapshot            # exact SWA state of the longest snapshotted prefix, or None
    ...prefill the rest...
    cache.insert(prompt_ids, payloads, namespace="tenant-a", match=m)  # new full blocks
      or, when the prefill wrote its KV into private pool pages (GlobalKVPool.allocate):
    m = cache.adopt(prompt_ids, page_ids, namespace="tenant-a", match=m)  # no copy
    cache.put_snapshot(prompt_ids, snapshot, namespace="tenant-a")     # end of prompt/output
    cache.release(m)

The tiers answer one protocol (cache/tiers/base.py: lookup, load, put, evict), and this
class asks them in order. Block tiers: the GPU pool ("gpu"), the SSD store ("ssd"), the
remote tier ("remote": Mooncake). A lookup maps the pool's pages, then each lower tier
continues the chain where the ones above stop, its blocks read, verified and written into
new pool pages ("promoted"). Snapshot tiers: the host SWA pool ("swa"), the remote tier
("remote_swa": Redis), V4's SWA checkpoints on the SSD ("ssd_swa"); the first that holds
a usable snapshot serves it, and one from a lower tier is promoted into the host pool. A
snapshot is only returned when the global KV of all its full blocks is in the match, so
resuming from it is exact. Writes to the remote tier are queued for a background writer.

Admission to the SSD tier: with admit_after_hits = 0 (default) a block is written right
after the prefill that computed it; with N > 0 only once it has been matched N times
(sparing SSD wear for prompts that are never reused). The store holds whole prefixes only:
a block is written only when the block before it is stored (or queued before it).

SSD writes leave the request path: with store_write_behind_bytes = N > 0 (default 256 MiB)
insert/match only queue the records and a background thread commits them (adopt queues
even the read of its pages); at most N payload bytes wait in the queue (beyond that the
request commits itself: backpressure, never unbounded memory). A block is acknowledged
(durable with "fsync") when flush() returns; close(), and a process that exits normally
without closing, commit what is queued. A crash (SIGKILL) loses at most what was not yet
acknowledged, never part of a record. With N = 0 insert/match/adopt commit their blocks
before returning (outside the pool lock): what they wrote is acknowledged when they return.

Model identity. Every key holds the model fingerprint (hashing.model_fingerprint): the KV
fingerprint (config + options that change stored bytes) and the weights' identity.
`for_model(model, ...)` takes both from the model (duck-typed: `config`, `kv_fingerprint()`,
`weights_id`, so this package never imports the model) and `bind(model)`, which the Engine
calls, refuses any other model. Without a weights identity the fingerprint cannot tell two
models of one config apart, so such a cache keeps to its memory tiers (bound to the one
model object it was built for) and never opens the persistent store nor the remote tier; a
store directory that cannot be opened for writing (read-only, not a directory) does the
same. Each says so in one warning.
"""
from __future__ import annotations

import logging
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .. import profiling
from ..config import ModelConfig
from .errors import PayloadError, StoreLockedError, StoreMismatchError
from .global_pool import GlobalKVPool
from .hashing import BlockHasher, CacheKey, HashFn, as_token_array, model_fingerprint, sha256
from .layout import DEFAULT_BLOCK_TOKENS, PAYLOAD_FORMAT_VERSION, BlockLayout
from .match import PrefixMatch
from .metrics import CacheMetrics
from .store import DEFAULT_SEGMENT_BYTES, DEFAULT_TTL_S, PersistentStore, StoreIdentity
from .swa_checkpoints import SwaCheckpointStore, default_checkpoint_tokens
from .swa_pool import DEFAULT_TTL_S as SWA_TTL_S
from .swa_pool import SwaSnapshotPool, TensorSnapshot
from .tiers import (BlockTier, CheckpointTier, HostRows, PoolRows, PoolTier, RemoteBlockTier, RemoteSnapshotTier,
                    SnapshotTier, SsdTier, SwaPoolTier, open_remote)

__all__ = ["CacheConfig", "PrefixMatch", "PrefixCache", "StoreDisabledWarning"]


class StoreDisabledWarning(UserWarning):
    """The cache runs without its persistent store (no weights identity, unusable directory)."""


def _model_identity(model) -> tuple[str, str | None]:
    """(kv fingerprint, weights id) of a model, read through its duck-typed interface."""
    try:
        kv, wid = model.kv_fingerprint(), model.weights_id
    except AttributeError:
        raise TypeError(f"expected a dsv41 Model (with kv_fingerprint() and weights_id), got "
                        f"{type(model).__name__}") from None
    return kv, wid

log = logging.getLogger("dsv41.cache")

# Payload bytes that may wait for the background SSD writer before a request commits itself.
DEFAULT_WRITE_BEHIND_BYTES = 256 << 20


@dataclass
class CacheConfig:
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    gpu_capacity_bytes: int = 1 << 30
    device: str | None = None                 # None: cuda when available, else cpu
    swa_capacity_bytes: int | None = None     # None: 10% of physical RAM; 0: no SWA tier
    swa_ttl_s: float | None = SWA_TTL_S
    store_dir: str | None = None              # None: no SSD tier
    store_capacity_bytes: int | None = None
    store_ttl_s: float | None = DEFAULT_TTL_S
    store_durability: str = "fsync"           # or "none"
    store_segment_bytes: int = DEFAULT_SEGMENT_BYTES
    store_on_mismatch: str = "error"          # or "empty"
    store_direct_io: bool = True
    store_write_behind_bytes: int = DEFAULT_WRITE_BEHIND_BYTES  # 0: SSD writes inside insert/match (see above)
    admit_after_hits: int = 0
    hash_fn: HashFn = sha256
    hash_name: str = "sha256"
    io_threads: int = 4
    # Remote tier (cache/remote, docs/remote.md): None = none.
    remote_blocks: str | None = None          # e.g. "mooncake://10.0.0.5:50051"
    remote_snapshots: str | None = None       # e.g. "redis://10.0.0.6:6379/0"
    remote_lookup_timeout_s: float = 0.05     # per remote lookup call (+ transfer time)
    remote_write_timeout_s: float = 2.0       # per background write call
    remote_snapshot_ttl_s: float | None = SWA_TTL_S
    remote_queue_items: int = 256             # queued writes before new ones are dropped
    remote_breaker_failures: int = 3
    remote_breaker_cooldown_s: float = 0.25   # an open breaker probes the backend this often
    # V4's SWA checkpoints on the SSD (cache/swa_checkpoints.py; needs store_dir): every N
    # tokens and at the end of prompt and output. "auto": the model config's
    # persistent_swa_interval_tokens (V4 presets 1024; None for V4.1, whose bounded replay
    # rebuilds the window); None / 0: off.
    swa_checkpoint_tokens: int | str | None = "auto"


class PrefixCache:
    """The tiered prefix cache of one model. Build it with `PrefixCache.for_model(model,
    CacheConfig(...))`; the plain constructor serves tools and tests that have a config but
    no model: `weights_id` then names the weights (None: memory tiers only) and
    `kv_fingerprint` the config + options (default: the config's fingerprint alone)."""


    def __init__(self, config: ModelConfig, cache_config: CacheConfig | None = None, *,
                 weights_id: str | None = None, kv_fingerprint: str | None = None,
                 clock: Callable[[], float] = time.time, metrics: CacheMetrics | None = None,
                 store_fault: Callable[[str], None] | None = None):
        cc = self.cache_config = cache_config or CacheConfig()
        if cc.admit_after_hits < 0:
            raise ValueError(f"admit_after_hits must be >= 0, got {cc.admit_after_hits}")
        self.config = config
        self.layout = BlockLayout(config, cc.block_tokens)
        self.block_tokens = cc.block_tokens
        if weights_id is not None and (not isinstance(weights_id, str) or not weights_id.strip()):
            raise TypeError(f"weights_id must be a non-empty str or None, got {weights_id!r}")
        self.kv_fingerprint = config.fingerprint() if kv_fingerprint is None else kv_fingerprint
        self.weights_id = weights_id
        self.fingerprint = model_fingerprint(self.kv_fingerprint, weights_id)
        self._owner = None            # weakref to the model for_model() built it for
        self.hasher = BlockHasher(cc.block_tokens, cc.hash_fn, cc.hash_name)
        self.metrics = metrics or CacheMetrics()
        self.clock = clock
        self.pool = GlobalKVPool(self.layout, cc.gpu_capacity_bytes, cc.device, self.metrics)
        self.swa = None
        if cc.swa_capacity_bytes != 0:
            self.swa = SwaSnapshotPool(self.hasher, cc.swa_capacity_bytes, cc.swa_ttl_s, clock, self.metrics,
                                       pin_memory=self.pool.device.type == "cuda")
        self.store = None
        self.store_disabled: str | None = None   # why the configured store is not used
        if cc.store_dir is not None:
            self.store = self._open_store(cc, clock, store_fault)
        self.checkpoint_tokens = self._checkpoint_cadence(cc, config)
        self.checkpoints = None
        if self.store is not None and self.checkpoint_tokens:
            self.checkpoints = SwaCheckpointStore(
                f"{cc.store_dir}/swa_checkpoints", cc.block_tokens, durability=cc.store_durability,
                ttl_s=cc.store_ttl_s, capacity_bytes=cc.store_capacity_bytes, clock=clock)
        self.remote = None
        if cc.remote_blocks or cc.remote_snapshots:
            if self.weights_id is None:   # the same rule as the store: a shared tier needs the weights' identity
                self._no_store(
                    "the remote tier is off: the model has no weights identity, so its keys cannot tell it "
                    "from another model with the same config. Memory tiers only. Fix: give the model a "
                    "weights_id (see the store warning's fix) before PrefixCache.for_model(model, ...)")
            else:
                self.remote = open_remote(cc, fingerprint=self.fingerprint, block_tokens=cc.block_tokens,
                                          block_bytes=self.layout.block_bytes, metrics=self.metrics)
        # The tiers, in lookup order (cache/tiers): each owns its object above.
        self.gpu = PoolTier(self.pool)
        self.ssd = None
        if self.store is not None:
            self.ssd = SsdTier(self.store, self.gpu, self.hasher, self.metrics, admit_after_hits=cc.admit_after_hits,
                               write_behind_bytes=cc.store_write_behind_bytes)
        blocks: list[BlockTier] = [self.gpu] + ([self.ssd] if self.ssd is not None else [])
        snapshots: list[SnapshotTier] = [SwaPoolTier(self.swa)] if self.swa is not None else []
        if self.remote is not None:
            blocks.append(RemoteBlockTier(self.remote, self.gpu, self.hasher, self.metrics))
            snapshots.append(RemoteSnapshotTier(self.remote, self.hasher))
        self._checkpoint_tier = None
        if self.checkpoints is not None:
            self._checkpoint_tier = CheckpointTier(self.checkpoints, self.hasher)
            snapshots.append(self._checkpoint_tier)
        self.block_tiers: tuple[BlockTier, ...] = tuple(blocks)
        self.snapshot_tiers: tuple[SnapshotTier, ...] = tuple(snapshots)

    def _checkpoint_cadence(self, cc: CacheConfig, config: ModelConfig) -> int | None:
        n = cc.swa_checkpoint_tokens
        if n == "auto":
            n = default_checkpoint_tokens(config)
        if n is None or n == 0:
            return None
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n % cc.block_tokens:
            raise ValueError(f"swa_checkpoint_tokens must be 'auto', None or a multiple of block_tokens "
                             f"({cc.block_tokens}), got {n!r}")
        return n

    @classmethod
    def for_model(cls, model, cache_config: CacheConfig | None = None, **kw) -> "PrefixCache":
        """The cache for `model`: its keys carry the model's config, KV options and weights
        identity, so it can never serve another model's KV (Engine checks it with bind)."""
        kv, wid = _model_identity(model)
        cache = cls(model.config, cache_config, weights_id=wid, kv_fingerprint=kv, **kw)
        cache._owner = weakref.ref(model)
        return cache

    def bind(self, model) -> None:
        """Raises ValueError unless this cache may serve `model`'s KV: same config, KV
        options and weights identity; without a weights identity, only the very model object
        for_model() built it for."""
        kv, wid = _model_identity(model)
        if model.config.fingerprint() != self.config.fingerprint():
            raise ValueError(f"the cache was built for another model config ({self.config.name!r}, "
                             f"the model is {model.config.name!r})")
        if (kv, wid) != (self.kv_fingerprint, self.weights_id):
            raise ValueError(
                "the cache was built for another model: its model fingerprint "
                f"{self.fingerprint[:16]}... (weights {self.weights_id!r}) differs from the model's "
                f"{model_fingerprint(kv, wid)[:16]}... (weights {wid!r}); build it with "
                "PrefixCache.for_model(model, CacheConfig(...))")
        if wid is None and (self._owner is None or self._owner() is not model):
            raise ValueError("the model has no weights identity, so its cache can serve only the model "
                             "object it was built for: build it with PrefixCache.for_model(model, "
                             "CacheConfig(...)) (and give the model a weights_id to share the cache)")

    def _open_store(self, cc: CacheConfig, clock, store_fault) -> PersistentStore | None:
        if self.weights_id is None:
            return self._no_store(
                f"the persistent store at {cc.store_dir} is off: the model has no weights identity, so "
                "its cache keys cannot tell it from another model with the same config (a fine-tune, "
                "other seeds) and a shared store could serve it their KV. Memory tiers only. Fix: run "
                "`dsv41 digest CKPT_DIR` once for a checkpoint saved elsewhere (save_pretrained records "
                "it), or pass weights_id=... (Model.from_pretrained(dir, weights_id=...), "
                "model.weights_id = ...) before PrefixCache.for_model(model, ...)")
        try:
            return PersistentStore(
                cc.store_dir, self.identity, mode="w", capacity_bytes=cc.store_capacity_bytes,
                ttl_s=cc.store_ttl_s, durability=cc.store_durability, segment_bytes=cc.store_segment_bytes,
                on_mismatch=cc.store_on_mismatch, direct=cc.store_direct_io, io_threads=cc.io_threads,
                clock=clock, metrics=self.metrics, hash_fn=cc.hash_fn, fault=store_fault)
        except (StoreMismatchError, StoreLockedError):
            raise   # the directory works but is another model's, or another writer's: say so
        except OSError as e:
            return self._no_store(
                f"the persistent store at {cc.store_dir} is off: it cannot be opened for writing "
                f"({e.strerror or e}). Memory tiers only. Fix: point store_dir at a writable directory "
                "(or a path whose parent is one), or leave store_dir None")

    def _no_store(self, why: str) -> None:
        self.store_disabled = why
        warnings.warn(why, StoreDisabledWarning, stacklevel=4)
        return None

    @property
    def identity(self) -> StoreIdentity:
        return StoreIdentity(model_fingerprint=self.fingerprint, layout_fingerprint=self.layout.fingerprint(),
                             block_tokens=self.block_tokens, block_bytes=self.layout.block_bytes,
                             payload_format_version=PAYLOAD_FORMAT_VERSION, hash_name=self.hasher.name,
                             digest_bytes=self.hasher.digest_bytes)

    def key(self, namespace: str = "", extra: Sequence[tuple[str, str]] = ()) -> bytes:
        return CacheKey(namespace, self.fingerprint, PAYLOAD_FORMAT_VERSION, tuple(extra)).encode()

    def tier(self, name: str) -> BlockTier | SnapshotTier:
        """The tier of that name ("gpu", "ssd", "remote", "swa", "remote_swa", "ssd_swa")."""
        for t in self.block_tiers + self.snapshot_tiers:
            if t.name == name:
                return t
        raise KeyError(f"this cache has no {name!r} tier (it has "
                       f"{[t.name for t in self.block_tiers + self.snapshot_tiers]})")

    # ---- lookup -------------------------------------------------------------------------

    @profiling.traced("cache.lookup",
                      lambda self, tokens, *a, **k: {"tokens": len(tokens)})
    def match(self, tokens, namespace: str = "", extra: Sequence[tuple[str, str]] = (),
              max_tokens: int | None = None) -> PrefixMatch:
        """The longest verified cached prefix of `tokens` (at most max_tokens tokens; pass
        len(tokens) - 1 when the last token must still run for its logits)."""
        t0 = time.perf_counter()
        m, limit = self._probe(tokens, namespace, extra, max_tokens)
        B, nb = self.block_tokens, len(m.hashes)
        loaded: dict[str, int] = {}
        for tier in self.block_tiers:
            if m.num_blocks == nb:
                break
            loaded[tier.name] = tier.load(m)
        m.gpu_blocks, m.ssd_blocks, m.remote_blocks = (loaded.get(n, 0) for n in ("gpu", "ssd", "remote"))
        served_by = None
        for tier in self.snapshot_tiers:
            snap = tier.load(m, limit)
            if snap is None:
                continue
            m.snapshot, served_by = snap, tier.name
            m.remote_snapshot, m.checkpoint_snapshot = served_by == "remote_swa", served_by == "ssd_swa"
            host = self.snapshot_tiers[0]
            if tier is not host and host.name == "swa":
                # promoted: the session's next turn finds it in host memory
                n = snap.num_tokens
                host.put(m.key, m.namespace, m.tokens[:n], snap, m.hashes[: n // B])
            break
        swa = {t: (m.snapshot_tokens if served_by == t else 0) for t in ("swa", "ssd_swa", "remote_swa")}
        hits = {"gpu": m.gpu_blocks * B, "ssd": m.ssd_blocks * B, "swa": swa["swa"]}
        if self.checkpoints is not None:
            hits["ssd_swa"] = swa["ssd_swa"]
        if self.remote is not None:
            hits.update(remote=m.remote_blocks * B, remote_swa=swa["remote_swa"])
        self.metrics.record_lookup(m.tokens.size, hits)
        self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
        if m.num_blocks:
            for tier in self.block_tiers[1:]:   # admission on hits (the SSD's admit_after_hits)
                tier.put(m, m.num_blocks, None)
        return m

    def peek(self, tokens, namespace: str = "", extra: Sequence[tuple[str, str]] = (),
             max_tokens: int | None = None) -> int:
        """Tokens of the longest prefix of `tokens` the GPU pool holds right now, looked up
        without referencing, promoting or counting anything: a scheduler's estimate before
        it admits a request (match() then takes the references, and may find more on SSD)."""
        m, _ = self._probe(tokens, namespace, extra, max_tokens)
        return self.gpu.lookup(m, 0) * self.block_tokens

    def lookup(self, tokens, namespace: str = "", extra: Sequence[tuple[str, str]] = (),
               max_tokens: int | None = None) -> dict[str, int]:
        """Tokens of the prefix of `tokens` each block tier holds by its own index, each
        continuing where the tiers above stop: {"gpu": ..., "ssd": ..., "remote": ...} for
        the tiers this cache has. Nothing is referenced, read, verified, promoted or counted
        (the remote tier costs one exists call): an estimate of what match() would find,
        which verifies every block."""
        m, _ = self._probe(tokens, namespace, extra, max_tokens)
        out, at = {}, 0
        for tier in self.block_tiers:
            n = tier.lookup(m, at) if at < len(m.hashes) else 0
            out[tier.name] = n * self.block_tokens
            at += n
        return out

    def _probe(self, tokens, namespace: str, extra: Sequence[tuple[str, str]],
               max_tokens: int | None) -> tuple[PrefixMatch, int]:
        """An empty match of the full blocks of `tokens` within the token limit (holding no
        reference), and that limit: what match(), peek() and lookup() ask the tiers about."""
        arr = as_token_array(tokens)
        limit = arr.size if max_tokens is None else max(0, min(arr.size, int(max_tokens)))
        B = self.block_tokens
        key = self.key(namespace, extra)
        hashes = self.hasher.hash_blocks(arr[: limit // B * B], key)
        return PrefixMatch(key, namespace, arr, hashes, [], B), limit

    # ---- inserting and adopting ---------------------------------------------------------

    def _extend(self, tokens, namespace: str, extra: Sequence[tuple[str, str]], match: PrefixMatch | None,
                what: str) -> tuple[PrefixMatch, np.ndarray, int, int, list[bytes]]:
        """(the match, tokens as an array, their full blocks nb, the first new block, the
        chain hashes of blocks 0..nb-1) for insert/adopt; checks the match, changes nothing."""
        arr = as_token_array(tokens)
        B = self.block_tokens
        nb = arr.size // B
        key = self.key(namespace, extra)
        if match is None:
            match = PrefixMatch(key, namespace, arr[:0], [], [], B)
        if match.released:
            raise ValueError(f"{what}: the match was already released")
        if match.key != key:
            raise ValueError(f"{what}: the match belongs to another namespace or key")
        start = match.num_blocks
        if start > nb or not np.array_equal(match.tokens[: start * B], arr[: start * B]):
            raise ValueError(f"{what}: tokens do not extend the match's cached prefix")
        known = len(match.hashes) if np.array_equal(match.tokens[: len(match.hashes) * B],
                                                    arr[: len(match.hashes) * B]) else start
        hashes = list(match.hashes[:known])
        if known < nb:
            hashes += self.hasher.hash_blocks(arr[: nb * B], key, start=known,
                                              parent=hashes[-1] if known else None)
        return match, arr, nb, start, hashes[:nb]

    @profiling.traced("cache.insert", lambda self, tokens, payloads, *a, **k: {
        "tokens": len(tokens), "blocks": len(payloads)})
    def insert(self, tokens, payloads: torch.Tensor, namespace: str = "",
               extra: Sequence[tuple[str, str]] = (), match: PrefixMatch | None = None) -> PrefixMatch:
        """Caches the full blocks of `tokens` after a prefill. `payloads` is uint8
        [n, block_bytes] for the blocks the match does not hold yet (blocks
        match.num_blocks .. len(tokens) // block_tokens - 1), or for all full blocks.
        Returns the match (a new one when none was given) now referencing every block the
        GPU pool could hold; release it when the sequence ends."""
        m, arr, nb, start, hashes = self._extend(tokens, namespace, extra, match, "insert")
        payloads = self.layout.check_blocks(payloads, "payloads")
        if payloads.shape[0] == nb:
            payloads = payloads[start:]
        elif payloads.shape[0] != nb - start:
            raise PayloadError(f"insert: {payloads.shape[0]} payloads; expected {nb - start} (blocks "
                               f"{start}..{nb - 1}) or {nb} (every full block)")
        m.hashes, m.tokens = hashes, arr
        rows = HostRows(payloads, start)
        self.gpu.put(m, start, rows)
        for tier in reversed(self.block_tiers[1:]):   # the remote queue first, the SSD last
            tier.put(m, start, rows)
        return m

    @profiling.traced("cache.adopt", lambda self, tokens, page_ids, *a, **k: {
        "tokens": len(tokens), "blocks": len(page_ids)})
    def adopt(self, tokens, page_ids: Sequence[int], namespace: str = "",
              extra: Sequence[tuple[str, str]] = (), match: PrefixMatch | None = None) -> PrefixMatch:
        """insert() for a prefill that wrote its KV in place: the full blocks of `tokens`
        past the match (blocks match.num_blocks .. len(tokens) // block_tokens - 1, all of
        them without a match) are already in the private pool pages `page_ids`, one per
        block in order (GlobalKVPool.allocate gave them, the caller holding one reference on
        each). No payload is copied: each page is hashed and published in the pool, then
        persisted to the SSD and queued for the remote tier exactly as insert() does, their
        payloads read from the pool by the background writers (with write-behind off, the
        SSD reads them before adopt returns).

        Ownership. On success the caller's reference on every page moves into the match:
        match.block_ids[start + i] is page_ids[i] itself, now a cached block; or, when an
        identical block was cached already, that block, with a new reference the match
        holds, while adopt released the caller's page (a private page is freed then). Read
        match.block_ids[start:] for the page table from now on, never release page_ids
        yourself, and release(match) drops them all. On any error (a page that is not a
        private page of this pool holding a reference, repeated ids, a wrong count, tokens
        that do not extend the match) adopt raises ValueError, nothing is published and the
        caller still owns every page. Returns the match (a new one when none was given)."""
        m, arr, nb, start, hashes = self._extend(tokens, namespace, extra, match, "adopt")
        page_ids = list(page_ids)
        if len(page_ids) != nb - start:
            raise ValueError(f"adopt: {len(page_ids)} pages; expected {nb - start}, one for each of blocks "
                             f"{start}..{nb - 1}")
        before = m.hashes, m.tokens
        m.hashes, m.tokens = hashes, arr
        try:
            self.gpu.adopt(m, page_ids)
        except BaseException:
            m.hashes, m.tokens = before
            raise
        if nb > start and len(self.block_tiers) > 1:
            with PoolRows(self.pool, m.block_ids[start:nb], start) as rows:
                for tier in reversed(self.block_tiers[1:]):
                    tier.put(m, start, rows)
        return m

    # ---- snapshots, release, access -----------------------------------------------------

    @profiling.traced("cache.put_snapshot",
                      lambda self, tokens, *a, **k: {"tokens": len(tokens)})
    def put_snapshot(self, tokens, snapshot: TensorSnapshot, namespace: str = "",
                     extra: Sequence[tuple[str, str]] = (), hashes: Sequence[bytes] | None = None) -> bool:
        """Stores the SWA snapshot of the state after exactly `tokens` (end of prompt, end
        of output) in the host pool, and queues it for the remote tier. Returns False when
        there is no SWA tier or it does not fit. (Checkpoints: put_checkpoint.)"""
        key = self.key(namespace, extra)
        arr = as_token_array(tokens)
        stored = False
        for tier in reversed(self.snapshot_tiers):   # the remote queue first
            if tier is self._checkpoint_tier:
                continue
            ok = tier.put(key, namespace, arr, snapshot, hashes)
            if tier.name == "swa":
                stored = ok
        return stored

    @profiling.traced("cache.put_checkpoint", lambda self, tokens, *a, **k: {"tokens": len(tokens)})
    def put_checkpoint(self, tokens, snapshot: TensorSnapshot, namespace: str = "",
                       extra: Sequence[tuple[str, str]] = ()) -> int:
        """Writes the SWA checkpoint of the state after exactly `tokens` to the SSD (V4's
        SWA persistence; the engine calls it every checkpoint_tokens tokens and at the end
        of prompt and output). Returns the bytes written; 0 when checkpoints are off."""
        if self._checkpoint_tier is None:
            return 0
        key = self.key(namespace, extra)
        return self._checkpoint_tier.put(key, namespace, as_token_array(tokens), snapshot, None)

    def release(self, match: PrefixMatch) -> None:
        if match.released:
            return
        self.pool.release(match.block_ids)
        match.released = True

    @profiling.traced("cache.read_blocks")
    def read_blocks(self, match_or_ids: PrefixMatch | Sequence[int], device: str | torch.device | None = None) -> torch.Tensor:
        """Payloads of a match's blocks (or of block ids), uint8 [n, block_bytes]."""
        ids = match_or_ids.block_ids if isinstance(match_or_ids, PrefixMatch) else list(match_or_ids)
        return self.pool.read(ids, device)

    def evict(self, tiers: Sequence[str] | None = None) -> dict[str, int]:
        """Asks each named tier (default: every one) to drop what it may drop now:
        unreferenced GPU pages, store records past the TTL or the byte cap, expired SWA
        snapshots, checkpoints beyond the byte cap (the remote stores evict on their own).
        Returns the entries each dropped."""
        names = [t.name for t in self.block_tiers + self.snapshot_tiers] if tiers is None else list(tiers)
        return {name: self.tier(name).evict() for name in names}

    def stats(self) -> dict:
        out = {"block_tokens": self.block_tokens, "block_bytes": self.layout.block_bytes,
               "model_fingerprint": self.fingerprint, "weights_id": self.weights_id,
               "store_disabled": self.store_disabled, "gpu": self.pool.stats(),
               "swa": self.swa.stats() if self.swa is not None else None,
               "ssd": self.store.stats() if self.store is not None else None,
               "swa_checkpoints": self.checkpoints.stats() if self.checkpoints is not None else None}
        m = self.metrics
        asked = m.lookup_tokens.value()
        tiers = ("gpu", "ssd", "swa") + (("remote", "remote_swa") if self.remote is not None else ()) \
            + (("ssd_swa",) if self.checkpoints is not None else ())
        out["hit_rate"] = {t: (m.hit_tokens.value(tier=t) / asked if asked else 0.0) for t in tiers}
        out["remote"] = self.remote.stats() if self.remote is not None else None
        out["metrics"] = m.to_dict()
        return out

    def flush(self) -> None:
        """Waits until every block queued for the SSD tier is committed: durable (with
        "fsync") or dropped. With store_write_behind_bytes > 0 (the default) this is when
        they are acknowledged; with 0 insert/match/adopt already waited."""
        if self.ssd is not None:
            self.ssd.flush()

    def close(self) -> None:
        """Stops the remote writer (after what it has queued), then commits what is still
        queued for the SSD (acknowledging it), stops its writer and closes the store."""
        if self.remote is not None:
            self.remote.close()
        if self.ssd is not None:
            self.ssd.close()

    def __enter__(self) -> "PrefixCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
