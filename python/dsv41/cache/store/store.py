"""PersistentStore: the SSD tier. Global KV + indexer keys per block, nothing else.

The facade opens the directory (manifest, the writer lock, recovery), builds the parts
around one StoreState and answers the public API by delegating to them:

    PutQueue       put() and put_chain(): records queued for the next commit
    Committer      commit(): segments written (SegmentWriter) and sealed in commit order
    RecordReader   read(), read_into(), load(): verified reads, host and device paths
    Compactor      gc(): TTL, LRU to the byte capacity, compaction
    recovery       opening the files, and a reader's refresh()
    verify         every record read and checked

Design (docs/cache.md has the full story):

* Publication is atomic. A commit writes its records into a new segment file under a
  temporary name, writes the segment's footer (its index) and trailer, fsyncs it (the
  default durability, "fsync"), renames it into place and fsyncs the directory. A reader
  lists only renamed segments, so it never sees a partial record; a crash leaves at most a
  temporary file, which the next writer deletes.
* Every read verifies. A record is read whole (O_DIRECT, 4 KiB-aligned staging) and its
  header CRC, data CRC, identity (record id, parent, block index, hash) and token ids and
  key are checked before its payload is used. A record whose bytes prove damaged is
  counted, removed from the index (with its descendants, which it makes unreachable) and
  treated as a miss; a read that fails (an I/O error) is a miss and removes nothing.
* Recovery is quick: a segment's footer lists its records, so opening a store reads two
  pages and a footer per segment, never the payloads. A segment whose footer is damaged is
  scanned record header by record header instead.
* Deletions (TTL, LRU under the byte capacity, corruption) are journal entries; space comes
  back when GC rewrites a segment's live records into a new segment that supersedes it.
* One writer per directory (flock on LOCK, its pid in the error a second writer gets);
  readers take no lock and see committed segments only (`refresh()` picks up new ones).

Parents are identified by record id, not by hash: a record's parent_id is the record id of
the block before it, so following a chain can never cross into another prefix whose hashes
collide. The first block of a chain has parent_id 0 and is matched on its exact key bytes.
"""
from __future__ import annotations

import atexit
import errno
import logging
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .. import io as _io
from ..errors import StoreError
from ..metrics import CacheMetrics
from . import format as sf
from . import recovery
from .commit import CommitResult, Committer, CommitTicket
from .fds import SegmentFds
from .gc import Compactor
from .journal import Journal
from .manifest import StoreIdentity, WriterLock, read_manifest, write_manifest
from .pending import PutQueue, as_token_ids
from .reads import RecordReader
from .staging import StagingPool
from .state import StoreState
from .verify import verify as _verify_all
from .writer import STAGING_CHUNKS, WRITE_CHUNK, SegmentWriter

__all__ = ["PersistentStore", "StoreIdentity", "CommitResult", "DURABILITY", "DEFAULT_TTL_S",
           "DEFAULT_SEGMENT_BYTES"]

log = logging.getLogger("dsv41.cache.store")

DURABILITY = ("fsync", "none")
DEFAULT_TTL_S = 72 * 3600.0
DEFAULT_SEGMENT_BYTES = 128 << 20


class PersistentStore:
    """The persistent prefix store in directory `path`.

    mode "w": the one writer (creates the store if needed, recovers it, takes the lock).
    mode "r": a reader; no lock, no writes, sees committed segments (`refresh()` for new).
    identity: required to create a store, and checked against the manifest when given;
    None opens any store (tools such as `dsv41 cache verify` do that).
    on_mismatch: "error" raises StoreMismatchError; "empty" opens the store as an empty,
    read-only tier without touching its files.
    """

    def __init__(self, path: str | os.PathLike, identity: StoreIdentity | None = None, *,
                 mode: str = "w", capacity_bytes: int | None = None, ttl_s: float | None = DEFAULT_TTL_S,
                 durability: str = "fsync", segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 on_mismatch: str = "error", direct: bool = True, io_threads: int = 4,
                 engine: _io.IOEngine | None = None, clock: Callable[[], float] = time.time,
                 metrics: CacheMetrics | None = None, hash_fn: Callable[[bytes], bytes] | None = None,
                 fault: Callable[[str], None] | None = None):
        if mode not in ("r", "w"):
            raise ValueError(f"mode must be 'r' or 'w', got {mode!r}")
        if durability not in DURABILITY:
            raise ValueError(f"durability must be one of {DURABILITY}, got {durability!r}")
        if on_mismatch not in ("error", "empty"):
            raise ValueError(f"on_mismatch must be 'error' or 'empty', got {on_mismatch!r}")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.path = Path(path)
        self.hash_fn = hash_fn  # recomputes block hashes in verify(); optional
        self.state = state = StoreState(
            self.path, mode, engine=engine or _io.IOEngine(io_threads), clock=clock,
            metrics=metrics or CacheMetrics(), capacity_bytes=capacity_bytes, ttl_s=ttl_s, durability=durability,
            segment_bytes=max(int(segment_bytes), 2 * sf.PAGE), direct=direct, fault=fault)
        self._writer_lock: WriterLock | None = None
        self._fds = SegmentFds(state, state.engine)
        self._staging = StagingPool(keep=STAGING_CHUNKS + 2)
        self._queue = PutQueue(state)
        self._writer = SegmentWriter(state, self._staging)
        self._committer = Committer(state, self._queue, self._writer)
        self._reader = RecordReader(state, self._fds, self._staging)
        self._compactor = Compactor(state, self._fds, self._staging, self._reader, self._writer, self._committer)
        self.recovery_seconds = 0.0
        self._exit_hook = None

        t0 = time.perf_counter()
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(errno.ENOTDIR, f"persistent store path {self.path} is not a directory")
        if mode == "w":
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(e.errno, f"cannot create the persistent store directory {self.path}: "
                                 f"{e.strerror}") from None
        elif not self.path.is_dir():
            raise StoreError(errno.ENOENT, f"no persistent store at {self.path}")
        try:
            self._open(identity, on_mismatch)
        except BaseException:
            self._release_lock()
            raise
        if self.writable:
            # Ready before the first commit: the sealer thread, and the staging buffers a
            # segment cycles through (allocating and zeroing them is a once-per-store cost).
            self._committer.start()
            self._staging.preallocate(STAGING_CHUNKS, WRITE_CHUNK)
            # A writer nobody closed is closed at exit, while threads still run: its queue is
            # committed and its seals finish before the interpreter finalizes (a seal still
            # running then would return into a finalizing interpreter: SIGABRT). Registered
            # after the caller's own hooks that may still commit (atexit runs them first).
            ref = weakref.ref(self)
            self._exit_hook = lambda: (st := ref()) is not None and st._close_at_exit()
            atexit.register(self._exit_hook)
        self.recovery_seconds = time.perf_counter() - t0
        state.metrics.recovery_seconds.set(self.recovery_seconds)
        state.update_gauges()

    # ---- opening ------------------------------------------------------------------------

    def _open(self, identity: StoreIdentity | None, on_mismatch: str) -> None:
        # The manifest is checked before anything is locked or written: a store of another
        # model opened as an empty tier is left exactly as it is (its rightful writer may
        # hold the lock), with no recovery and no journal.
        state = self.state
        found, state.mismatch = read_manifest(self.path, identity, on_mismatch)
        if found is None:  # no manifest yet
            if state.mode != "w":
                raise StoreError(errno.ENOENT, f"{self.path} is not a dsv41 persistent store "
                                 f"(no {sf.MANIFEST_NAME})")
            if any(sf.parse_segment_name(n) for n in os.listdir(self.path)):
                raise StoreError(errno.EINVAL, f"{self.path} has segment files but no "
                                 f"{sf.MANIFEST_NAME}: refusing to guess which model wrote them")
            if identity is None:
                raise StoreError(errno.EINVAL, f"{self.path} is not a dsv41 persistent store (no "
                                 f"{sf.MANIFEST_NAME}); creating one needs the model's identity")
        state.identity = found
        if state.mismatch is not None:
            return
        if state.mode == "w":
            self._writer_lock = WriterLock(self.path)
            # Under the lock: another writer may have created or changed it meanwhile.
            found, state.mismatch = read_manifest(self.path, identity, on_mismatch)
            if found is None:
                write_manifest(self.path, identity)
                found = identity
            state.identity = found
            if state.mismatch is not None:
                self._release_lock()
                return
            state.journal = Journal(self.path, writable=True)
        recovery.recover(state)

    def _release_lock(self) -> None:
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None

    # ---- what the store is ---------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self.state.mode

    @property
    def identity(self) -> StoreIdentity | None:
        return self.state.identity

    @property
    def mismatch(self) -> str | None:
        """Why the store was opened as an empty tier (on_mismatch="empty"), or None."""
        return self.state.mismatch

    @property
    def closed(self) -> bool:
        return self.state.closed

    @property
    def writable(self) -> bool:
        return self.state.writable

    @property
    def engine(self) -> _io.IOEngine:
        """The I/O engine this store reads and writes through (its counters, test faults)."""
        return self.state.engine

    @property
    def metrics(self) -> CacheMetrics:
        return self.state.metrics

    @property
    def clock(self) -> Callable[[], float]:
        return self.state.clock

    @property
    def counts(self) -> dict:
        """What opening the store found (recovered records, damaged segments, ...)."""
        return self.state.counts

    @property
    def unusable(self) -> list[str]:
        """Names in the directory that cannot be one of its files, with why."""
        return self.state.unusable

    @property
    def capacity_bytes(self) -> int | None:
        return self.state.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int | None) -> None:
        self.state.capacity_bytes = value

    @property
    def ttl_s(self) -> float | None:
        return self.state.ttl_s

    @property
    def durability(self) -> str:
        return self.state.durability

    @property
    def segment_bytes(self) -> int:
        return self.state.segment_bytes

    @property
    def direct(self) -> bool:
        return self.state.direct

    @property
    def layout_block_bytes(self) -> int:
        return self.state.identity.block_bytes

    def __len__(self) -> int:
        return len(self.state.index.recs)

    def __contains__(self, rid: int) -> bool:
        return rid in self.state.index.recs

    # ---- lookups and reads --------------------------------------------------------------

    def walk(self, key: bytes, hashes: list[bytes], parent: int = 0, exclude: set[int] | None = None) -> list[int]:
        """Record ids of the longest chain matching `hashes` below record `parent` (0: from a
        chain's first block, matched on `key`), by the in-memory index only: unverified."""
        return self.state.walk(key, hashes, parent, exclude)

    def read(self, rids: list[int], tokens: np.ndarray | None, key: bytes, out: np.ndarray | None) -> list[str]:
        """Reads and verifies records `rids` (one per row of `tokens`, uint32 [n, T]); copies
        the payload of each verified one into row i of `out` (uint8 [n, block_bytes]).

        Returns one status per record: "ok"; "collision" (intact but another prefix: token
        ids or key differ); "io" (the read failed: an I/O error, a short read, a segment
        that would not open; a miss, nothing is removed); "missing" (its segment file is
        gone: forgotten); or the damage that removed it: "truncated", "header",
        "checksum", "chain" (its parent hash is not its parent's block hash). With tokens
        None the token ids are not compared. Rows of `out` whose status is not "ok" hold
        no meaningful data.
        """
        return self._reader.read(rids, tokens, key, out)

    def read_into(self, rids: list[int], tokens: np.ndarray | None, key: bytes, dst: torch.Tensor) -> list[str]:
        """read() into rows of a tensor on any device (GPUDirect Storage into CUDA memory
        where available, the host path for what it does not verify; see
        RecordReader.read_into)."""
        return self._reader.read_into(rids, tokens, key, dst)

    @property
    def gds_available(self) -> bool:
        """Whether reads into CUDA memory go SSD -> GPU (GPUDirect Storage): the process
        has it (io_info, its probe read included) and this store's device path has not
        stepped aside."""
        return self._reader.device.gds_available

    @property
    def device_path_reason(self) -> str | None:
        """Why the device path of read_into stepped aside (a device read failed where the
        host read of the same records passed), or None while it is in use."""
        return self._reader.device.reason

    def load(self, key: bytes, hashes: list[bytes], tokens: np.ndarray, out: np.ndarray | torch.Tensor | None,
             parent: int = 0) -> list[int]:
        """The longest verified chain for `hashes` below record `parent`, payloads copied
        into the rows of `out` (host array or tensor on any device): see RecordReader.load."""
        return self._reader.load(key, hashes, tokens, out, parent)

    def touch(self, rids: list[int]) -> None:
        """Marks records as used now (LRU and TTL count from the last use)."""
        self.state.touch(rids)

    def record_info(self, rid: int) -> dict | None:
        state = self.state
        with state.lock:
            r = state.index.recs.get(rid)
            if r is None:
                return None
            return {"record_id": r.rid, "parent_id": r.parent, "segment": r.seg.name, "offset": r.offset,
                    "span_bytes": r.span, "block_index": r.block_index, "created_ns": r.created_ns,
                    "atime_ns": r.atime_ns, "key": state.index.keys[r.key_id], "hash": r.hash}

    def record_ids(self) -> list[int]:
        with self.state.lock:
            return sorted(self.state.index.recs)

    # ---- writing ------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self._committer.degraded

    @property
    def degraded_reason(self) -> str | None:
        return self._committer.degraded_reason

    def put(self, *, key: bytes, parent: int, block_index: int, block_hash: bytes, parent_hash: bytes,
            tokens: np.ndarray, payload) -> int:
        """Queues one record for the next commit() and returns its record id. `parent` is
        the record id of the block before (0 for a chain's first block); it must be stored
        or queued. The payload is read at commit time: keep it unchanged until then."""
        return self.put_chain(key=key, parent=parent, first_index=block_index, block_hashes=[block_hash],
                              parent_hash=parent_hash, tokens=as_token_ids(tokens)[None], payloads=[payload])[0]

    def put_chain(self, *, key: bytes, parent: int, first_index: int, block_hashes, parent_hash: bytes,
                  tokens, payloads) -> list[int]:
        """put() of consecutive blocks of one prefix, first_index onward, in one call (a
        64K-token prefix is a thousand blocks: one Python call per block kept the disk
        waiting before a commit, bench/bench_cache.py store writes). Block k's parent is
        the record of block k-1, its parent hash block k-1's hash; the first block's are
        `parent` and `parent_hash`. tokens: (n, block_tokens) token ids; payloads: an (n,
        block_bytes) array or tensor, or a sequence of n payloads. Returns the n record ids,
        in block order. Payloads are read at commit time: keep them unchanged until then."""
        if not self.state.writable:
            self.state.check_writable()  # raises the error that says which
        return self._queue.put_chain(key=key, parent=parent, first_index=first_index, block_hashes=block_hashes,
                                     parent_hash=parent_hash, tokens=tokens, payloads=payloads)

    def holds(self, rid: int) -> bool:
        """Whether record `rid` is stored, or queued for (or being written by) a commit:
        then it can be the parent of a put()."""
        with self.state.lock:
            return rid in self.state.index.recs or self._queue.holds(rid)

    @property
    def pending_bytes(self) -> int:
        """Payload bytes put() and not yet taken by a commit."""
        return self._queue.pending_bytes

    def commit(self) -> CommitResult:
        """Writes the queued records (segments of at most segment_bytes), makes them durable
        (durability "fsync") and visible, and returns when they are, and every commit
        started before them too. Disk full or another I/O error degrades the tier: the
        records are dropped with a warning and commits are skipped for a while; nothing is
        raised."""
        res = self.commit_async().result()
        self._gc_if_over_capacity()
        return res

    def commit_async(self) -> CommitTicket:
        """commit() that returns once the queued records are encoded and their writes
        queued: the store's sealer thread makes them durable and visible in commit order,
        while the caller goes on (the next commit's encoding overlaps this one's last
        writes, fsync and rename). The ticket's result() waits for that; until then the
        records are not acknowledged (a crash may lose them, never part of one)."""
        with self.state.write_lock:
            self._gc_if_over_capacity()
            return self._committer.commit_async()

    def _gc_if_over_capacity(self) -> None:
        if self._compactor.over_capacity():
            self.gc()

    def delete(self, rid: int, cause: str = "explicit") -> int:
        """Removes record `rid` and every record below it (journaled, so for good); returns
        how many were removed. Writer only."""
        self.state.check_writable()
        return self.state.delete(rid, cause)

    # ---- GC, verification, readers -------------------------------------------------------

    def file_bytes(self) -> int:
        return self.state.file_bytes()

    def live_bytes(self) -> int:
        return self.state.live_bytes()

    def gc(self, *, low_water: float = 0.9, compact_dead_fraction: float = 0.5) -> dict:
        """Expires records past the TTL, evicts least recently used records until the live
        bytes fit `low_water` x capacity, then reclaims space (see Compactor). Writer only."""
        return self._compactor.gc(low_water=low_water, compact_dead_fraction=compact_dead_fraction)

    def verify(self, progress: Callable[[int, int], None] | None = None, repair: bool = False) -> dict:
        """Reads and checks every record (see verify.py); with repair (writer only) records
        whose bytes proved damaged are removed, without it they are only reported."""
        return _verify_all(self.state, self._fds, self._staging, self._reader,
                           self._committer if self.state.writable else None, self.hash_fn, progress, repair)

    def refresh(self) -> dict:
        """Reader: index segments published since the last look, forget removed ones, and
        apply new journal entries (see recovery.refresh). Returns what changed."""
        return recovery.refresh(self.state, self._fds)

    # ---- stats and shutdown -------------------------------------------------------------

    def stats(self) -> dict:
        from ..hashing import decode_key
        state = self.state
        with state.lock:
            per_ns: dict[str, dict] = {}
            for r in state.index.recs.values():
                ns = decode_key(state.index.keys[r.key_id]).get("namespace", "?")
                d = per_ns.setdefault(ns, {"records": 0, "bytes": 0})
                d["records"] += 1
                d["bytes"] += r.span
            atimes = [r.atime_ns for r in state.index.recs.values()]
            segs = state.segments.values()
            out = {
                "path": str(self.path),
                "mode": state.mode,
                "identity": dict(state.identity.__dict__),
                "mismatch": state.mismatch,
                "records": len(state.index.recs),
                "segments": len(state.segments),
                "damaged_segments": sum(1 for s in segs if s.damaged),
                "live_bytes": sum(s.live_bytes for s in segs),
                "file_bytes": sum(s.file_bytes for s in segs),
                "capacity_bytes": state.capacity_bytes,
                "ttl_s": state.ttl_s,
                "durability": state.durability,
                "oldest_access_ns": min(atimes) if atimes else None,
                "newest_access_ns": max(atimes) if atimes else None,
                "namespaces": per_ns,
                "o_direct": self._fds.direct_seen,
                "degraded": self.degraded_reason if self.degraded else None,
                "recovery_seconds": self.recovery_seconds,
                "recovery": dict(state.counts),
                "unusable_files": list(state.unusable),
                "io": state.engine.counters(),
                "device_path": "in use" if self.device_path_reason is None else
                f"stepped aside: {self.device_path_reason}",
            }
        return out

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at exit: say so, keep the process's own status
            log.exception("closing the persistent store %s at exit failed", self.path)

    def close(self) -> None:
        """Commits what is queued, waits for the commits in flight (their records are then
        durable), stops the sealer and releases the writer lock. During interpreter
        shutdown (a store dropped by the garbage collector after atexit) no thread runs
        any more: what is queued is dropped unacknowledged, and close() only releases."""
        state = self.state
        if state.closed:
            return
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        finalizing = sys.is_finalizing()
        with state.write_lock:
            if state.writable and not finalizing:
                self.commit()  # what is queued, and waits for commits in flight
            state.journal.close(fsync=state.durability == "fsync")
            self._fds.close_all()
            if not finalizing:
                self._committer.stop()
            self._release_lock()
            state.closed = True

    def __enter__(self) -> "PersistentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self.state.closed and self._writer_lock is not None:
                self.close()
        except Exception:
            pass
