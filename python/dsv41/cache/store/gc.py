"""Compactor: TTL expiry, LRU eviction to the byte capacity, and reclaiming space.

Deletions are journal entries; space comes back when a segment without live records is
deleted, or when a mostly dead segment's live records are rewritten (verified on the way)
into a new segment that supersedes it. A segment whose read fails without proving damage
(an I/O error) is left as it is, for a later GC.
"""
from __future__ import annotations

from . import format as sf
from .commit import Committer
from .fds import SegmentFds
from .index import SegmentFile
from .plan import DAMAGED
from .reads import RecordReader
from .staging import StagingPool
from .state import StoreState
from .writer import SegmentWriter

__all__ = ["Compactor"]


class Compactor:
    def __init__(self, state: StoreState, fds: SegmentFds, staging: StagingPool, reader: RecordReader,
                 writer: SegmentWriter, committer: Committer):
        self._state = state
        self._fds = fds
        self._staging = staging
        self._reader = reader
        self._writer = writer
        self._committer = committer

    def over_capacity(self) -> bool:
        state = self._state
        return state.capacity_bytes is not None and state.writable and state.file_bytes() > state.capacity_bytes

    def gc(self, *, low_water: float = 0.9, compact_dead_fraction: float = 0.5) -> dict:
        """Expires records past the TTL, evicts least recently used records until the live
        bytes fit `low_water` x capacity, then reclaims space: deletes segments without
        live records and rewrites segments that are mostly dead (or too many small ones)
        into new segments that supersede them."""
        state = self._state
        state.check_writable()
        report = {"expired": 0, "evicted": 0, "segments_deleted": 0, "segments_compacted": 0,
                  "bytes_before": 0, "bytes_after": 0, "corrupt_dropped": 0}
        with state.write_lock:
            self._committer.drain()  # a segment being sealed checks its parents against the index
            report["bytes_before"] = state.file_bytes()
            now = state.now_ns()
            with state.lock:
                expired = [r.rid for r in state.index.recs.values() if state.expired(r, now)]
            for rid in expired:
                report["expired"] += state.delete(rid, "ttl")
            target = None if state.capacity_bytes is None else int(state.capacity_bytes * low_water)
            for _ in range(8):
                if target is not None:
                    with state.lock:
                        order = sorted(state.index.recs.values(), key=lambda r: (r.atime_ns, -r.block_index))
                    for r in order:
                        if state.live_bytes() <= target:
                            break
                        report["evicted"] += state.delete(r.rid, "capacity")
                state.journal.flush()
                deleted, compacted, corrupt = self._reclaim(compact_dead_fraction)
                report["segments_deleted"] += deleted
                report["segments_compacted"] += compacted
                report["corrupt_dropped"] += corrupt
                if state.capacity_bytes is None or state.file_bytes() <= state.capacity_bytes or not state.index.recs:
                    break
                # Segment headers and footers still overshoot the cap: evict that much more.
                target = max(0, state.live_bytes() - (state.file_bytes() - state.capacity_bytes))
            report["bytes_after"] = state.file_bytes()
            self._rewrite_journal_if_large()
            state.update_gauges()
        return report

    def _rewrite_journal_if_large(self) -> None:
        """Replaces a journal grown past what the index needs with one entry per record
        used since its creation, and the id watermarks."""
        state = self._state
        if state.journal.fd is None or state.journal.pos < 64 * 32 + 4 * 32 * len(state.index.recs):
            return
        now = state.now_ns()
        with state.lock:
            parts = [sf.encode_journal(sf.J_WATERMARK, state.next_rid, now, state.next_seq)]
            parts += [sf.encode_journal(sf.J_ACCESS, r.rid, r.atime_ns) for r in state.index.recs.values()
                      if r.atime_ns != r.created_ns]
            state.journal.rewrite(parts)

    def _reclaim(self, dead_fraction: float) -> tuple[int, int, int]:
        state = self._state
        with state.lock:
            segs = list(state.segments.values())
        empty = [s for s in segs if not s.rids]
        self._fds.retire(empty)
        live = [s for s in segs if s.rids]
        must = [s for s in live if s.damaged or s.live_bytes < (1 - dead_fraction) * s.file_bytes]
        small = [s for s in live if s.file_bytes < state.segment_bytes // 8 and s not in must]
        if len(small) > 16:  # many small commits: merge them
            must += small
        compacted = corrupt = 0

        def run(batch):
            nonlocal compacted, corrupt
            c, d = self._compact(batch)
            compacted, corrupt = compacted + c, corrupt + d

        for batch in self._batches(must):
            run(batch)
        if state.capacity_bytes is not None:
            # Still over the cap: rewrite the deadest segments, one batch at a time.
            with state.lock:
                rest = sorted((s for s in state.segments.values() if s.rids and s not in must),
                              key=lambda s: s.live_bytes / s.file_bytes)
            while rest and state.file_bytes() > state.capacity_bytes:
                batch = next(self._batches(rest))
                rest = rest[len(batch):]
                run(batch)
        return len(empty), compacted, corrupt

    def _batches(self, segs: list[SegmentFile]):
        batch, size = [], 0
        for s in segs:
            batch.append(s)
            size += s.live_bytes
            if size >= self._state.segment_bytes // 2 or len(batch) >= sf.MAX_SUPERSEDES:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch

    def _compact(self, segs: list[SegmentFile]) -> tuple[int, int]:
        """Rewrites the live records of `segs` into one new segment that supersedes them."""
        state = self._state
        with state.lock:
            recs = sorted((state.index.recs[rid] for s in segs for rid in s.rids if rid in state.index.recs),
                          key=lambda r: (r.block_index, r.rid))
        corrupt = 0
        raw = []
        item = None
        if recs:
            with self._fds.reading():
                status, item, where = self._reader.read_checked(recs, None, None, None)
            if any(st not in DAMAGED and st != "ok" for st in status):
                # A read failed without proving anything (an I/O error, a short read, a file
                # that would not open): these segments stay as they are, for a later GC.
                self._staging.put(item)
                return 0, 0
            view = item[1]
            for i, (r, st) in enumerate(zip(recs, status)):
                if st != "ok":
                    corrupt += 1
                    state.metrics.checksum_failures.inc(kind=st)
                    state.delete(r.rid, "corruption")
                    continue
                raw.append((r, view, where[i]))
            # A record whose parent was just dropped is an orphan: delete() removed it too.
            raw = [x for x in raw if x[0].rid in state.index.recs]
        try:
            if raw:
                self._writer.write([], supersedes=[s.uuid for s in segs], raw=raw)
        except OSError as e:
            self._committer.degrade(e)
            return 0, corrupt
        finally:
            if item is not None:
                self._staging.put(item)
        self._fds.retire(segs)
        return len(segs), corrupt
