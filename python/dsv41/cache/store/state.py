"""StoreState: what the parts of one store share, and the operations on it alone.

The parts (SegmentWriter, RecordReader, Compactor, recovery, verify) each keep their own
state private and meet here: the directory and its identity, the in-memory index and the
segment files it points into, the journal, the id counters, the locks, and what opening
the store found. Everything here is public to those parts by design; nothing here opens a
file other than through the journal.

Locks: `lock` guards the index, `segments`, the journal's buffer and the id counters (an
RLock: a part may call another's method while holding it); `write_lock` serializes
commits, GC and verify --repair, and is always taken before `lock`.
"""
from __future__ import annotations

import errno
import logging
import threading
from pathlib import Path
from typing import Callable

from ..errors import StoreReadOnlyError
from ..io import IOEngine
from ..metrics import CacheMetrics
from . import format as sf
from .index import RecordIndex, SegmentFile, StoredRecord
from .journal import Journal
from .manifest import StoreIdentity
from .segments import SegmentLoader

__all__ = ["StoreState", "JOURNAL_FLUSH_BYTES"]

log = logging.getLogger("dsv41.cache.store")

JOURNAL_FLUSH_BYTES = 128 << 10  # access entries buffered before touch() writes them out (4,096 entries)


class StoreState:
    """One store's shared state (see the module docstring)."""

    def __init__(self, path: Path, mode: str, *, engine: IOEngine, clock: Callable[[], float],
                 metrics: CacheMetrics, capacity_bytes: int | None, ttl_s: float | None, durability: str,
                 segment_bytes: int, direct: bool, fault: Callable[[str], None] | None):
        self.path = path
        self.mode = mode
        self.engine = engine
        self.clock = clock
        self.metrics = metrics
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.durability = durability
        self.segment_bytes = segment_bytes
        self.direct = direct
        self.fault = fault
        self.lock = threading.RLock()
        self.write_lock = threading.RLock()
        self.identity: StoreIdentity | None = None
        self.mismatch: str | None = None
        self.closed = False
        self.index = RecordIndex()
        self.segments: dict[bytes, SegmentFile] = {}
        self.journal = Journal(path, writable=False)
        self.next_rid = 1
        self.next_seq = 1
        self.counts = {"recovered_records": 0, "recovered_segments": 0, "torn_temp_files": 0,
                       "damaged_segments": 0, "foreign_segments": 0, "duplicate_records": 0,
                       "orphans_dropped": 0, "superseded_segments": 0, "journal_torn_bytes": 0,
                       "unusable_files": 0, "colliding_records": 0}
        self.unusable: list[str] = []  # names skipped by note_unusable, with why

    # ---- what the store is ---------------------------------------------------------------

    @property
    def writable(self) -> bool:
        return self.mode == "w" and self.mismatch is None and not self.closed

    def check_writable(self) -> None:
        """Raises StoreReadOnlyError saying why the store takes no writes, if it does not."""
        if self.closed:
            raise StoreReadOnlyError(errno.EBADF, f"persistent store {self.path} is closed")
        if self.mode != "w":
            raise StoreReadOnlyError(errno.EROFS, f"persistent store {self.path} is open read-only")
        if self.mismatch is not None:
            raise StoreReadOnlyError(errno.EROFS, f"persistent store {self.path} was opened as an empty "
                                     f"tier after a mismatch ({self.mismatch}): not writable")

    def now_ns(self) -> int:
        return int(self.clock() * 1e9)

    def hook(self, stage: str) -> None:
        """The test fault hook, at a named stage of a write ("write", "footer", "seal",
        "published")."""
        if self.fault is not None:
            self.fault(stage)

    def note_unusable(self, name: str, e: OSError) -> None:
        """A name in the store that cannot be one of its files (a link, FIFO, directory):
        skipped, counted, and reported by stats and verify."""
        self.counts["unusable_files"] += 1
        self.unusable.append(f"{name}: {e.strerror or e}")
        log.warning("%s", e.strerror or e)

    def loader(self) -> SegmentLoader:
        return SegmentLoader(self.path, self.identity, self.index, self.counts, self.note_unusable)

    def take_seq(self) -> int:
        """The sequence number of a new segment (segments are ordered by it)."""
        with self.lock:
            seq = self.next_seq
            self.next_seq += 1
            return seq

    # ---- the index ---------------------------------------------------------------------

    def delete(self, rid: int, cause: str) -> int:
        """Removes a record and every record below it, journaled; returns how many."""
        with self.lock:
            r = self.index.recs.get(rid)
            if r is None:
                return 0
            now = self.now_ns()
            removed = self.index.remove_subtree(r)
            for cur in removed:
                self.metrics.evictions.inc(tier="ssd", cause=cause if cur is r else "orphan")
                if self.mismatch is None:
                    self.journal.append(sf.J_DELETE, cur.rid, now)
            return len(removed)

    def forget(self, rid: int, cause: str) -> None:
        """Drops a record and its subtree from the in-memory index only (no journal entry:
        the files are the truth, and a restart finds what they hold)."""
        with self.lock:
            r = self.index.recs.get(rid)
            if r is not None:
                for cur in self.index.remove_subtree(r):
                    self.metrics.evictions.inc(tier="ssd", cause=cause if cur is r else "orphan")

    def expired(self, r: StoredRecord, now_ns: int) -> bool:
        return self.ttl_s is not None and now_ns - r.atime_ns > self.ttl_s * 1e9

    def walk(self, key: bytes, hashes: list[bytes], parent: int = 0, exclude: set[int] | None = None) -> list[int]:
        """Record ids of the longest chain matching `hashes` below record `parent` (0: from a
        chain's first block, matched on `key`), by the in-memory index only: unverified.
        Records past the TTL are passed over (and, by the writer, deleted)."""
        oldest = None if self.ttl_s is None else self.now_ns() - self.ttl_s * 1e9
        with self.lock:
            out, expired = self.index.walk(key, hashes, parent, exclude, oldest)
        if expired and self.writable:
            for rid in expired:
                self.delete(rid, "ttl")
        return [r.rid for r in out]

    def touch(self, rids: list[int]) -> None:
        """Marks records as used now (LRU and TTL count from the last use)."""
        now = self.now_ns()
        with self.lock:
            recs, used = self.index.recs, []
            for rid in rids:
                r = recs.get(rid)
                if r is not None:
                    r.atime_ns = now
                    used.append(rid)
            if self.writable:
                self.journal.append_many(sf.J_ACCESS, used, now)
                if self.journal.pending_bytes >= JOURNAL_FLUSH_BYTES:
                    self.journal.flush()

    def file_bytes(self) -> int:
        with self.lock:
            return sum(s.file_bytes for s in self.segments.values())

    def live_bytes(self) -> int:
        return self.index.live_total

    def update_gauges(self) -> None:
        self.metrics.entries.set(len(self.index.recs), tier="ssd")
        self.metrics.bytes.set(self.file_bytes(), tier="ssd")
