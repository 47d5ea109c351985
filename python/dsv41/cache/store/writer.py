"""SegmentWriter: writing one segment and publishing it by rename.

Records are encoded into staging chunks, written while the next chunk is encoded, then
footer, trailer and header; fsync (durability "fsync"), rename into place, fsync of the
directory. A reader lists only renamed segments, so it never sees a partial one; a crash
leaves at most a temporary file, which the next writer deletes.

Encoding runs in C++ on the I/O engine's threads (IOEngine.encode_records): each record is
copied into the staging chunk and its data CRC computed over the bytes the copy just
brought into cache, so Python only packs the 256-byte heads.
"""
from __future__ import annotations

import collections
import os
import threading
import time

import numpy as np

from .. import io as _io
from . import format as sf
from .index import SegmentFile, StoredRecord
from .segment_layout import SegmentLayout
from .staging import StagingPool
from .state import StoreState

__all__ = ["SegmentWriter", "Unsealed", "ParentLost", "WRITE_CHUNK", "IN_FLIGHT", "STAGING_CHUNKS"]

# The writer threads issue the chunk writes in order while the caller encodes the next
# chunks. Chunks are 4 MiB slices of one huge-page-backed staging pool, so each goes to
# the disk as one request: a write's time follows the number of requests more than their
# size, so fewer, larger requests move the same bytes sooner (the measurements:
# docs/performance.md#what-moved-the-reads-and-writes-no-json).
# The encoder runs up to 4 chunks (16 MiB) ahead: on a shared machine the encoding
# thread is sometimes descheduled for milliseconds, and the queue keeps the disk busy
# meanwhile. Every staging chunk (header and footer included) fits one staging slice, so
# the store's buffer pool is reused, never reallocated.
WRITE_CHUNK = 4 << 20  # staging chunk: encoded while the ones before are written
IN_FLIGHT = 4          # chunks encoded ahead of the writer (queued or being written)
STAGING_CHUNKS = IN_FLIGHT + 1  # staging buffers the writes cycle through (the store keeps them)


class ParentLost(Exception):
    """A segment whose records' parent, outside it, was not stored after all (the segment
    that held it failed, or it was deleted meanwhile): the segment is dropped, unpublished."""


class Unsealed:
    """A segment whose chunks are written (or queued for writing) under its temporary name:
    neither durable nor visible until SegmentWriter.seal()."""

    __slots__ = ("tmp", "name", "f", "seg", "unreaped", "first_ticket", "last_ticket", "new_recs", "file_bytes",
                 "rids", "outside_parents", "raw")

    def __init__(self, tmp, name, f, seg, raw: bool):
        self.tmp, self.name, self.f, self.seg, self.raw = tmp, name, f, seg, raw
        self.unreaped = 0  # its chunk writes not yet waited for
        self.first_ticket = self.last_ticket = 0  # its chunk writes' tickets (submit_write)
        self.new_recs: list[StoredRecord] = []
        self.file_bytes = 0
        self.rids: set[int] = set()
        self.outside_parents: set[int] = set()  # parents of its records stored elsewhere


class SegmentWriter:
    """Writes segments of one store. Its chunk writes in flight (oldest first) are its own;
    callers serialize start() under the state's write lock, and seal() runs on one thread
    at a time (the committer's sealer, or a compaction that waited for it)."""

    def __init__(self, state: StoreState, staging: StagingPool):
        self._state = state
        self._staging = staging
        # Chunk writes go to the engine's writer threads (submit_write); these are the ones
        # in flight, oldest first: (ticket, staging item, bytes, segment), reaped in order.
        self._in_flight: collections.deque = collections.deque()
        self._reap_lock = threading.Lock()

    def write(self, records: list, supersedes: list[bytes], raw: list | None = None) -> int:
        """Writes, makes durable and publishes one segment: start() then seal(). Returns the
        file size. On failure nothing is left behind and OSError is raised."""
        u = self.start(records, supersedes, raw)
        _, errors = self.seal([u])
        if errors:
            raise errors[0]
        return u.file_bytes

    def _reap_one(self) -> None:
        """Waits for the oldest chunk write in flight (the engine's writer threads issue them
        in order) and hands its staging buffer back. Called by the committing thread (for a
        staging buffer) and the sealer (for its segment)."""
        with self._reap_lock:
            if not self._in_flight:
                return
            ticket, item, total, u = self._in_flight.popleft()
            try:
                self._state.engine.wait_write(ticket, total, str(u.tmp))
            except OSError:
                pass  # the engine keeps the failure for seal_files, which refuses the segment
            finally:
                self._staging.put(item)
                u.unreaped -= 1

    def abandon(self, u: Unsealed) -> None:
        """Lets a segment's writes finish (their fd is about to close), closes and deletes it."""
        while u.unreaped:
            self._reap_one()
        if u.f.fd >= 0:
            os.close(u.f.fd)
            u.f.fd = -1
        try:
            os.unlink(u.tmp)
        except FileNotFoundError:
            pass

    def start(self, records: list, supersedes: list[bytes], raw: list | None = None) -> Unsealed:
        """Encodes one segment holding `records` (pending records to encode) or `raw`
        (already encoded records, copied verbatim by compaction: list of (rec, view,
        offset)) and queues its chunk writes under a temporary name. Returns before the
        writes are done; on failure nothing is left behind and OSError is raised."""
        state = self._state
        eng, staging, in_flight = state.engine, self._staging, self._in_flight
        seq, uuid = state.take_seq(), os.urandom(16)
        name = sf.segment_name(seq, uuid)
        tmp = state.path / f".tmp-{name}"
        created = state.now_ns()  # one time for the whole batch: LRU sees its chains as one age
        if raw is not None:
            lay = SegmentLayout.for_copies(raw, state.index)
        else:
            lay = SegmentLayout.for_new(records, created, state.identity.block_tokens, state.identity.block_bytes)
        # Header, footer and trailer are known before any record is written: the header goes
        # out with the first chunk and footer and trailer with the last, so a segment is one
        # stream of chunk writes (then one fdatasync) rather than chunks plus two more writes.
        footer = sf.encode_footer(lay.entries, lay.keys)
        footer_off = _io.align_up(lay.end)  # zeros from the last record's end to the page
        fpad = _io.align_up(len(footer))
        tail_size = fpad + sf.PAGE
        file_bytes = footer_off + tail_size
        trailer = sf.encode_trailer(sf.SegmentTrailer(uuid, footer_off, len(footer), lay.n, _io.crc32c(footer)))
        header = sf.encode_segment_header(sf.SegmentHeader(uuid, seq, time.time_ns(), state.identity.store_id,
                                                           lay.n, list(supersedes)))
        chunks = lay.chunks(WRITE_CHUNK, tail_size)
        f = eng.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, direct=state.direct)
        u = Unsealed(tmp, name, f, SegmentFile(uuid, seq, name, 0), raw is not None)
        try:
            heads = lay.heads
            carry = None  # the previous chunk's partial last page: bytes [its write's end, start of `first`)
            for ci, (first, end, start) in enumerate(chunks):
                last = ci == len(chunks) - 1
                # This buffer holds file bytes [start, stop); it writes them up to its last
                # full page (all of them in the last chunk, which ends with the trailer page).
                stop = file_bytes if last else lay.bound(end)
                total = stop if last else stop // sf.PAGE * sf.PAGE
                total -= start
                # Encode this chunk while the ones before are being written (at most
                # IN_FLIGHT of them, this segment's or an earlier one's still being sealed).
                while len(in_flight) >= IN_FLIGHT:
                    self._reap_one()
                item = staging.get(stop - start)
                buf, view = item
                try:
                    if ci == 0:
                        view[: sf.PAGE] = np.frombuffer(header, dtype=np.uint8)
                    elif carry is not None and len(carry):
                        view[: len(carry)] = carry
                    if raw is not None:
                        for i in range(first, end):
                            rec, src_view, src_off = raw[i]
                            at, rb = lay.offsets[i] - start, int(lay.entries["record_bytes"][i])
                            view[at: at + rb] = src_view[src_off: src_off + rb]
                            view[at + rb: at + rec.span] = 0  # the fill after a record is zeros, as encoded
                    elif end > first:
                        eng.encode_records(buf, [
                            (lay.offsets[i] - start, heads[i * 256: i * 256 + 256], p.tokens, p.key, p.payload)
                            for i, p in zip(range(first, end), records[first:end])])
                    state.hook("write")
                    if last:
                        at = footer_off - start
                        view[lay.end - start: at] = 0
                        view[at: at + tail_size] = 0
                        view[at: at + len(footer)] = np.frombuffer(footer, dtype=np.uint8)
                        view[at + fpad: at + tail_size] = np.frombuffer(trailer, dtype=np.uint8)
                        state.hook("footer")
                    else:
                        # Copied now: the buffer goes back to the pool once written.
                        carry = view[total: stop - start].copy()
                    if total == 0:  # less than a page so far (tiny records before a huge one)
                        staging.put(item)
                        continue
                    ticket = eng.submit_write(f.fd, start, buf, 0, total)
                except BaseException:
                    staging.put(item)
                    raise
                u.unreaped += 1
                u.first_ticket = u.first_ticket or ticket
                u.last_ticket = ticket
                in_flight.append((ticket, item, total, u))
            # The index entries are built while the last chunks are being written.
            u.new_recs = self._stored_records(lay, u.seg, [r.hash for r, _, _ in raw] if raw is not None
                                              else [p.block_hash for p in records])
            u.file_bytes = file_bytes
            if raw is None:
                u.rids = {p.rid for p in records}
                u.outside_parents = {p.parent for p in records if p.parent and p.parent not in u.rids}
        except BaseException:
            self.abandon(u)
            raise
        return u

    def seal(self, us: list[Unsealed]) -> tuple[list[Unsealed], list[Exception]]:
        """Seals segments written in this order (one commit's) as one group: waits for all
        their writes, then fdatasync, rename and index each, parents' segments first, and
        one fsync of the directory (IOEngine.seal_files: one engine call, so this thread
        gives up the GIL once; every time it does, getting it back can take a switch
        interval). Every flush comes after the last segment's writes: on the development
        VM's disk a flush stalls the writes queued behind it, and a segment flushed while
        the next one was being written held that one back for the whole flush
        (bench/bench_cache.py, 64K-token commits of two segments). A segment whose parent
        records outside it are gone (ParentLost) is skipped, with any later one that needs
        its records; an I/O error stops the group there. Returns (the segments published,
        in order; what kept the others out: ParentLost per skipped segment, then the
        OSError that stopped the group): the others are deleted, nothing of them is left
        behind."""
        state = self._state
        kept: list[Unsealed] = []
        errors: list[Exception] = []
        with state.lock:
            stored, kept_rids = state.index.recs, set()
            for u in us:
                lost = [p for p in u.outside_parents if p not in stored and p not in kept_rids]
                if lost:
                    errors.append(ParentLost(f"parent record {lost[0]} is no longer stored"))
                    continue
                kept.append(u)
                kept_rids |= u.rids
        for u in us:
            if u not in kept:
                self.abandon(u)
        try:
            for _ in kept:
                state.hook("seal")
            err, step, renamed = state.engine.seal_files(
                [(u.f.fd, u.first_ticket, u.last_ticket, str(u.tmp), str(state.path / u.name)) for u in kept],
                state.durability == "fsync", str(state.path))
        except BaseException:
            for u in kept:
                self.abandon(u)
            raise
        for u in kept:
            while u.unreaped:  # done already: hands their staging buffers back
                self._reap_one()
        for i, u in enumerate(kept):
            if i < renamed:  # under its final name: only its fd to close
                os.close(u.f.fd)
                u.f.fd = -1
            else:
                self.abandon(u)
        published = kept[:renamed]
        if err:
            if step > _io.SEAL_RENAME:
                # Renamed, but the directory's fsync failed: not durable, so not indexed (a
                # restart's recovery finds them); reported like the rest.
                return [], errors + [OSError(err, os.strerror(err), str(state.path))]
            # The segments before the one that failed are durable and published.
            errors.append(OSError(err, os.strerror(err), str(kept[renamed].tmp)))
        for _ in published:
            state.hook("published")
        with state.lock:
            index = state.index
            for u in published:
                seg = u.seg
                seg.file_bytes = u.file_bytes
                state.segments[seg.uuid] = seg
                if not u.raw:
                    index.add_many(u.new_recs)  # fresh record ids: none is indexed yet
                    continue
                for r in u.new_recs:
                    old = index.recs.get(r.rid)
                    if old is None:
                        continue  # deleted while being copied: stays deleted
                    index.remove(old)
                    r.atime_ns = old.atime_ns
                    index.add(r)
        return published, errors

    def _stored_records(self, lay: SegmentLayout, seg: SegmentFile, hashes: list[bytes]) -> list[StoredRecord]:
        """The index entries of a segment's records (added once it is published)."""
        with self._state.lock:
            kid = [self._state.index.key_id(k) for k in lay.keys]
        e = lay.entries
        created = e["created_ns"].tolist()
        return [StoredRecord(rid, parent, seg, off, span, bi, c, kid[ki], h)
                for rid, parent, off, span, bi, c, ki, h in zip(
                    e["record_id"].tolist(), e["parent_id"].tolist(), lay.offsets, lay.spans,
                    e["block_index"].tolist(), created, e["key_index"].tolist(), hashes)]
