"""GC: TTL expiry, LRU eviction to the byte capacity, and reclaiming space.

Deletions are journal entries; space comes back when a segment without live records is
deleted, or when a mostly dead segment's live records are rewritten (verified on the way)
into a new segment that supersedes it. The facade calls these under its write lock.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import format as sf
from . import reads, writer
from .index import SegmentFile

if TYPE_CHECKING:
    from .store import PersistentStore

__all__ = ["gc"]


def gc(store: PersistentStore, *, low_water: float = 0.9, compact_dead_fraction: float = 0.5) -> dict:
    """Expires records past the TTL, evicts least recently used records until the live
    bytes fit `low_water` x capacity, then reclaims space: deletes segments without
    live records and rewrites segments that are mostly dead (or too many small ones)
    into new segments that supersede them."""
    store._check_writable()
    report = {"expired": 0, "evicted": 0, "segments_deleted": 0, "segments_compacted": 0,
              "bytes_before": 0, "bytes_after": 0, "corrupt_dropped": 0}
    with store._write_lock:
        store._drain_seals()  # a segment being sealed checks its parents against the index
        report["bytes_before"] = store.file_bytes()
        now = store._now_ns()
        with store._lock:
            expired = [r.rid for r in store._ix.recs.values() if store._expired(r, now)]
        for rid in expired:
            report["expired"] += store._delete(rid, "ttl")
        target = None if store.capacity_bytes is None else int(store.capacity_bytes * low_water)
        for _ in range(8):
            if target is not None:
                with store._lock:
                    order = sorted(store._ix.recs.values(), key=lambda r: (r.atime_ns, -r.block_index))
                for r in order:
                    if store.live_bytes() <= target:
                        break
                    report["evicted"] += store._delete(r.rid, "capacity")
            store._journal.flush()
            deleted, compacted, corrupt = _reclaim(store, compact_dead_fraction)
            report["segments_deleted"] += deleted
            report["segments_compacted"] += compacted
            report["corrupt_dropped"] += corrupt
            if store.capacity_bytes is None or store.file_bytes() <= store.capacity_bytes or not store._ix.recs:
                break
            # Segment headers and footers still overshoot the cap: evict that much more.
            target = max(0, store.live_bytes() - (store.file_bytes() - store.capacity_bytes))
        report["bytes_after"] = store.file_bytes()
        store._rewrite_journal_if_large()
        store._update_gauges()
    return report


def _reclaim(store: PersistentStore, dead_fraction: float) -> tuple[int, int, int]:
    with store._lock:
        segs = list(store._segs.values())
    empty = [s for s in segs if not s.rids]
    store._retire(empty)
    live = [s for s in segs if s.rids]
    must = [s for s in live if s.damaged or s.live_bytes < (1 - dead_fraction) * s.file_bytes]
    small = [s for s in live if s.file_bytes < store.segment_bytes // 8 and s not in must]
    if len(small) > 16:  # many small commits: merge them
        must += small
    compacted = corrupt = 0

    def run(batch):
        nonlocal compacted, corrupt
        c, d = _compact(store, batch)
        compacted, corrupt = compacted + c, corrupt + d

    for batch in _batches(store, must):
        run(batch)
    if store.capacity_bytes is not None:
        # Still over the cap: rewrite the deadest segments, one batch at a time.
        with store._lock:
            rest = sorted((s for s in store._segs.values() if s.rids and s not in must),
                          key=lambda s: s.live_bytes / s.file_bytes)
        while rest and store.file_bytes() > store.capacity_bytes:
            batch = next(_batches(store, rest))
            rest = rest[len(batch):]
            run(batch)
    return len(empty), compacted, corrupt


def _batches(store: PersistentStore, segs: list[SegmentFile]):
    batch, size = [], 0
    for s in segs:
        batch.append(s)
        size += s.live_bytes
        if size >= store.segment_bytes // 2 or len(batch) >= sf.MAX_SUPERSEDES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _compact(store: PersistentStore, segs: list[SegmentFile]) -> tuple[int, int]:
    """Rewrites the live records of `segs` into one new segment that supersedes them."""
    with store._lock:
        recs = sorted((store._ix.recs[rid] for s in segs for rid in s.rids if rid in store._ix.recs),
                      key=lambda r: (r.block_index, r.rid))
    corrupt = 0
    raw = []
    item = None
    if recs:
        with store._reading():
            status, item, where = reads.read_checked(store, recs, None, None, None)
        if any(st not in reads.DAMAGED and st != "ok" for st in status):
            # A read failed without proving anything (an I/O error, a short read, a file
            # that would not open): these segments stay as they are, for a later GC.
            store._put_staging(item)
            return 0, 0
        view = item[1]
        for i, (r, st) in enumerate(zip(recs, status)):
            if st != "ok":
                corrupt += 1
                store.metrics.checksum_failures.inc(kind=st)
                store._delete(r.rid, "corruption")
                continue
            raw.append((r, view, where[i]))
        # A record whose parent was just dropped is an orphan: _delete removed it too.
        raw = [x for x in raw if x[0].rid in store._ix.recs]
    try:
        if raw:
            writer.write_segment(store, [], supersedes=[s.uuid for s in segs], raw=raw)
    except OSError as e:
        store._degrade(e)
        return 0, corrupt
    finally:
        if item is not None:
            store._put_staging(item)
    store._retire(segs)
    return len(segs), corrupt
