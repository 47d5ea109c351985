"""PrefixCache: the three tiers behind one interface a server can call.

    cache = PrefixCache(ModelConfig.preset("v41-flash"), CacheConfig(store_dir="/ssd/dsv41"))
    m = cache.match(prompt_ids, namespace="tenant-a")    # verified, pinned, SSD hits promoted
    m.cached_tokens       # block-aligned global KV now in the GPU pool (m.block_ids)
    m.snapshot            # exact SWA state of the longest snapshotted prefix, or None
    ...prefill the rest...
    cache.insert(prompt_ids, payloads, namespace="tenant-a", match=m)  # new full blocks
    cache.put_snapshot(prompt_ids, snapshot, namespace="tenant-a")     # end of prompt/output
    cache.release(m)

Lookup order: the GPU pool first, then the SSD store continues the chain where the pool
stops (its blocks are read, verified and copied into the pool: "promoted"), then the SWA
pool is asked for the longest snapshotted prefix. A snapshot is only returned when the
global KV of all its full blocks is in the match, so resuming from it is exact.

Admission to the SSD tier: with admit_after_hits = 0 (default) a block is written right
after the prefill that computed it; with N > 0 only once it has been matched N times
(sparing SSD wear for prompts that are never reused). The store holds whole prefixes only:
a block is written only when the block before it is stored. Writes are synchronous, at the
end of insert/match, outside the pool lock.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ..config import ModelConfig
from .errors import PayloadError
from .global_pool import GlobalKVPool
from .hashing import BlockHasher, CacheKey, HashFn, as_token_array, model_fingerprint, sha256
from .layout import DEFAULT_BLOCK_TOKENS, PAYLOAD_FORMAT_VERSION, BlockLayout
from .metrics import CacheMetrics
from .persistent import DEFAULT_SEGMENT_BYTES, DEFAULT_TTL_S, PersistentStore, StoreIdentity
from .swa_pool import DEFAULT_TTL_S as SWA_TTL_S
from .swa_pool import SwaSnapshot, SwaSnapshotPool

__all__ = ["CacheConfig", "PrefixMatch", "PrefixCache"]


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
    admit_after_hits: int = 0
    hash_fn: HashFn = sha256
    hash_name: str = "sha256"
    io_threads: int = 4


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
    snapshot: SwaSnapshot | None = None
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
    def __init__(self, config: ModelConfig, cache_config: CacheConfig | None = None, *,
                 weights_digest: str | None = None, fingerprint: str | None = None,
                 clock: Callable[[], float] = time.time, metrics: CacheMetrics | None = None,
                 store_fault: Callable[[str], None] | None = None):
        cc = self.cache_config = cache_config or CacheConfig()
        if cc.admit_after_hits < 0:
            raise ValueError(f"admit_after_hits must be >= 0, got {cc.admit_after_hits}")
        self.config = config
        self.layout = BlockLayout(config, cc.block_tokens)
        self.block_tokens = cc.block_tokens
        self.fingerprint = fingerprint or model_fingerprint(config, weights_digest)
        self.hasher = BlockHasher(cc.block_tokens, cc.hash_fn, cc.hash_name)
        self.metrics = metrics or CacheMetrics()
        self.clock = clock
        self.pool = GlobalKVPool(self.layout, cc.gpu_capacity_bytes, cc.device, self.metrics)
        self.swa = None
        if cc.swa_capacity_bytes != 0:
            self.swa = SwaSnapshotPool(self.hasher, cc.swa_capacity_bytes, cc.swa_ttl_s, clock, self.metrics,
                                       pin_memory=self.pool.device.type == "cuda")
        self.store = None
        if cc.store_dir is not None:
            self.store = PersistentStore(
                cc.store_dir, self.identity, mode="w", capacity_bytes=cc.store_capacity_bytes,
                ttl_s=cc.store_ttl_s, durability=cc.store_durability, segment_bytes=cc.store_segment_bytes,
                on_mismatch=cc.store_on_mismatch, direct=cc.store_direct_io, io_threads=cc.io_threads,
                clock=clock, metrics=self.metrics, hash_fn=cc.hash_fn, fault=store_fault)
        self._persist_lock = threading.Lock()

    @property
    def identity(self) -> StoreIdentity:
        return StoreIdentity(model_fingerprint=self.fingerprint, layout_fingerprint=self.layout.fingerprint(),
                             block_tokens=self.block_tokens, block_bytes=self.layout.block_bytes,
                             payload_format_version=PAYLOAD_FORMAT_VERSION, hash_name=self.hasher.name,
                             digest_bytes=self.hasher.digest_bytes)

    def key(self, namespace: str = "", extra: Sequence[tuple[str, str]] = ()) -> bytes:
        return CacheKey(namespace, self.fingerprint, PAYLOAD_FORMAT_VERSION, tuple(extra)).encode()

    # ---- lookup -------------------------------------------------------------------------

    def match(self, tokens, namespace: str = "", extra: Sequence[tuple[str, str]] = (),
              max_tokens: int | None = None) -> PrefixMatch:
        """The longest verified cached prefix of `tokens` (at most max_tokens tokens; pass
        len(tokens) - 1 when the last token must still run for its logits)."""
        t0 = time.perf_counter()
        arr = as_token_array(tokens)
        limit = arr.size if max_tokens is None else max(0, min(arr.size, int(max_tokens)))
        B = self.block_tokens
        nb = limit // B
        key = self.key(namespace, extra)
        hashes = self.hasher.hash_blocks(arr[: nb * B], key)
        tok = arr[: nb * B].reshape(nb, B)
        pool = self.pool
        with pool.lock:
            bids = pool.match(key, hashes, tok)
            pool.acquire(bids)
            for b in bids:
                pool.slot(b).hits += 1
        m = PrefixMatch(key, namespace, arr, hashes, bids, B, gpu_blocks=len(bids))
        if self.store is not None and len(bids) < nb:
            m.ssd_blocks = self._promote(m, tok)
        if self.swa is not None:
            snap = self.swa.get(key, arr, hashes, max_tokens=limit)
            if snap is not None and snap.num_tokens // B <= m.num_blocks:
                m.snapshot = snap
        self.metrics.record_lookup(arr.size, {"gpu": m.gpu_blocks * B, "ssd": m.ssd_blocks * B,
                                              "swa": m.snapshot_tokens})
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
        arr = as_token_array(tokens)
        limit = arr.size if max_tokens is None else max(0, min(arr.size, int(max_tokens)))
        B = self.block_tokens
        nb = limit // B
        key = self.key(namespace, extra)
        hashes = self.hasher.hash_blocks(arr[: nb * B], key)
        return len(self.pool.match(key, hashes, arr[: nb * B].reshape(nb, B))) * B

    def _promote(self, m: PrefixMatch, tok: np.ndarray) -> int:
        """Continues the match from the SSD tier; returns how many blocks it added."""
        store, pool = self.store, self.pool
        g = m.num_blocks
        parent_rid = 0
        if g:
            with pool.lock:
                slots = [pool.slot(b) for b in m.block_ids]
                rids = [s.record_id for s in slots]
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
        if self.store is not None and self.cache_config.admit_after_hits == 0:
            self._persist(match, nb, payloads, start, admit=lambda slot: True)
        return match

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
            rids = [s.record_id for s in slots] + [None] * (upto - len(slots))
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
            host_new = new_payloads.cpu() if new_payloads is not None else None
            root = self.hasher.root(m.key)
            puts = []
            for j in todo:
                payload = pool_rows[j] if j in pool_rows else host_new[j - new_start]
                parent = store.put(key=m.key, parent=parent, block_index=j, block_hash=m.hashes[j],
                                   parent_hash=m.hashes[j - 1] if j else root, tokens=tok[j], payload=payload)
                puts.append((j, parent))
            res = store.commit()
            done = set(res.persisted)
            with pool.lock:
                for j, rid in puts:
                    if rid in done and j < len(slots):
                        slots[j].record_id = rid

    # ---- snapshots, release, access -----------------------------------------------------

    def put_snapshot(self, tokens, snapshot: SwaSnapshot, namespace: str = "",
                     extra: Sequence[tuple[str, str]] = (), hashes: Sequence[bytes] | None = None) -> bool:
        """Stores the SWA snapshot of the state after exactly `tokens` (end of prompt, end
        of output). Returns False when there is no SWA tier or it does not fit."""
        if self.swa is None:
            return False
        return self.swa.put(self.key(namespace, extra), tokens, snapshot, hashes)

    def release(self, match: PrefixMatch) -> None:
        if match.released:
            return
        self.pool.release(match.block_ids)
        match.released = True

    def read_blocks(self, match_or_ids: PrefixMatch | Sequence[int], device: str | torch.device | None = None) -> torch.Tensor:
        """Payloads of a match's blocks (or of block ids), uint8 [n, block_bytes]."""
        ids = match_or_ids.block_ids if isinstance(match_or_ids, PrefixMatch) else list(match_or_ids)
        return self.pool.read(ids, device)

    def stats(self) -> dict:
        out = {"block_tokens": self.block_tokens, "block_bytes": self.layout.block_bytes,
               "model_fingerprint": self.fingerprint, "gpu": self.pool.stats(),
               "swa": self.swa.stats() if self.swa is not None else None,
               "ssd": self.store.stats() if self.store is not None else None}
        m = self.metrics
        asked = m.lookup_tokens.value()
        out["hit_rate"] = {t: (m.hit_tokens.value(tier=t) / asked if asked else 0.0) for t in ("gpu", "ssd", "swa")}
        out["metrics"] = m.to_dict()
        return out

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> "PrefixCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
