"""SsdTier: the persistent store (cache/store) as a block tier.

load: continues a match where the pool stops. The store's index says how long the chain
runs (a walk, no read); that many rows of a reused staging buffer receive the verified
records (pinned host memory for a CUDA pool, device memory with GPUDirect Storage), and
one pool write scatters them into new pages, which are published with their record ids.

put: persists the blocks of a match's chain that the store lacks, in chain order, a whole
prefix only (a block is written only when the block before it is stored or queued):
  - computed blocks (insert, adopt) when admit_after_hits is 0;
  - served blocks (rows None: after a lookup) once each has been matched admit_after_hits
    times (every one when 0).
A block's record id is kept on its pool page (GlobalKVPool slot.record_id) as soon as the
record is queued, so the next request extends the chain instead of writing it again; a
record the store dropped since (capacity, TTL, repair, a failed read) is forgotten when met
and the block written again. Records are queued in the store; the BackgroundCommitter
commits them (write-behind, store_write_behind_bytes), or the request does when that is 0
or the queue is over its bound.

Adopted pages (PoolRows) are not read on the request path: with write-behind the whole
persist of an adopt is a job for the committer thread, which holds a pool reference on
every page of the chain until it ran, reads the pages it writes, and queues their records.
A request that meets blocks of a queued job does not write them again: a lookup leaves them
to the job, and an insert that must extend them runs the queued jobs first. flush() and
close() run them too.
"""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ... import profiling
from ..errors import MissingParentError
from ..hashing import BlockHasher
from ..match import PrefixMatch
from ..metrics import CacheMetrics
from ..store import PersistentStore
from .base import BlockRows, BlockTier
from .pool import PoolTier
from .staging import StagingRows
from .write_behind import BackgroundCommitter

__all__ = ["SsdTier"]

log = logging.getLogger("dsv41.cache")


def _admit_all(slot) -> bool:
    return True


@dataclass
class _Chain:
    """What a queued persist job needs of a match, copied: the match itself changes (or is
    released) after adopt() returns."""
    key: bytes
    tokens: np.ndarray
    hashes: list[bytes]
    block_ids: list[int]


class SsdTier(BlockTier):
    name = "ssd"

    def __init__(self, store: PersistentStore, gpu: PoolTier, hasher: BlockHasher, metrics: CacheMetrics, *,
                 admit_after_hits: int = 0, write_behind_bytes: int = 0):
        self.store, self.gpu, self.pool = store, gpu, gpu.pool
        self.hasher, self.metrics = hasher, metrics
        self.block_tokens = hasher.block_tokens
        self.admit_after_hits = admit_after_hits
        self.write_behind_bytes = write_behind_bytes
        cuda = self.pool.device.type == "cuda"
        bb = self.pool.block_bytes
        self.staging = StagingRows(bb, "cpu", pin=cuda)
        self.device_staging = StagingRows(bb, self.pool.device) if cuda else None
        self._persist_lock = threading.RLock()   # one persist at a time: chains stay whole
        self._jobs: collections.deque = collections.deque()
        self._jobs_lock = threading.Lock()
        self._pending: collections.Counter = collections.Counter()   # page -> queued jobs writing it
        self._queued_bytes = 0
        self.committer = BackgroundCommitter(store, self.run_jobs) if write_behind_bytes > 0 else None

    # ---- lookup and load ----------------------------------------------------------------

    def lookup(self, m: PrefixMatch, start: int) -> int:
        return max(0, len(self.store.walk(m.key, m.hashes, 0)) - start)

    @profiling.traced("cache.ssd_promote", lambda self, m: {"blocks": len(m.hashes) - m.num_blocks})
    def load(self, m: PrefixMatch) -> int:
        store, pool = self.store, self.pool
        parent = self._record_of_last(m)
        if parent is None:
            return 0
        tok = m.token_rows()
        loaded = 0
        while m.num_blocks < len(m.hashes):
            g = m.num_blocks
            n = len(store.walk(m.key, m.hashes[g:], parent))
            if not n:
                break
            direct = pool.device.type == "cuda" and store.gds_available
            # GPUDirect Storage: SSD -> device staging, checked there (see read_into).
            staging = self.device_staging if direct else self.staging
            with staging.rows(n) as buf:
                rids = store.load(m.key, m.hashes[g: g + n], tok[g: g + n], buf if direct else buf.numpy(),
                                  parent=parent)
                if not rids:
                    break
                k = self.gpu.fill(m, buf[: len(rids)], record_ids=rids)
            loaded += k
            self.metrics.promotions.inc(k)
            if k < n:   # the chain ends here, a record failed, or the pool is full
                break
            parent = rids[-1]
        return loaded

    def _record_of_last(self, m: PrefixMatch) -> int | None:
        """The record id of m's last block (0 for an empty match), or None when the store
        does not hold m's whole chain, so it cannot continue it."""
        g = m.num_blocks
        if not g:
            return 0
        pool = self.pool
        with pool.lock:
            slots = [pool.slot(b) for b in m.block_ids]
            rids = self._stored_records(slots)
        first = next((j for j, r in enumerate(rids) if r is None), g)
        if first < g:
            # GPU blocks that do not know their record (written by another process, or
            # before a restart): find and verify them, or the chain cannot continue.
            found = self._find_stored(m, m.token_rows(), first, g, rids[first - 1] if first else 0)
            with pool.lock:
                for j, rid in enumerate(found):
                    slots[first + j].record_id = rid
            if first + len(found) < g:
                return None
        return slots[-1].record_id

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

    def _find_stored(self, c, tok: np.ndarray, first: int, upto: int, parent: int) -> list[int]:
        """Record ids of the blocks first, first+1, ... (below record `parent`) that the store
        already holds, read and verified; stops at the first one it lacks."""
        chain = self.store.walk(c.key, c.hashes[first:upto], parent)
        if not chain:
            return []
        status = self.store.read(chain, tok[first: first + len(chain)], c.key, None)
        k = next((j for j, st in enumerate(status) if st != "ok"), len(status))
        return chain[:k]

    # ---- put ----------------------------------------------------------------------------

    def put(self, m: PrefixMatch, start: int, rows: BlockRows | None) -> None:
        if rows is None:
            n = self.admit_after_hits
            self._persist(m, m.num_blocks, None, 0, admit=lambda slot: slot is not None and slot.hits >= n)
            return
        if self.admit_after_hits:
            return   # computed blocks wait for their hits
        if rows.deferred and self.committer is not None and self._queue(m, start, rows):
            return
        self._persist(m, len(m.hashes), rows, start, admit=_admit_all)

    def _queue(self, m: PrefixMatch, start: int, rows: BlockRows) -> bool:
        """Queues the persist of m's chain (blocks start.. in `rows`) for the committer
        thread; False (nothing queued) when the store takes no writes now or the queue is
        over its bound: then the request persists itself (backpressure)."""
        store = self.store
        if not store.writable or store.degraded:
            return True   # nothing would be written
        nb = len(m.hashes)
        nbytes = (nb - start) * self.pool.block_bytes
        with self._jobs_lock:
            if store.pending_bytes + self._queued_bytes + nbytes > self.write_behind_bytes:
                return False
            c = _Chain(m.key, m.tokens[: nb * self.block_tokens].copy(), list(m.hashes[:nb]), list(m.block_ids[:nb]))
            self.pool.acquire(c.block_ids)   # the job's own hold: each id stays this page until it ran
            rows.hold()
            self._jobs.append((c, start, rows, nbytes))
            self._queued_bytes += nbytes
            self._pending.update(c.block_ids[start:])
        self.committer.kick()
        return True

    def run_jobs(self) -> None:
        """Runs the queued persist jobs, oldest first (the committer thread does before each
        commit; flush, close and a request that must extend their blocks do too)."""
        with self._persist_lock:
            while True:
                with self._jobs_lock:
                    if not self._jobs:
                        return
                    c, start, rows, nbytes = self._jobs.popleft()
                try:
                    self._persist(c, len(c.hashes), rows, start, admit=_admit_all, queued=True)
                except Exception:  # noqa: BLE001 - one bad job must not stop the others
                    log.exception("persisting adopted blocks to the SSD tier failed")
                finally:
                    with self._jobs_lock:
                        self._queued_bytes -= nbytes
                        self._pending.subtract(c.block_ids[start:])
                        self._pending += collections.Counter()   # drops the zero counts
                    rows.release()
                    self.pool.release(c.block_ids)

    @profiling.traced("cache.ssd_write", lambda self, m, upto, *a, **k: {"blocks": upto})
    def _persist(self, c, upto: int, new_rows: BlockRows | None, new_start: int, admit: Callable,
                 queued: bool = False) -> None:
        """Writes blocks [0, upto) of chain c (a PrefixMatch, or a queued job's _Chain) that
        the store lacks, in order, while admit(slot) allows (slot is None for blocks the GPU
        pool could not hold). new_rows holds blocks new_start.. ; older ones are read from
        the pool. queued: a job on the committer thread, which commits after its jobs."""
        store, pool = self.store, self.pool
        if not store.writable or store.degraded:
            return
        B = self.block_tokens
        tok = c.tokens[: upto * B].reshape(upto, B)
        with self._persist_lock:
            while True:
                with pool.lock:
                    slots = [pool.slot(b) for b in c.block_ids[:upto]]
                    rids = self._stored_records(slots) + [None] * (upto - len(slots))
                first = next((j for j, r in enumerate(rids) if r is None), upto)
                if first == upto:
                    return
                if queued or not self._pending_in(c.block_ids[first:upto]):
                    break
                # Blocks a queued job will write: a lookup leaves them to it (no record is
                # written twice); new blocks must link to their records, so run the jobs.
                if new_rows is None:
                    return
                self.run_jobs()
            parent = rids[first - 1] if first else 0
            # Blocks the store holds already (this pool just did not know): link, don't rewrite.
            found = self._find_stored(c, tok, first, upto, parent)
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
            from_pool = [j for j in todo if new_rows is None or j < new_start]
            pool_rows = {}
            if from_pool:
                data = pool.read([c.block_ids[j] for j in from_pool], device="cpu")
                pool_rows = {j: data[i] for i, j in enumerate(from_pool)}
            host_new = None
            if new_rows is not None and len(pool_rows) < len(todo):
                # The store reads payloads at commit time: a background commit must not see
                # the caller's tensor change after insert() returned, so it gets a copy.
                host_new = new_rows.host(stable=self.committer is not None)
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
                rids = store.put_chain(key=c.key, parent=parent, first_index=first,
                                       block_hashes=c.hashes[first: first + n],
                                       parent_hash=c.hashes[first - 1] if first else self.hasher.root(c.key),
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
            if queued:
                return
            if self.committer is not None and store.pending_bytes <= self.write_behind_bytes:
                self.committer.kick()
                return
        store.commit()  # may be another thread's commit that takes these records: same result
        with pool.lock:
            for j, rid in puts:  # dropped (disk full): forget the ids now, not at the next use
                if j < len(slots) and slots[j].record_id == rid and not store.holds(rid):
                    slots[j].record_id = None

    def _pending_in(self, pages) -> bool:
        with self._jobs_lock:
            return bool(self._pending) and any(p in self._pending for p in pages)

    # ---- evict, flush, close ------------------------------------------------------------

    def evict(self) -> int:
        """Runs the store's GC: records past the TTL, and least recently used ones beyond
        its byte cap; returns how many records it removed."""
        if not self.store.writable:
            return 0
        report = self.store.gc()
        return report["expired"] + report["evicted"]

    def flush(self) -> None:
        """Runs the queued jobs and commits: every block queued so far is acknowledged
        (durable with "fsync") or dropped when this returns."""
        self.run_jobs()
        if self.store.writable:
            self.store.commit()

    def close(self) -> None:
        """Stops the committer, runs what it left, then closes the store (which commits)."""
        if self.committer is not None:
            self.committer.stop()
        self.run_jobs()
        self.store.close()

    def stats(self) -> dict:
        return self.store.stats()
