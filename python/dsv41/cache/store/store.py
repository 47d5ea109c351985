"""PersistentStore: the SSD tier. Global KV + indexer keys per block, nothing else.

This facade owns the locks and the state; the parts are in this package: format (the
bytes), files (opening only regular files, never following links), manifest (identity and
the writer lock), index, journal, segments (loading a segment's index), writer (writing
one), reads (verified reads), gc and verify. Design (docs/cache.md has the full story):

* Publication is atomic. A commit writes its records into a new segment file under a
  temporary name, writes the segment's footer (its index) and trailer, fsyncs it (the
  default durability, "fsync"), renames it into place and fsyncs the directory. A reader
  lists only renamed segments, so it never sees a partial record; a crash leaves at most a
  temporary file, which the next writer deletes.
* Every read verifies. A record is read whole (O_DIRECT, 4 KiB-aligned staging) and its
  header CRC, data CRC, identity (record id, parent, block index, hash) and token ids and
  key are checked before its payload is used. A record that fails is counted, removed from
  the index (with its descendants, which it makes unreachable) and treated as a miss.
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
import collections
import contextlib
import errno
import functools
import itertools
import logging
import os
import stat
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from .. import io as _io
from ..errors import MissingParentError, PayloadError, StoreError, StoreReadOnlyError
from ..metrics import CacheMetrics
from . import format as sf
from . import gc as _gc
from . import reads as _reads
from . import recovery as _recovery
from . import verify as _verify
from . import writer as _writer
from .index import RecordIndex, SegmentFile, StoredRecord
from .journal import Journal
from .manifest import StoreIdentity, WriterLock, read_manifest, write_manifest
from .segments import SegmentLoader

__all__ = ["PersistentStore", "StoreIdentity", "CommitResult", "DURABILITY", "DEFAULT_TTL_S",
           "DEFAULT_SEGMENT_BYTES"]

log = logging.getLogger("dsv41.cache.store")

DURABILITY = ("fsync", "none")
DEFAULT_TTL_S = 72 * 3600.0
DEFAULT_SEGMENT_BYTES = 128 << 20
JOURNAL_FLUSH_BYTES = 128 << 10  # access entries buffered before touch() writes them out (4,096 entries)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass
class CommitResult:
    persisted: list[int] = field(default_factory=list)  # record ids now durable and visible
    dropped: list[int] = field(default_factory=list)    # record ids that were not persisted
    bytes_written: int = 0
    error: str | None = None


class PendingRecord(NamedTuple):
    """A record put() and not yet committed. A tuple: put_chain makes thousands at a time,
    and tuple.__new__ over zipped columns costs a fraction of a Python __init__ each."""
    rid: int
    parent: int
    block_index: int
    block_hash: bytes
    parent_hash: bytes
    tokens: np.ndarray
    key: bytes
    payload: np.ndarray


_new_pending = functools.partial(tuple.__new__, PendingRecord)


def _as_bytes_view(payload) -> np.ndarray:
    if type(payload) is np.ndarray and payload.dtype == np.uint8 and payload.flags.c_contiguous:
        return payload.reshape(-1)  # the common case, without the general conversions
    if isinstance(payload, torch.Tensor):
        if payload.device.type != "cpu":
            payload = payload.cpu()
        return payload.contiguous().view(torch.uint8).reshape(-1).numpy()
    return np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)


def _payload_rows(payloads, n: int, block_bytes: int) -> list[np.ndarray]:
    """n byte rows of block_bytes each: from one (n, ...) array or tensor, or a sequence of
    n payloads (each an array or tensor). Raises PayloadError for any other size."""
    if isinstance(payloads, (np.ndarray, torch.Tensor)):
        flat = _as_bytes_view(payloads)
        if flat.size != n * block_bytes:
            raise PayloadError(f"payloads have {flat.size} bytes: {n} blocks of this store need "
                               f"{n * block_bytes}")
        return list(flat.reshape(n, block_bytes))
    rows = [_as_bytes_view(p) for p in payloads]
    if len(rows) != n:
        raise PayloadError(f"{len(rows)} payloads for {n} blocks")
    for row in rows:
        if row.size != block_bytes:
            raise PayloadError(f"payload has {row.size} bytes, a block of this store has {block_bytes}")
    return rows


_U4 = np.dtype("<u4")


def _as_token_ids(tokens) -> np.ndarray:
    if type(tokens) is np.ndarray and tokens.dtype == _U4 and tokens.flags.c_contiguous:
        return tokens.reshape(-1)
    return np.ascontiguousarray(tokens, dtype="<u4").reshape(-1)


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
        self.mode = mode
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.durability = durability
        self.segment_bytes = max(int(segment_bytes), 2 * sf.PAGE)
        self.direct = direct
        self.clock = clock
        self.metrics = metrics or CacheMetrics()
        self.hash_fn = hash_fn  # recomputes block hashes in verify(); optional
        self._fault = fault
        self._eng = engine or _io.IOEngine(io_threads)
        self._lock = threading.RLock()        # index
        self._write_lock = threading.RLock()  # commits, GC
        self._writer_lock: WriterLock | None = None
        self._journal = Journal(self.path, writable=False)
        self._segs: dict[bytes, SegmentFile] = {}
        self._ix = RecordIndex()
        self._pending: list[PendingRecord] = []
        self._pending_rids: set[int] = set()  # queued, or in a commit that has not returned yet
        self._pending_bytes = 0
        self._next_rid = 1
        self._next_seq = 1
        self._active_reads = 0
        self._fd_graveyard: list[int] = []
        self._staging: list[tuple[_io.AlignedBuffer, np.ndarray]] = []
        self._degraded_until = 0.0
        self.degraded_reason: str | None = None
        self.mismatch: str | None = None
        self.counts = {"recovered_records": 0, "recovered_segments": 0, "torn_temp_files": 0,
                       "damaged_segments": 0, "foreign_segments": 0, "duplicate_records": 0,
                       "orphans_dropped": 0, "superseded_segments": 0, "journal_torn_bytes": 0,
                       "unusable_files": 0, "colliding_records": 0}
        self.unusable: list[str] = []  # names skipped by _unusable, with why
        self.recovery_seconds = 0.0
        self.closed = False
        self._direct_seen: bool | None = None  # whether the filesystem took O_DIRECT
        self._gds_ok: bool | None = None
        # Why the device path of read_into stepped aside (a device read failed where the
        # host read of the same records passed), or None while it is in use.
        self.device_path_reason: str | None = None
        self._gds_files: dict[bytes, object] = {}
        # Chunk writes go to the engine's writer threads (submit_write); these are the ones
        # in flight, oldest first: (ticket, staging item, bytes, segment), reaped in order.
        self._in_flight: collections.deque = collections.deque()
        self._reap_lock = threading.Lock()
        self._sealer = _writer.SerialWorker("dsv41-store-seal")  # fsync, rename, publish, in order
        self._unsealed_rids: set[int] = set()  # records of segments written, not yet sealed

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
        self._exit_hook = None
        if self.writable:
            # Ready before the first commit: the threads, and the staging buffers a segment
            # cycles through (allocating and zeroing them is a once-per-store cost).
            self._sealer.start()
            # A writer nobody closed is closed at exit, while threads still run: its queue is
            # committed and its seals finish before the interpreter finalizes (a seal still
            # running then would return into a finalizing interpreter: SIGABRT). Registered
            # after the caller's own hooks that may still commit (atexit runs them first).
            ref = weakref.ref(self)
            self._exit_hook = lambda: (st := ref()) is not None and st._close_at_exit()
            atexit.register(self._exit_hook)
            # One allocation, sliced: from 2 MiB on it is backed by huge pages
            # (io.AlignedBuffer), so each chunk write is one disk request.
            W = _writer.WRITE_CHUNK
            self._staging_pool, pool = _io.staging(W * _writer.STAGING_CHUNKS)
            self._staging = [(pool[i * W: (i + 1) * W],) * 2 for i in range(_writer.STAGING_CHUNKS)]
        self.recovery_seconds = time.perf_counter() - t0
        self.metrics.recovery_seconds.set(self.recovery_seconds)
        self._update_gauges()

    # ---- opening ------------------------------------------------------------------------

    def _open(self, identity: StoreIdentity | None, on_mismatch: str) -> None:
        # The manifest is checked before anything is locked or written: a store of another
        # model opened as an empty tier is left exactly as it is (its rightful writer may
        # hold the lock), with no recovery and no journal.
        found, self.mismatch = read_manifest(self.path, identity, on_mismatch)
        if found is None:  # no manifest yet
            if self.mode != "w":
                raise StoreError(errno.ENOENT, f"{self.path} is not a dsv41 persistent store "
                                 f"(no {sf.MANIFEST_NAME})")
            if any(sf.parse_segment_name(n) for n in os.listdir(self.path)):
                raise StoreError(errno.EINVAL, f"{self.path} has segment files but no "
                                 f"{sf.MANIFEST_NAME}: refusing to guess which model wrote them")
            if identity is None:
                raise StoreError(errno.EINVAL, f"{self.path} is not a dsv41 persistent store (no "
                                 f"{sf.MANIFEST_NAME}); creating one needs the model's identity")
        self.identity = found
        if self.mismatch is not None:
            return
        if self.mode == "w":
            self._writer_lock = WriterLock(self.path)
            # Under the lock: another writer may have created or changed it meanwhile.
            found, self.mismatch = read_manifest(self.path, identity, on_mismatch)
            if found is None:
                write_manifest(self.path, identity)
                found = identity
            self.identity = found
            if self.mismatch is not None:
                self._release_lock()
                return
            self._journal = Journal(self.path, writable=True)
        _recovery.recover(self)

    def _release_lock(self) -> None:
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None

    def _unusable(self, name: str, e: OSError) -> None:
        """A name in the store that cannot be one of its files (a link, FIFO, directory):
        skipped, counted, and reported by stats and verify."""
        self.counts["unusable_files"] += 1
        self.unusable.append(f"{name}: {e.strerror or e}")
        log.warning("%s", e.strerror or e)

    def _loader(self) -> SegmentLoader:
        return SegmentLoader(self.path, self.identity, self._ix, self.counts, self._unusable)

    # ---- index --------------------------------------------------------------------------

    def _delete(self, rid: int, cause: str) -> int:
        """Removes a record and every record below it; returns how many were removed."""
        with self._lock:
            r = self._ix.recs.get(rid)
            if r is None:
                return 0
            now = self._now_ns()
            removed = self._ix.remove_subtree(r)
            for cur in removed:
                self.metrics.evictions.inc(tier="ssd", cause=cause if cur is r else "orphan")
                if self.mismatch is None:
                    self._journal.append(sf.J_DELETE, cur.rid, now)
            return len(removed)

    def _expired(self, r: StoredRecord, now_ns: int) -> bool:
        return self.ttl_s is not None and now_ns - r.atime_ns > self.ttl_s * 1e9

    # ---- lookups and reads --------------------------------------------------------------

    @property
    def engine(self) -> _io.IOEngine:
        """The I/O engine this store reads and writes through (its counters, test faults)."""
        return self._eng

    @property
    def writable(self) -> bool:
        return self.mode == "w" and self.mismatch is None and not self.closed

    @property
    def layout_block_bytes(self) -> int:
        return self.identity.block_bytes

    def __len__(self) -> int:
        return len(self._ix.recs)

    def __contains__(self, rid: int) -> bool:
        return rid in self._ix.recs

    def _now_ns(self) -> int:
        return int(self.clock() * 1e9)

    def walk(self, key: bytes, hashes: list[bytes], parent: int = 0, exclude: set[int] | None = None) -> list[int]:
        """Record ids of the longest chain matching `hashes` below record `parent` (0: from a
        chain's first block, matched on `key`), by the in-memory index only: unverified."""
        oldest = None if self.ttl_s is None else self._now_ns() - self.ttl_s * 1e9
        with self._lock:
            out, expired = self._ix.walk(key, hashes, parent, exclude, oldest)
        if expired and self.writable:
            for rid in expired:
                self._delete(rid, "ttl")
        return [r.rid for r in out]

    def _get_staging(self, size: int) -> tuple[_io.AlignedBuffer, np.ndarray]:
        with self._lock:
            for i, (buf, view) in enumerate(self._staging):
                if buf.size >= size:
                    return self._staging.pop(i)
        return _io.staging(max(size, _io.HUGE_BYTES))  # huge-page backed: one disk request per 1 MiB read

    def _put_staging(self, item) -> None:
        with self._lock:
            if len(self._staging) < _writer.STAGING_CHUNKS + 2:
                self._staging.append(item)

    def _seg_fd(self, seg: SegmentFile) -> int:
        if seg.fd is None:
            path = self.path / seg.name
            f = self._eng.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, direct=self.direct)
            if not stat.S_ISREG(os.fstat(f.fd).st_mode):  # replaced since it was indexed
                os.close(f.fd)
                raise FileNotFoundError(errno.ENOENT, f"{path} is no longer a regular file")
            os.set_blocking(f.fd, True)
            seg.fd, seg.direct = f.fd, f.direct
            self._direct_seen = f.direct
        return seg.fd

    @contextlib.contextmanager
    def _reading(self):
        """Marks a read in flight, so segment fds that GC retires stay open until it ends."""
        with self._lock:
            self._active_reads += 1
        try:
            yield
        finally:
            self._end_read()

    def _end_read(self) -> None:
        with self._lock:
            self._active_reads -= 1
            if self._active_reads == 0:
                for fd in self._fd_graveyard:
                    os.close(fd)
                self._fd_graveyard.clear()

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
        return _reads.read(self, rids, tokens, key, out)

    def read_into(self, rids: list[int], tokens: np.ndarray | None, key: bytes, dst: torch.Tensor) -> list[str]:
        """read() into rows of a tensor on any device (GPUDirect Storage into CUDA memory
        where available; see reads.read_into)."""
        return _reads.read_into(self, rids, tokens, key, dst)

    # ---- reads into device memory (GPUDirect Storage) ------------------------------------

    @property
    def gds_available(self) -> bool:
        """Whether reads into CUDA memory go SSD -> GPU (GPUDirect Storage): the process
        has it (io_info, its probe read included) and this store's device path has not
        stepped aside."""
        if self._gds_ok is None:
            self._gds_ok = bool(_io.io_info()["gds_available"])
        return self._gds_ok and self.device_path_reason is None

    def _device_step_aside(self, reason: str) -> None:
        """The device path failed where the host path served the same records: from now
        on this store's reads into device memory go through host staging."""
        self.device_path_reason = reason
        log.warning("persistent store %s: the device read path steps aside, reads go through the host: %s",
                    self.path, reason)

    def load(self, key: bytes, hashes: list[bytes], tokens: np.ndarray, out: np.ndarray | torch.Tensor | None,
             parent: int = 0) -> list[int]:
        """The longest verified chain for `hashes` below record `parent`, payloads copied
        into the rows of `out` (host array or tensor on any device): see reads.load."""
        return _reads.load(self, key, hashes, tokens, out, parent)

    def touch(self, rids: list[int]) -> None:
        """Marks records as used now (LRU and TTL count from the last use)."""
        now = self._now_ns()
        with self._lock:
            recs, used = self._ix.recs, []
            for rid in rids:
                r = recs.get(rid)
                if r is not None:
                    r.atime_ns = now
                    used.append(rid)
            if self.writable:
                self._journal.append_many(sf.J_ACCESS, used, now)
                if self._journal.pending_bytes >= JOURNAL_FLUSH_BYTES:
                    self._journal.flush()

    def record_info(self, rid: int) -> dict | None:
        with self._lock:
            r = self._ix.recs.get(rid)
            if r is None:
                return None
            return {"record_id": r.rid, "parent_id": r.parent, "segment": r.seg.name, "offset": r.offset,
                    "span_bytes": r.span, "block_index": r.block_index, "created_ns": r.created_ns,
                    "atime_ns": r.atime_ns, "key": self._ix.keys[r.key_id], "hash": r.hash}

    def record_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._ix.recs)

    # ---- writing ------------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self.closed:
            raise StoreReadOnlyError(errno.EBADF, f"persistent store {self.path} is closed")
        if self.mode != "w":
            raise StoreReadOnlyError(errno.EROFS, f"persistent store {self.path} is open read-only")
        if self.mismatch is not None:
            raise StoreReadOnlyError(errno.EROFS, f"persistent store {self.path} was opened as an empty "
                                     f"tier after a mismatch ({self.mismatch}): not writable")

    @property
    def degraded(self) -> bool:
        return self.clock() < self._degraded_until

    def put(self, *, key: bytes, parent: int, block_index: int, block_hash: bytes, parent_hash: bytes,
            tokens: np.ndarray, payload) -> int:
        """Queues one record for the next commit() and returns its record id. `parent` is
        the record id of the block before (0 for a chain's first block); it must be stored
        or queued. The payload is read at commit time: keep it unchanged until then."""
        return self.put_chain(key=key, parent=parent, first_index=block_index, block_hashes=[block_hash],
                              parent_hash=parent_hash, tokens=_as_token_ids(tokens)[None], payloads=[payload])[0]

    def put_chain(self, *, key: bytes, parent: int, first_index: int, block_hashes, parent_hash: bytes,
                  tokens, payloads) -> list[int]:
        """put() of consecutive blocks of one prefix, first_index onward, in one call (a
        64K-token prefix is a thousand blocks: one Python call per block kept the disk
        waiting before a commit, bench/bench_cache.py store writes). Block k's parent is
        the record of block k-1, its parent hash block k-1's hash; the first block's are
        `parent` and `parent_hash`. tokens: (n, block_tokens) token ids; payloads: an (n,
        block_bytes) array or tensor, or a sequence of n payloads. Returns the n record ids,
        in block order. Payloads are read at commit time: keep them unchanged until then."""
        if self.mode != "w" or self.mismatch is not None or self.closed:
            self._check_writable()  # raises the error that says which
        n = len(block_hashes)
        T, P = self.identity.block_tokens, self.identity.block_bytes
        tokens = _as_token_ids(tokens)
        if tokens.size != n * T:
            raise PayloadError(f"a record holds {T} token ids: {n} records need {n * T}, got {tokens.size}")
        tokens = tokens.reshape(n, T)
        rows = _payload_rows(payloads, n, P)
        if n and max(map(len, block_hashes)) > 32 or len(parent_hash) > 32:
            raise ValueError("hashes are at most 32 bytes")
        if type(key) is not bytes:
            key = bytes(key)
        with self._lock:
            if parent and parent not in self._ix.recs and parent not in self._pending_rids:
                raise MissingParentError(f"parent record {parent} is neither stored nor queued")
            first = self._next_rid
            self._next_rid = first + n
            rids = range(first, first + n)
            self._pending += map(_new_pending, zip(
                rids, itertools.chain((parent,), rids[:-1]), range(first_index, first_index + n), block_hashes,
                itertools.chain((parent_hash,), block_hashes[:-1]), tokens, itertools.repeat(key, n), rows))
            self._pending_rids.update(rids)
            self._pending_bytes += n * P
        return list(rids)

    def holds(self, rid: int) -> bool:
        """Whether record `rid` is stored, or queued for (or being written by) a commit:
        then it can be the parent of a put()."""
        with self._lock:
            return rid in self._ix.recs or rid in self._pending_rids

    @property
    def pending_bytes(self) -> int:
        """Payload bytes put() and not yet taken by a commit."""
        return self._pending_bytes

    def commit(self) -> CommitResult:
        """Writes the queued records (segments of at most segment_bytes), makes them durable
        (durability "fsync") and visible, and returns when they are, and every commit
        started before them too. Disk full or another I/O error degrades the tier: the
        records are dropped with a warning and commits are skipped for a while; nothing is
        raised."""
        res = self.commit_async().result()
        self._gc_if_over_capacity()
        return res

    def commit_async(self) -> _writer.CommitTicket:
        """commit() that returns once the queued records are encoded and their writes
        queued: the store's sealer thread makes them durable and visible in commit order,
        while the caller goes on (the next commit's encoding overlaps this one's last
        writes, fsync and rename). The ticket's result() waits for that; until then the
        records are not acknowledged (a crash may lose them, never part of one)."""
        with self._write_lock:
            self._gc_if_over_capacity()
            with self._lock:
                pending, self._pending = self._pending, []
                self._pending_bytes = 0
            try:
                return _writer.commit_pending(self, pending)
            except BaseException:
                with self._lock:
                    self._pending_rids.difference_update(p.rid for p in pending)
                raise

    def _drain_seals(self) -> None:
        """Waits until every commit started so far is sealed (GC, repair and close change
        what a sealing segment checks against)."""
        if self.writable:
            self._sealer.submit(lambda: None).result()

    def _gc_if_over_capacity(self) -> None:
        if self.capacity_bytes is not None and self.writable and self.file_bytes() > self.capacity_bytes:
            self.gc()

    def _degrade(self, e: OSError, retry_after_s: float = 30.0) -> None:
        cause = "no_space" if e.errno in _NO_SPACE else "io_error"
        self.metrics.persist_failures.inc(cause=cause)
        self.degraded_reason = f"{cause}: {e}"
        self._degraded_until = self.clock() + retry_after_s
        warnings.warn(f"persistent store {self.path}: batch not persisted ({e}); the memory tiers keep "
                      f"their blocks, SSD writes resume in {retry_after_s:.0f} s", RuntimeWarning, stacklevel=4)

    def _hook(self, stage: str) -> None:
        if self._fault is not None:
            self._fault(stage)

    # ---- GC -----------------------------------------------------------------------------

    def file_bytes(self) -> int:
        with self._lock:
            return sum(s.file_bytes for s in self._segs.values())

    def live_bytes(self) -> int:
        return self._ix.live_total

    def _retire(self, segs: list[SegmentFile], unlink: bool = True) -> None:
        for s in segs:
            with self._lock:
                self._segs.pop(s.uuid, None)
                self._gds_files.pop(s.uuid, None)  # reads in flight hold their own reference
                if s.fd is not None:
                    if self._active_reads:
                        self._fd_graveyard.append(s.fd)
                    else:
                        os.close(s.fd)
                    s.fd = None
            if unlink and self.mode == "w":
                try:
                    os.unlink(self.path / s.name)
                except FileNotFoundError:
                    pass

    def _rewrite_journal_if_large(self) -> None:
        if self._journal.fd is None or self._journal.pos < 64 * 32 + 4 * 32 * len(self._ix.recs):
            return
        now = self._now_ns()
        with self._lock:
            parts = [sf.encode_journal(sf.J_WATERMARK, self._next_rid, now, self._next_seq)]
            parts += [sf.encode_journal(sf.J_ACCESS, r.rid, r.atime_ns) for r in self._ix.recs.values()
                      if r.atime_ns != r.created_ns]
            self._journal.rewrite(parts)

    # ---- GC and full verification (gc.py, verify.py) -------------------------------------

    def gc(self, *, low_water: float = 0.9, compact_dead_fraction: float = 0.5) -> dict:
        """Expires records past the TTL, evicts least recently used records until the live
        bytes fit `low_water` x capacity, then reclaims space (see gc.py). Writer only."""
        return _gc.gc(self, low_water=low_water, compact_dead_fraction=compact_dead_fraction)

    def verify(self, progress: Callable[[int, int], None] | None = None, repair: bool = False) -> dict:
        """Reads and checks every record (see verify.py); with repair (writer only) failed
        records are removed, without it they are only reported."""
        return _verify.verify(self, progress, repair)

    # ---- readers ------------------------------------------------------------------------

    def refresh(self) -> dict:
        """Reader: index segments published since the last look, forget removed ones, and
        apply new journal entries (see recovery.refresh). Returns what changed."""
        return _recovery.refresh(self)

    # ---- stats and shutdown -------------------------------------------------------------

    def _update_gauges(self) -> None:
        self.metrics.entries.set(len(self._ix.recs), tier="ssd")
        self.metrics.bytes.set(self.file_bytes(), tier="ssd")

    def stats(self) -> dict:
        from ..hashing import decode_key
        with self._lock:
            per_ns: dict[str, dict] = {}
            for r in self._ix.recs.values():
                ns = decode_key(self._ix.keys[r.key_id]).get("namespace", "?")
                d = per_ns.setdefault(ns, {"records": 0, "bytes": 0})
                d["records"] += 1
                d["bytes"] += r.span
            atimes = [r.atime_ns for r in self._ix.recs.values()]
            out = {
                "path": str(self.path),
                "mode": self.mode,
                "identity": dict(self.identity.__dict__),
                "mismatch": self.mismatch,
                "records": len(self._ix.recs),
                "segments": len(self._segs),
                "damaged_segments": sum(1 for s in self._segs.values() if s.damaged),
                "live_bytes": sum(s.live_bytes for s in self._segs.values()),
                "file_bytes": sum(s.file_bytes for s in self._segs.values()),
                "capacity_bytes": self.capacity_bytes,
                "ttl_s": self.ttl_s,
                "durability": self.durability,
                "oldest_access_ns": min(atimes) if atimes else None,
                "newest_access_ns": max(atimes) if atimes else None,
                "namespaces": per_ns,
                "o_direct": self._direct_seen,
                "degraded": self.degraded_reason if self.degraded else None,
                "recovery_seconds": self.recovery_seconds,
                "recovery": dict(self.counts),
                "unusable_files": list(self.unusable),
                "io": self._eng.counters(),
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
        if self.closed:
            return
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        finalizing = sys.is_finalizing()
        with self._write_lock:
            if self.writable and not finalizing:
                self.commit()  # what is queued, and waits for commits in flight
            self._journal.close(fsync=self.durability == "fsync")
            with self._lock:
                for s in self._segs.values():
                    if s.fd is not None:
                        os.close(s.fd)
                        s.fd = None
                for fd in self._fd_graveyard:
                    os.close(fd)
                self._fd_graveyard.clear()
                self._gds_files.clear()
            if not finalizing:
                self._sealer.stop()
            self._release_lock()
            self.closed = True

    def __enter__(self) -> "PersistentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self.closed and self._writer_lock is not None:
                self.close()
        except Exception:
            pass
