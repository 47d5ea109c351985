"""Writing a segment: records encoded into staging chunks, written while the next chunk is
encoded, then footer, trailer and header; fsync (durability "fsync"), rename into place,
fsync of the directory. A reader lists only renamed segments, so it never sees a partial
one; a crash leaves at most a temporary file, which the next writer deletes.

Encoding runs in C++ on the I/O engine's threads (IOEngine.encode_records): each record is
copied into the staging chunk and its data CRC computed over the bytes the copy just
brought into cache, so Python only packs the 256-byte heads.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from .. import io as _io
from . import files as _files
from . import format as sf
from .index import SegmentFile, StoredRecord

if TYPE_CHECKING:
    from .store import CommitResult, PendingRecord, PersistentStore

log = logging.getLogger("dsv41.cache.store")

__all__ = ["write_segment", "start_segment", "seal_segment", "seal_segments", "commit_pending", "CommitTicket",
           "SerialWorker", "ParentLost"]

# The writer threads issue the chunk writes in order while the caller encodes the next
# chunks. Chunks are 4 MiB slices of one huge-page-backed staging pool, so each goes to
# the disk as one request: on the 2-core development VM (O_DIRECT on ext4, virtio) a
# write's time follows the number of requests, and 4 MiB writes from huge pages moved
# the same bytes in 0.6-0.8x the time of 1 MiB writes (docs/cache.md, "Write path").
# The encoder runs up to 4 chunks (16 MiB) ahead: on a shared machine the encoding
# thread is sometimes descheduled for milliseconds, and the queue keeps the disk busy
# meanwhile. Every staging chunk (header and footer included) fits one staging slice, so
# the store's buffer pool is reused, never reallocated.
WRITE_CHUNK = 4 << 20  # staging chunk: encoded while the ones before are written
IN_FLIGHT = 4          # chunks encoded ahead of the writer (queued or being written)
STAGING_CHUNKS = IN_FLIGHT + 1  # staging buffers the writes cycle through (the store keeps them)


class _Layout:
    """Where a segment's records go and what its footer says, as arrays (one Python step
    per record at most: a commit of 64K-token prefixes holds thousands of records)."""

    __slots__ = ("n", "offsets", "spans", "end", "entries", "keys", "heads")

    def __init__(self, n: int):
        self.n = n
        self.entries = np.zeros(n, dtype=sf.FOOTER_DTYPE)
        self.keys: list[bytes] = []
        self.heads: bytes = b""  # new records: their unsealed 256-byte heads, back to back

    def place(self, spans: np.ndarray) -> None:
        """Packs the records back to back after the header page: record i at the end of
        record i - 1 (spans are multiples of RECORD_ALIGN); `end` is where the last ends."""
        self.spans = spans.tolist()
        ends = sf.PAGE + np.cumsum(spans, dtype=np.int64)
        self.offsets = (ends - spans).tolist()
        self.entries["offset"] = ends - spans
        self.end = int(ends[-1]) if self.n else sf.PAGE

    def bound(self, i: int) -> int:
        """Where record i starts (i == n: where the records end)."""
        return self.offsets[i] if i < self.n else self.end

    @classmethod
    def for_new(cls, records: list, created: int, block_tokens: int, block_bytes: int) -> "_Layout":
        lay = cls(len(records))
        # Columns of the PendingRecord tuples in one step (a segment holds thousands, and
        # this runs before the segment's first chunk write).
        rids, parents, block_indices, block_hashes, parent_hashes, _, keys, _ = zip(*records)
        key_ix = {k: i for i, k in enumerate(dict.fromkeys(keys))}  # usually one key
        lay.keys = list(key_ix)
        kis = list(map(key_ix.__getitem__, keys))
        klen = np.array([len(k) for k in lay.keys], dtype=np.int64)[np.array(kis, dtype=np.int64)]
        heads = sf.pack_record_headers(
            record_ids=rids, parent_ids=parents, created_ns=created, block_indices=block_indices,
            token_count=block_tokens, key_bytes=klen, payload_bytes=block_bytes, block_hashes=block_hashes,
            parent_hashes=parent_hashes)
        rbytes = heads["record_bytes"].astype(np.int64)
        lay.place(-(-rbytes // sf.RECORD_ALIGN) * sf.RECORD_ALIGN)  # record_span, for the array
        e = lay.entries
        for f in ("record_id", "parent_id", "created_ns", "record_bytes", "block_index", "token_count",
                  "hash_bytes", "block_hash"):
            e[f] = heads[f]
        e["key_index"] = kis
        lay.heads = heads.tobytes()
        return lay

    @classmethod
    def for_copies(cls, raw: list, index) -> "_Layout":
        """Records copied verbatim by compaction: raw [(StoredRecord, view, offset)]."""
        lay = cls(len(raw))
        key_ix: dict[bytes, int] = {}
        kis = [key_ix.setdefault(index.keys[r.key_id], len(key_ix)) for r, _, _ in raw]
        lay.keys = list(key_ix)
        lay.place(np.array([r.span for r, _, _ in raw], dtype=np.int64))
        heads = np.stack([v[o: o + sf.REC_HEADER_BYTES] for _, v, o in raw]).view(sf.REC_DTYPE).reshape(-1)
        e = lay.entries
        e["record_id"] = [r.rid for r, _, _ in raw]
        e["parent_id"] = [r.parent for r, _, _ in raw]
        e["created_ns"] = [r.created_ns for r, _, _ in raw]
        e["block_index"] = [r.block_index for r, _, _ in raw]
        e["record_bytes"] = heads["record_bytes"]
        e["token_count"] = heads["token_count"]
        e["key_index"] = kis
        e["hash_bytes"] = [len(r.hash) for r, _, _ in raw]
        e["block_hash"] = np.frombuffer(b"".join(r.hash.ljust(32, b"\0") for r, _, _ in raw), "V32")
        return lay

    def chunks(self, limit: int, tail: int) -> list[tuple[int, int, int]]:
        """(first, end, start) of the segment's chunk writes: records [first, end) are
        encoded into one staging buffer whose byte 0 is file offset `start` (a page
        boundary). Records are packed, so a chunk's records seldom end on a page: its
        write stops at its last full page and the partial page left is carried to the
        start of the next chunk's buffer (O_DIRECT writes whole pages). A buffer holds at
        most `limit` bytes, carried page, header page (first chunk) and `tail` (footer and
        trailer, after the zeros up to the next page; last chunk) included, except that a
        record larger than that gets a chunk of its own; the tail gets a chunk of its own
        (first == end) when it does not fit."""
        out, first, start = [], 0, 0
        for i in range(self.n):
            if i > first and self.offsets[i] + self.spans[i] - start > limit:
                out.append((first, i, start))
                first, start = i, self.offsets[i] // sf.PAGE * sf.PAGE
        if self.n and _io.align_up(self.end) + tail - start > limit:
            out.append((first, self.n, start))
            first, start = self.n, self.end // sf.PAGE * sf.PAGE
        out.append((first, self.n, start))
        return out


class ParentLost(Exception):
    """A segment whose records' parent, outside it, was not stored after all (the segment
    that held it failed, or it was deleted meanwhile): the segment is dropped, unpublished."""


class Unsealed:
    """A segment whose chunks are written (or queued for writing) under its temporary name:
    neither durable nor visible until seal_segment()."""

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

    def abandon(self, store: PersistentStore) -> None:
        """Lets its writes finish (their fd is about to close), closes and deletes it."""
        while self.unreaped:
            _reap_one(store)
        if self.f.fd >= 0:
            os.close(self.f.fd)
            self.f.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def write_segment(store: PersistentStore, records: list, supersedes: list[bytes], raw: list | None = None) -> int:
    """Writes, makes durable and publishes one segment: start_segment then seal_segment.
    Returns the file size. On failure nothing is left behind and OSError is raised."""
    return seal_segment(store, start_segment(store, records, supersedes, raw))


def _reap_one(store: PersistentStore) -> None:
    """Waits for the oldest chunk write in flight (the engine's writer threads issue them in
    order) and hands its staging buffer back. Called by
    the committing thread (for a staging buffer) and the sealer (for its segment)."""
    with store._reap_lock:
        if not store._in_flight:
            return
        ticket, item, total, u = store._in_flight.popleft()
        try:
            store._eng.wait_write(ticket, total, str(u.tmp))
        except OSError:
            pass  # the engine keeps the failure for seal_file, which refuses the segment
        finally:
            store._put_staging(item)
            u.unreaped -= 1


def start_segment(store: PersistentStore, records: list, supersedes: list[bytes], raw: list | None = None) -> Unsealed:
    """Encodes one segment holding `records` (pending records to encode) or `raw` (already
    encoded records, copied verbatim by compaction: list of (rec, view, offset)) and queues
    its chunk writes under a temporary name. Returns before the writes are done; on
    failure nothing is left behind and OSError is raised."""
    seq, uuid = store._next_seq, os.urandom(16)
    store._next_seq += 1
    name = sf.segment_name(seq, uuid)
    tmp = store.path / f".tmp-{name}"
    created = store._now_ns()  # one time for the whole batch: LRU sees its chains as one age
    if raw is not None:
        lay = _Layout.for_copies(raw, store._ix)
    else:
        lay = _Layout.for_new(records, created, store.identity.block_tokens, store.identity.block_bytes)
    # Header, footer and trailer are known before any record is written: the header goes
    # out with the first chunk and footer and trailer with the last, so a segment is one
    # stream of chunk writes (then one fdatasync) rather than chunks plus two more writes.
    footer = sf.encode_footer(lay.entries, lay.keys)
    footer_off = _io.align_up(lay.end)  # zeros from the last record's end to the page
    fpad = _io.align_up(len(footer))
    tail_size = fpad + sf.PAGE
    file_bytes = footer_off + tail_size
    trailer = sf.encode_trailer(sf.SegmentTrailer(uuid, footer_off, len(footer), lay.n, _io.crc32c(footer)))
    header = sf.encode_segment_header(sf.SegmentHeader(uuid, seq, time.time_ns(), store.identity.store_id,
                                                       lay.n, list(supersedes)))
    chunks = lay.chunks(WRITE_CHUNK, tail_size)
    f = store._eng.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, direct=store.direct)
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
            while len(store._in_flight) >= IN_FLIGHT:
                _reap_one(store)
            item = store._get_staging(stop - start)
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
                    store._eng.encode_records(buf, [
                        (lay.offsets[i] - start, heads[i * 256: i * 256 + 256], p.tokens, p.key, p.payload)
                        for i, p in zip(range(first, end), records[first:end])])
                store._hook("write")
                if last:
                    at = footer_off - start
                    view[lay.end - start: at] = 0
                    view[at: at + tail_size] = 0
                    view[at: at + len(footer)] = np.frombuffer(footer, dtype=np.uint8)
                    view[at + fpad: at + tail_size] = np.frombuffer(trailer, dtype=np.uint8)
                    store._hook("footer")
                else:
                    # Copied now: the buffer goes back to the pool once written.
                    carry = view[total: stop - start].copy()
                if total == 0:  # less than a page so far (tiny records before a huge one)
                    store._put_staging(item)
                    continue
                ticket = store._eng.submit_write(f.fd, start, buf, 0, total)
            except BaseException:
                store._put_staging(item)
                raise
            u.unreaped += 1
            u.first_ticket = u.first_ticket or ticket
            u.last_ticket = ticket
            store._in_flight.append((ticket, item, total, u))
        # The index entries are built while the last chunks are being written.
        u.new_recs = _stored_records(store, lay, u.seg, [r.hash for r, _, _ in raw] if raw is not None
                                     else [p.block_hash for p in records])
        u.file_bytes = file_bytes
        if raw is None:
            u.rids = {p.rid for p in records}
            u.outside_parents = {p.parent for p in records if p.parent and p.parent not in u.rids}
    except BaseException:
        u.abandon(store)
        raise
    return u


def seal_segment(store: PersistentStore, u: Unsealed) -> int:
    """Waits for an Unsealed segment's writes, makes it durable (durability "fsync"),
    renames it into place, fsyncs the directory and indexes its records. Returns the file
    size. On failure nothing is left behind and OSError (or ParentLost) is raised."""
    _, errors = seal_segments(store, [u])
    if errors:
        raise errors[0]
    return u.file_bytes


def seal_segments(store: PersistentStore, us: list[Unsealed]) -> tuple[list[Unsealed], list[Exception]]:
    """Seals segments written in this order (one commit's) as one group: waits for all
    their writes, then fdatasync, rename and index each, parents' segments first, and one
    fsync of the directory (IOEngine.seal_files: one engine call, so this thread gives up
    the GIL once; every time it does, getting it back can take a switch interval). Every
    flush comes after the last segment's writes: on the development VM's disk a flush
    stalls the writes queued behind it, and a segment flushed while the next one was being
    written held that one back for the whole flush (bench/bench_cache.py, 64K-token
    commits of two segments). A segment whose parent records outside it are gone
    (ParentLost) is skipped, with any later one that needs its records; an I/O error stops
    the group there. Returns (the segments published, in order; what kept the others
    out: ParentLost per skipped segment, then the OSError that stopped the group): the
    others are deleted, nothing of them is left behind."""
    kept: list[Unsealed] = []
    errors: list[Exception] = []
    with store._lock:
        stored, kept_rids = store._ix.recs, set()
        for u in us:
            lost = [p for p in u.outside_parents if p not in stored and p not in kept_rids]
            if lost:
                errors.append(ParentLost(f"parent record {lost[0]} is no longer stored"))
                continue
            kept.append(u)
            kept_rids |= u.rids
    for u in us:
        if u not in kept:
            u.abandon(store)
    try:
        for _ in kept:
            store._hook("seal")
        err, step, renamed = store._eng.seal_files(
            [(u.f.fd, u.first_ticket, u.last_ticket, str(u.tmp), str(store.path / u.name)) for u in kept],
            store.durability == "fsync", str(store.path))
    except BaseException:
        for u in kept:
            u.abandon(store)
        raise
    for u in kept:
        while u.unreaped:  # done already: hands their staging buffers back
            _reap_one(store)
    for i, u in enumerate(kept):
        if i < renamed:  # under its final name: only its fd to close
            os.close(u.f.fd)
            u.f.fd = -1
        else:
            u.abandon(store)
    published = kept[:renamed]
    if err:
        if step > _io.SEAL_RENAME:
            # Renamed, but the directory's fsync failed: not durable, so not indexed (a
            # restart's recovery finds them); reported like the rest.
            return [], errors + [OSError(err, os.strerror(err), str(store.path))]
        # The segments before the one that failed are durable and published.
        errors.append(OSError(err, os.strerror(err), str(kept[renamed].tmp)))
    for _ in published:
        store._hook("published")
    with store._lock:
        for u in published:
            seg = u.seg
            seg.file_bytes = u.file_bytes
            store._segs[seg.uuid] = seg
            if not u.raw:
                store._ix.add_many(u.new_recs)  # fresh record ids: none is indexed yet
                continue
            for r in u.new_recs:
                old = store._ix.recs.get(r.rid)
                if old is None:
                    continue  # deleted while being copied: stays deleted
                store._ix.remove(old)
                r.atime_ns = old.atime_ns
                store._ix.add(r)
    return published, errors


def _stored_records(store: PersistentStore, lay: _Layout, seg: SegmentFile, hashes: list[bytes]) -> list[StoredRecord]:
    """The index entries of a segment's records (added once it is published)."""
    with store._lock:
        kid = [store._ix.key_id(k) for k in lay.keys]
    e = lay.entries
    created = e["created_ns"].tolist()
    return [StoredRecord(rid, parent, seg, off, span, bi, c, kid[ki], h)
            for rid, parent, off, span, bi, c, ki, h in zip(
                e["record_id"].tolist(), e["parent_id"].tolist(), lay.offsets, lay.spans,
                e["block_index"].tolist(), created, e["key_index"].tolist(), hashes)]


class SerialWorker:
    """One daemon thread that runs submitted steps in order (a store's sealer). Not
    concurrent.futures: that refuses new work once interpreter shutdown has begun, and a
    cache commits its queued writes at exit. A thread that is gone (a forked child
    inherits none) is started again."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the thread if it is not running (a writable store does at open, so its
        first commit does not wait for a thread to start)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def submit(self, fn, *args) -> "_Job":
        job = _Job()
        if sys.is_finalizing():
            # No thread runs again (nor starts) once the interpreter finalizes: the step
            # runs here, rather than waiting for a thread that never takes it.
            self._run_one(job, fn, args)
            return job
        self.start()  # after a fork the child has none
        self._q.put((job, fn, args))
        return job

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            self._run_one(*item)

    @staticmethod
    def _run_one(job: "_Job", fn, args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to result()
            job.error = e
        job.done.set()

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        self._thread = None


class _Job:
    __slots__ = ("done", "error")

    def __init__(self):
        self.done = threading.Event()
        self.error: BaseException | None = None

    def result(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class CommitTicket:
    """A commit in flight (PersistentStore.commit_async): result() waits until its records
    are durable and visible, or dropped, and returns the CommitResult."""

    def __init__(self, res: CommitResult, rids: list[int]):
        self.res = res
        self.rids = rids
        self._jobs: list[_Job] = []

    def done(self) -> bool:
        return all(j.done.is_set() for j in self._jobs)

    def result(self) -> CommitResult:
        for job in self._jobs:
            job.result()  # a bug in a sealing step is raised here, not lost in the thread
        return self.res


def commit_pending(store: PersistentStore, pending: list[PendingRecord]) -> CommitTicket:
    """Starts writing records taken from the queue (PersistentStore.commit_async holds the
    write lock): segments of at most segment_bytes, parents before children. Each segment's
    chunks are encoded and queued here; once the last one's are, the store's sealer thread
    makes the commit's segments durable and visible as one group (seal_segments), in
    commit order, while the caller goes on (the next commit's encoding overlaps this one's
    last writes, fsync and rename). An I/O error
    degrades the tier: the rest is dropped, nothing is raised."""
    from .store import CommitResult
    res = CommitResult()
    ticket = CommitTicket(res, [p.rid for p in pending])
    t0 = time.perf_counter()
    if pending and store.degraded:
        res.dropped = [p.rid for p in pending]
        res.error = store.degraded_reason
        store.metrics.persist_failures.inc(cause="degraded")
        pending = []
    groups = _segment_groups(store, pending)
    started: list[Unsealed] = []
    for gi, g in enumerate(groups):
        # A record whose parent is gone (dropped, or deleted since put) cannot be
        # stored: the store holds whole prefixes only. Parents come before children; a
        # parent in a segment still being sealed counts (seal_segments checks it made it).
        with store._lock:
            alive = _with_live_parents(store, g)
        if len(alive) < len(g):
            kept = {p.rid for p in alive}
            res.dropped += [p.rid for p in g if p.rid not in kept]
        if not alive:
            continue
        try:
            u = start_segment(store, alive, supersedes=[])
        except OSError as e:
            res.dropped += [p.rid for p in alive]
            store._degrade(e)
            res.error = store.degraded_reason
            for rest in groups[gi + 1:]:
                res.dropped += [p.rid for p in rest]
            break
        with store._lock:
            store._unsealed_rids |= u.rids
        started.append(u)
    if started:
        ticket._jobs.append(store._sealer.submit(_seal_commit, store, started, res))
    # Last in the sealer's queue: after every earlier commit's segments too, so a ticket
    # that is done means everything committed before it is done as well.
    ticket._jobs.append(store._sealer.submit(_commit_finished, store, ticket, t0))
    return ticket


def _segment_groups(store: PersistentStore, pending: list) -> list[list]:
    """Splits a commit's records, in put order, into segments of at most segment_bytes
    (each record counts its span and 128 bytes of footer, more than its 88-byte entry).
    One Python step per segment: a 64K-token commit is thousands of records, and this
    runs before the first chunk write can start."""
    if not pending:
        return []
    T, P = store.identity.block_tokens, store.identity.block_bytes
    key_len = np.fromiter(map(len, (p.key for p in pending)), dtype=np.int64, count=len(pending))
    lens = np.unique(key_len)
    cost = np.zeros(len(pending), dtype=np.int64)
    for n in lens.tolist():  # put() fixed T and P: a record's size follows its key length
        cost[key_len == n] = sf.record_geometry(T, n, P)[2] + 128
    groups, first, limit = [], 0, store.segment_bytes - sf.PAGE * 3
    ends = np.cumsum(cost)
    while first < len(pending):
        base = ends[first - 1] if first else 0
        # The last record that still fits; at least one per segment, however large.
        end = max(first + 1, int(np.searchsorted(ends, base + limit, side="right")))
        groups.append(pending[first:end])
        first = end
    return groups


def _with_live_parents(store: PersistentStore, group: list) -> list:
    """The records of `group` whose parent is stored, queued in a segment being sealed,
    or an earlier record of the group that is itself kept (called under store._lock)."""
    recs, unsealed = store._ix.recs, store._unsealed_rids
    alive, ok = [], set()
    for p in group:
        par = p.parent
        if not par or par in ok or par in recs or par in unsealed:
            alive.append(p)
            ok.add(p.rid)
    return alive


def _seal_commit(store: PersistentStore, us: list[Unsealed], res: CommitResult) -> None:
    """The sealer thread's step for a commit's segments (seal_segments: one group)."""
    try:
        published, errors = seal_segments(store, us)
        for u in us:
            rids = [r.rid for r in u.new_recs]
            if u in published:
                res.bytes_written += u.file_bytes
                res.persisted += rids
            else:
                res.dropped += rids
        for e in errors:
            if isinstance(e, ParentLost):
                log.warning("persistent store %s: a segment was not published: %s", store.path, e)
            else:
                store._degrade(e)
                res.error = store.degraded_reason
    finally:
        with store._lock:
            for u in us:
                store._unsealed_rids -= u.rids


def _commit_finished(store: PersistentStore, ticket: CommitTicket, t0: float) -> None:
    """The sealer thread's last step of a commit: metrics, the journal, and only now are
    its records stored (or dropped): until here a put() may still name them as parents."""
    res = ticket.res
    with store._lock:
        store._pending_rids.difference_update(ticket.rids)
        store._journal.flush()
    if ticket.rids:
        store.metrics.ssd_commit_seconds.observe(time.perf_counter() - t0)
        store.metrics.bytes_written.inc(res.bytes_written, tier="ssd")
        store.metrics.inserted_blocks.inc(len(res.persisted), tier="ssd")
    store._update_gauges()
