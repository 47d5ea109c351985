"""PrefixCache: the three tiers behind one interface a server can call.

    cache = PrefixCache.for_model(model, CacheConfig(store_dir="/ssd/dsv41"))
    m = cache.match(prompt_ids, namespace="tenant-a")    # verified, pinned, SSD hits promoted
    m.cached_tokens       # block-aligned global KV now in the GPU pool (m.block_ids)
    m.snapshot            # exact SWA state of the longest snapshotted prefix, or None
    ...prefill the rest...
    cache.insert(prompt_ids, payloads, namespace="tenant-a", match=m)  # new full blocks
    cache.put_snapshot(prompt_ids, snapshot, namespace="tenant-a")     # end of prompt/output
    cache.release(m)

Lookup order: the GPU pool first, then the SSD store continues the chain where the pool
stops (its blocks are read, verified and copied into the pool: "promoted"), then the remote
tier continues it (cache/remote: Mooncake, Redis; promoted the same way), then the SWA
pool is asked for the longest snapshotted prefix, and the remote tier when it has none. A
snapshot is only returned when the global KV of all its full blocks is in the match, so
resuming from it is exact. Writes to the remote tier are queued for a background writer.

Admission to the SSD tier: with admit_after_hits = 0 (default) a block is written right
after the prefill that computed it; with N > 0 only once it has been matched N times
(sparing SSD wear for prompts that are never reused). The store holds whole prefixes only:
a block is written only when the block before it is stored (or queued before it).

SSD writes leave the request path: with store_write_behind_bytes = N > 0 (default 256 MiB)
insert/match only queue the records and a background thread commits them; at most N payload
bytes wait in the queue (beyond that the request commits itself: backpressure, never
unbounded memory). A block is acknowledged (durable with "fsync") when flush() returns;
close(), and a process that exits normally without closing, commit what is queued. A crash
(SIGKILL) loses at most what was not yet acknowledged, never part of a record. With N = 0
insert/match commit their blocks before returning (outside the pool lock): what they wrote
is acknowledged when they return.

Model identity. Every key holds the model fingerprint (hashing.model_fingerprint): the KV
fingerprint (config + options that change stored bytes) and the weights' identity.
`for_model(model, ...)` takes both from the model (duck-typed: `config`, `kv_fingerprint()`,
`weights_id`, so this package never imports the model) and `bind(model)`, which the Engine
calls, refuses any other model. Without a weights identity the fingerprint cannot tell two
models of one config apart, so such a cache keeps to its memory tiers (bound to the one
model object it was built for) and never opens the persistent store; a store directory
that cannot be opened for writing (read-only, not a directory) does the same. Each says
so in one warning.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from .. import profiling
from ..config import ModelConfig
from .errors import MissingParentError, PayloadError, StoreLockedError, StoreMismatchError
from .global_pool import GlobalKVPool
from .hashing import BlockHasher, CacheKey, HashFn, as_token_array, model_fingerprint, sha256
from .layout import DEFAULT_BLOCK_TOKENS, PAYLOAD_FORMAT_VERSION, BlockLayout
from .metrics import CacheMetrics
from .remote import hook as _remote
from .store import DEFAULT_SEGMENT_BYTES, DEFAULT_TTL_S, PersistentStore, StoreIdentity
from .swa_pool import DEFAULT_TTL_S as SWA_TTL_S
from .swa_checkpoints import SwaCheckpointStore, default_checkpoint_tokens
from .swa_pool import SwaSnapshotPool, TensorSnapshot

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
        self._persist_lock = threading.Lock()
        self._committer = None
        if self.store is not None and cc.store_write_behind_bytes > 0:
            self._committer = _BackgroundCommitter(self.store)
        self.remote = None
        if cc.remote_blocks or cc.remote_snapshots:
            if self.weights_id is None:   # the same rule as the store: a shared tier needs the weights' identity
                self._no_store(
                    "the remote tier is off: the model has no weights identity, so its keys cannot tell it "
                    "from another model with the same config. Memory tiers only. Fix: give the model a "
                    "weights_id (see the store warning's fix) before PrefixCache.for_model(model, ...)")
            else:
                self.remote = _remote.open_tier(self)

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

    # ---- lookup -------------------------------------------------------------------------

    @profiling.traced("cache.lookup",
                      lambda self, tokens, *a, **k: {"tokens": len(tokens)})
    def match(self, tokens, namespace: str = "", extra: Sequence[tuple[str, str]] = (),
              max_tokens: int | None = None) -> PrefixMatch:
        """The longest verified cached prefix of `tokens` (at most max_tokens tokens; pass
        len(tokens) - 1 when the last token must still run for its logits)."""
        t0 = time.perf_counter()
        arr, limit, key, hashes, tok = self._blocks(tokens, namespace, extra, max_tokens)
        B, nb = self.block_tokens, len(hashes)
        pool = self.pool
        with pool.lock:
            bids = pool.match(key, hashes, tok)
            pool.acquire(bids)
            for b in bids:
                pool.slot(b).hits += 1
        m = PrefixMatch(key, namespace, arr, hashes, bids, B, gpu_blocks=len(bids))
        if self.store is not None and len(bids) < nb:
            m.ssd_blocks = self._promote(m, tok)
        if self.remote is not None and m.num_blocks < nb:
            m.remote_blocks = _remote.promote_blocks(self, m, tok)
        if self.swa is not None:
            snap = self.swa.get(key, arr, hashes, max_tokens=limit)
            if snap is not None and snap.num_tokens // B <= m.num_blocks:
                m.snapshot = snap
        if self.remote is not None and m.snapshot is None:
            _remote.find_snapshot(self, m, arr, limit)
        if self.checkpoints is not None and m.snapshot is None:
            self._find_checkpoint(m, arr, limit)
        local_swa = 0 if (m.remote_snapshot or m.checkpoint_snapshot) else m.snapshot_tokens
        hits = {"gpu": m.gpu_blocks * B, "ssd": m.ssd_blocks * B, "swa": local_swa}
        if self.checkpoints is not None:
            hits["ssd_swa"] = m.snapshot_tokens if m.checkpoint_snapshot else 0
        if self.remote is not None:
            hits.update(remote=m.remote_blocks * B, remote_swa=m.snapshot_tokens if m.remote_snapshot else 0)
        self.metrics.record_lookup(arr.size, hits)
        self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
        if self.store is not None and m.num_blocks:
            n = self.cache_config.admit_after_hits
            self._persist(m, m.num_blocks, None, 0,
                          admit=lambda slot: slot is not None and slot.hits >= n)
        return m

    def peek(self, tokens, namespace: str = "", extra: Sequence[tuple[str, str]] = (),
             max_tokens: int | None = None) -> int:
        """Tokens of the longest prefix of `tokens` the GPU pool holds right now, looked up
        without referencing, promoting or counting anything: a scheduler's estimate before
        it admits a request (match() then takes the references, and may find more on SSD)."""
        _, _, key, hashes, tok = self._blocks(tokens, namespace, extra, max_tokens)
        return len(self.pool.match(key, hashes, tok)) * self.block_tokens

    def _blocks(self, tokens, namespace: str, extra: Sequence[tuple[str, str]], max_tokens: int | None):
        """(tokens as an array, the token limit, the key, the chained hashes and the token
        rows of the full blocks within the limit): what match() and peek() look up."""
        arr = as_token_array(tokens)
        limit = arr.size if max_tokens is None else max(0, min(arr.size, int(max_tokens)))
        B = self.block_tokens
        nb = limit // B
        key = self.key(namespace, extra)
        hashes = self.hasher.hash_blocks(arr[: nb * B], key)
        return arr, limit, key, hashes, arr[: nb * B].reshape(nb, B)

    @profiling.traced("cache.ssd_promote",
                      lambda self, m, tok: {"blocks": len(m.hashes) - m.num_blocks})
    def _promote(self, m: PrefixMatch, tok: np.ndarray) -> int:
        """Continues the match from the SSD tier; returns how many blocks it added."""
        store, pool = self.store, self.pool
        g = m.num_blocks
        parent_rid = 0
        if g:
            with pool.lock:
                slots = [pool.slot(b) for b in m.block_ids]
                rids = self._stored_records(slots)
            first = next((j for j, r in enumerate(rids) if r is None), g)
            if first < g:
                # GPU blocks that do not know their record (written by another process, or
                # before a restart): find and verify them, or the chain cannot continue.
                found = self._find_stored(m, tok, first, g, rids[first - 1] if first else 0)
                with pool.lock:
                    for j, rid in enumerate(found):
                        slots[first + j].record_id = rid
                if first + len(found) < g:
                    return 0
            parent_rid = slots[-1].record_id
        rest = len(m.hashes) - g
        if pool.device.type == "cuda" and store.gds_available:
            # GPUDirect Storage: SSD -> device staging, checked there (see read_into).
            staging = torch.empty((rest, self.layout.block_bytes), dtype=torch.uint8, device=pool.device)
            rids = store.load(m.key, m.hashes[g:], tok[g:], staging, parent=parent_rid)
        else:
            staging = torch.empty((rest, self.layout.block_bytes), dtype=torch.uint8,
                                  pin_memory=pool.device.type == "cuda")
            rids = store.load(m.key, m.hashes[g:], tok[g:], staging.numpy(), parent=parent_rid)
        if not rids:
            return 0
        with pool.lock:
            new = pool.insert_many(m.key, m.block_ids[-1] if g else None, m.hashes[g: g + len(rids)],
                                   tok[g: g + len(rids)], g, staging[: len(rids)], record_ids=rids)
        m.block_ids.extend(new)
        self.metrics.promotions.inc(len(new))
        return len(new)

    def _stored_records(self, slots: list) -> list[int | None]:
        """Record ids of the slots' blocks that the store still holds (call under the pool
        lock). The store may have dropped a chain the pool still references (LRU eviction
        under its byte cap, TTL expiry, verify --repair, a failed read): such a block is
        treated as not stored, its stale id is forgotten, and _persist writes it again."""
        out = []
        for s in slots:
            rid = s.record_id
            if rid is not None and not self.store.holds(rid):
                s.record_id = rid = None
            out.append(rid)
        return out

    def _find_stored(self, m: PrefixMatch, tok: np.ndarray, first: int, upto: int, parent: int) -> list[int]:
        """Record ids of the blocks first, first+1, ... (below record `parent`) that the store
        already holds, read and verified; stops at the first one it lacks."""
        chain = self.store.walk(m.key, m.hashes[first:upto], parent)
        if not chain:
            return []
        status = self.store.read(chain, tok[first: first + len(chain)], m.key, None)
        k = next((j for j, st in enumerate(status) if st != "ok"), len(status))
        return chain[:k]

    # ---- inserting ----------------------------------------------------------------------

    @profiling.traced("cache.insert", lambda self, tokens, payloads, *a, **k: {
        "tokens": len(tokens), "blocks": len(payloads)})
    def insert(self, tokens, payloads: torch.Tensor, namespace: str = "",
               extra: Sequence[tuple[str, str]] = (), match: PrefixMatch | None = None) -> PrefixMatch:
        """Caches the full blocks of `tokens` after a prefill. `payloads` is uint8
        [n, block_bytes] for the blocks the match does not hold yet (blocks
        match.num_blocks .. len(tokens) // block_tokens - 1), or for all full blocks.
        Returns the match (a new one when none was given) now referencing every block the
        GPU pool could hold; release it when the sequence ends."""
        arr = as_token_array(tokens)
        B = self.block_tokens
        nb = arr.size // B
        key = self.key(namespace, extra)
        if match is None:
            match = PrefixMatch(key, namespace, arr[:0], [], [], B)
        if match.released:
            raise ValueError("insert: the match was already released")
        if match.key != key:
            raise ValueError("insert: the match belongs to another namespace or key")
        start = match.num_blocks
        if start > nb or not np.array_equal(match.tokens[: start * B], arr[: start * B]):
            raise ValueError("insert: tokens do not extend the match's cached prefix")
        payloads = self.layout.check_blocks(payloads, "payloads")
        if payloads.shape[0] == nb:
            payloads = payloads[start:]
        elif payloads.shape[0] != nb - start:
            raise PayloadError(f"insert: {payloads.shape[0]} payloads; expected {nb - start} (blocks "
                               f"{start}..{nb - 1}) or {nb} (every full block)")
        known = len(match.hashes) if np.array_equal(match.tokens[: len(match.hashes) * B],
                                                    arr[: len(match.hashes) * B]) else start
        hashes = list(match.hashes[:known])
        if known < nb:
            hashes += self.hasher.hash_blocks(arr[: nb * B], key, start=known,
                                              parent=hashes[-1] if known else None)
        tok = arr[: nb * B].reshape(nb, B)
        with self.pool.lock:
            new = self.pool.insert_many(key, match.block_ids[-1] if start else None, hashes[start:nb],
                                        tok[start:nb], start, payloads)
        match.block_ids.extend(new)
        match.hashes = hashes[:nb]
        match.tokens = arr
        if self.remote is not None:
            self.remote.enqueue_blocks(key, namespace, hashes[:nb], tok, start, payloads, self.hasher.root(key))
        if self.store is not None and self.cache_config.admit_after_hits == 0:
            self._persist(match, nb, payloads, start, admit=lambda slot: True)
        return match

    @profiling.traced("cache.ssd_write", lambda self, m, upto, *a, **k: {"blocks": upto})
    def _persist(self, m: PrefixMatch, upto: int, new_payloads: torch.Tensor | None, new_start: int,
                 admit: Callable) -> None:
        """Writes blocks [0, upto) of the match's chain that the store lacks, in order,
        while admit(slot) allows (slot is None for blocks the GPU pool could not hold).
        new_payloads holds blocks new_start.. ; older ones are read from the pool."""
        store, pool = self.store, self.pool
        if not store.writable or store.degraded:
            return
        tok = m.tokens[: upto * self.block_tokens].reshape(upto, self.block_tokens)
        with self._persist_lock:
            with pool.lock:
                slots = [pool.slot(b) for b in m.block_ids[:upto]]
                rids = self._stored_records(slots) + [None] * (upto - len(slots))
            first = next((j for j, r in enumerate(rids) if r is None), upto)
            if first == upto:
                return
            parent = rids[first - 1] if first else 0
            # Blocks the store holds already (this pool just did not know): link, don't rewrite.
            found = self._find_stored(m, tok, first, upto, parent)
            with pool.lock:
                for j, rid in enumerate(found, start=first):
                    if j < len(slots):
                        slots[j].record_id = rid
            if found:
                first += len(found)
                parent = found[-1]
            todo = []
            for j in range(first, upto):
                if not admit(slots[j] if j < len(slots) else None):
                    break
                todo.append(j)
            if not todo:
                return
            from_pool = [j for j in todo if new_payloads is None or j < new_start]
            pool_rows = {}
            if from_pool:
                data = pool.read([m.block_ids[j] for j in from_pool], device="cpu")
                pool_rows = {j: data[i] for i, j in enumerate(from_pool)}
            host_new = None
            if new_payloads is not None:
                # The store reads payloads at commit time: a background commit must not see
                # the caller's tensor change after insert() returned, so it gets a copy.
                host_new = new_payloads.cpu()
                if self._committer is not None and host_new.data_ptr() == new_payloads.data_ptr():
                    host_new = host_new.clone()
            # todo is a run of consecutive blocks (admission stops at the first refusal):
            # one put_chain, whose first parent is the block before the run.
            first, n = todo[0], len(todo)
            if not pool_rows:  # all new: one slice of the caller's payloads
                rows = host_new[first - new_start: first - new_start + n]
            elif len(pool_rows) == n:  # all from the pool, read in block order
                rows = data
            else:
                rows = [pool_rows[j] if j in pool_rows else host_new[j - new_start] for j in todo]
            try:
                rids = store.put_chain(key=m.key, parent=parent, first_index=first,
                                       block_hashes=m.hashes[first: first + n],
                                       parent_hash=m.hashes[first - 1] if first else self.hasher.root(m.key),
                                       tokens=tok[first: first + n], payloads=rows)
            except MissingParentError:
                # The store dropped the parent since _stored_records looked (another
                # thread's TTL expiry or failed read): this chain is not stored now; the
                # next request that reaches it writes it again from its root.
                rids = []
            puts = list(zip(todo, rids))
            # A block knows its record as soon as it is queued: the next request extends
            # the chain from it instead of writing it again. A record the commit drops is
            # then a stale id, forgotten by _stored_records.
            with pool.lock:
                for j, rid in puts:
                    if j < len(slots):
                        slots[j].record_id = rid
            cap = self.cache_config.store_write_behind_bytes
            if self._committer is not None and store.pending_bytes <= cap:
                self._committer.kick()
                return
        store.commit()  # may be another thread's commit that takes these records: same result
        with pool.lock:
            for j, rid in puts:  # dropped (disk full): forget the ids now, not at the next use
                if j < len(slots) and slots[j].record_id == rid and not store.holds(rid):
                    slots[j].record_id = None

    # ---- snapshots, release, access -----------------------------------------------------

    @profiling.traced("cache.put_snapshot",
                      lambda self, tokens, *a, **k: {"tokens": len(tokens)})
    def put_snapshot(self, tokens, snapshot: TensorSnapshot, namespace: str = "",
                     extra: Sequence[tuple[str, str]] = (), hashes: Sequence[bytes] | None = None) -> bool:
        """Stores the SWA snapshot of the state after exactly `tokens` (end of prompt, end
        of output). Returns False when there is no SWA tier or it does not fit."""
        if self.remote is not None:
            _remote.put_snapshot(self, tokens, snapshot, namespace, extra, hashes)
        if self.swa is None:
            return False
        return self.swa.put(self.key(namespace, extra), tokens, snapshot, hashes)

    def _find_checkpoint(self, m: PrefixMatch, arr: np.ndarray, limit: int) -> None:
        snap = self.checkpoints.get(m.key, arr, m.hashes, self.hasher.root(m.key),
                                    max_blocks=m.num_blocks, limit=limit)
        if snap is None:
            return
        m.snapshot, m.checkpoint_snapshot = snap, True
        if self.swa is not None:  # promoted: the session's next turn finds it in host memory
            self.swa.put(m.key, arr[: snap.num_tokens], snap, m.hashes[: snap.num_tokens // self.block_tokens])

    @profiling.traced("cache.put_checkpoint", lambda self, tokens, *a, **k: {"tokens": len(tokens)})
    def put_checkpoint(self, tokens, snapshot: TensorSnapshot, namespace: str = "",
                       extra: Sequence[tuple[str, str]] = ()) -> int:
        """Writes the SWA checkpoint of the state after exactly `tokens` to the SSD (V4's
        SWA persistence; the engine calls it every checkpoint_tokens tokens and at the end
        of prompt and output). Returns the bytes written; 0 when checkpoints are off."""
        if self.checkpoints is None:
            return 0
        key = self.key(namespace, extra)
        arr = as_token_array(tokens)[: snapshot.num_tokens]
        nb = arr.size // self.block_tokens
        hashes = self.hasher.hash_blocks(arr[: nb * self.block_tokens], key)
        return self.checkpoints.put(key, arr, snapshot, hashes, self.hasher.root(key))

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
        they are acknowledged; with 0 insert/match already waited."""
        if self.store is not None and self.store.writable:
            self.store.commit()

    def close(self) -> None:
        """Commits what is still queued for the SSD (acknowledging it), then stops the
        background writers and closes the tiers."""
        if self._committer is not None:
            self._committer.stop()
        if self.remote is not None:
            self.remote.close()
        if self.store is not None:
            self.store.close()  # commits what is still queued

    def __enter__(self) -> "PrefixCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _BackgroundCommitter:
    """One thread that commits what requests queued in the store, so SSD writes leave the
    request path. kick() after queueing; commits are serialized by the store's write lock,
    so flush() (a commit from the caller's thread) waits for one in flight."""

    def __init__(self, store: PersistentStore):
        self.store = store
        self._wake = threading.Event()
        self._stopping = False
        self._last = None  # the ticket of the last commit this thread started
        self._thread = threading.Thread(target=self._run, name="dsv41-cache-commit", daemon=True)
        self._thread.start()
        # At interpreter exit a cache nobody closed stops its thread and commits what is
        # queued (a normal exit loses no queued write); a weak reference keeps it collectable.
        ref = weakref.ref(self)
        atexit.register(lambda: (c := ref()) is not None and c.stop(flush=True))

    def kick(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                return  # the store's close() commits what is left
            try:
                # Sealing (fsync, rename) goes on in the store's sealer thread while this
                # thread waits for the next batch; flush() waits for it. Waiting for the
                # previous ticket only after starting the next keeps that overlap.
                ticket = self.store.commit_async()
                last, self._last = self._last, ticket
                if last is not None:
                    last.result()  # I/O errors degrade the tier inside; this is for bugs
            except Exception:  # noqa: BLE001 - a background thread must not die silently
                log.exception("background commit of the SSD tier failed")

    def stop(self, flush: bool = False) -> None:
        """Stops the thread; flush=True then commits what is still queued."""
        self._stopping = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        store = self.store
        if flush and not store.closed and store.writable and store.pending_bytes:
            try:
                store.commit()
            except Exception:  # noqa: BLE001 - at exit: say so, do not mask the exit status
                log.exception("committing the SSD tier's queued writes at exit failed")
