"""Writing a segment: records encoded into staging chunks, written while the next chunk is
encoded, then footer, trailer and header; fsync (durability "fsync"), rename into place,
fsync of the directory. A reader lists only renamed segments, so it never sees a partial
one; a crash leaves at most a temporary file, which the next writer deletes.

Encoding runs in C++ on the I/O engine's threads (IOEngine.encode_records): each record is
copied into the staging chunk and its data CRC computed over the bytes the copy just
brought into cache, so Python only packs the 256-byte heads.
"""
from __future__ import annotations

import os
import queue
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

__all__ = ["write_segment", "commit_pending", "ChunkWriter"]

# One writer thread issues the chunk writes one after the other while the caller encodes
# the next chunks: on the 2-core development VM (O_DIRECT on ext4) one sequential stream of
# 1 MiB writes was the fastest raw method, and two or four writes in flight on one file were
# 10-30% slower (ext4 serialises writes that extend a file; bench/bench_cache.py and a probe
# of 1/2/4 writes in flight). The encoder runs up to 8 chunks ahead: on a shared machine
# the encoding thread is sometimes descheduled for milliseconds, and the queue keeps the
# disk busy meanwhile. Every staging chunk (header and footer included) fits one 1 MiB
# staging buffer, so the store's buffer pool is reused, never reallocated.
_WRITE_CHUNK = 1 << 20  # staging chunk: encoded while the ones before are written
_IN_FLIGHT = 8          # chunks encoded ahead of the writer (queued or being written)
_WRITER_THREADS = 1
STAGING_CHUNKS = _IN_FLIGHT + 1  # staging buffers one segment cycles through (the store keeps them)


class _Layout:
    """Where a segment's records go and what its footer says, as arrays (one Python step
    per record at most: a commit of 64K-token prefixes holds thousands of records)."""

    __slots__ = ("n", "offsets", "padded", "entries", "keys", "heads")

    def __init__(self, n: int):
        self.n = n
        self.entries = np.zeros(n, dtype=sf.FOOTER_DTYPE)
        self.keys: list[bytes] = []
        self.heads: bytes = b""  # new records: their unsealed 256-byte heads, back to back

    def place(self, padded: np.ndarray) -> None:
        self.padded = padded.tolist()
        ends = sf.PAGE + np.cumsum(padded, dtype=np.int64)
        self.offsets = (ends - padded).tolist()
        self.entries["offset"] = ends - padded

    @classmethod
    def for_new(cls, records: list, created: int, block_tokens: int, block_bytes: int) -> "_Layout":
        lay = cls(len(records))
        key_ix: dict[bytes, int] = {}
        kis = [key_ix.setdefault(p.key, len(key_ix)) for p in records]
        lay.keys = list(key_ix)
        klen = np.array([len(k) for k in lay.keys], dtype=np.int64)[np.array(kis, dtype=np.int64)]
        block_hashes = [p.block_hash for p in records]
        heads = sf.pack_record_headers(
            record_ids=[p.rid for p in records], parent_ids=[p.parent for p in records], created_ns=created,
            block_indices=[p.block_index for p in records], token_count=block_tokens, key_bytes=klen,
            payload_bytes=block_bytes, block_hashes=block_hashes, parent_hashes=[p.parent_hash for p in records])
        rbytes = heads["record_bytes"].astype(np.int64)
        lay.place((rbytes + sf.PAGE - 1) // sf.PAGE * sf.PAGE)
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
        lay.place(np.array([r.padded for r, _, _ in raw], dtype=np.int64))
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
        """(first, end, record bytes) of the segment's chunk writes: runs of records that
        fit `limit` bytes (a record larger than that gets a chunk of its own) with the
        header page counted in the first chunk and `tail` (footer and trailer) in the
        last; the tail gets a chunk of its own (first == end) when it does not fit."""
        out, first, size = [], 0, sf.PAGE
        for i, n in enumerate(self.padded):
            if i > first and size + n > limit:
                out.append((first, i, size))
                first, size = i, 0
            size += n
        if size + tail > limit and self.n:
            out.append((first, self.n, size))
            first, size = self.n, 0
        out.append((first, self.n, size))
        # Sizes above count the header page in the first chunk: report record bytes only.
        f0, e0, s0 = out[0]
        out[0] = (f0, e0, s0 - sf.PAGE)
        return out


def write_segment(store: PersistentStore, records: list, supersedes: list[bytes], raw: list | None = None) -> int:
    """Writes one segment holding `records` (pending records to encode) or `raw` (already
    encoded records, copied verbatim by compaction: list of (rec, view, offset)). Returns
    the file size. On failure nothing is left behind and OSError is raised."""
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
    footer_off = sf.PAGE + sum(lay.padded)
    fpad = _io.align_up(len(footer))
    tail_size = fpad + sf.PAGE
    trailer = sf.encode_trailer(sf.SegmentTrailer(uuid, footer_off, len(footer), lay.n, _io.crc32c(footer)))
    header = sf.encode_segment_header(sf.SegmentHeader(uuid, seq, time.time_ns(), store.identity.store_id,
                                                       lay.n, list(supersedes)))
    chunks = lay.chunks(_WRITE_CHUNK, tail_size)
    f = store._eng.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, direct=store.direct)
    published = False
    in_flight: list = []  # (job, staging item) of the chunks being written, oldest first
    try:
        seg = SegmentFile(uuid, seq, name, 0)
        heads = lay.heads
        offset = 0  # file offset of this chunk's write
        for ci, (first, end, size) in enumerate(chunks):
            lead = sf.PAGE if ci == 0 else 0  # the segment header
            trail = tail_size if ci == len(chunks) - 1 else 0  # footer and trailer
            total = lead + size + trail
            # Encode this chunk while the ones before are being written.
            item = store._get_staging(total)
            buf, view = item
            try:
                if lead:
                    view[: sf.PAGE] = np.frombuffer(header, dtype=np.uint8)
                if raw is not None:
                    for i in range(first, end):
                        rec, src_view, src_off = raw[i]
                        at = lay.offsets[i] - offset
                        view[at: at + rec.padded] = src_view[src_off: src_off + rec.padded]
                elif end > first:
                    base = offset
                    store._eng.encode_records(buf, [
                        (lay.offsets[i] - base, heads[i * 256: i * 256 + 256], p.tokens, p.key, p.payload)
                        for i, p in zip(range(first, end), records[first:end])])
                store._hook("write")
                if trail:
                    at = lead + size
                    view[at: at + tail_size] = 0
                    view[at: at + len(footer)] = np.frombuffer(footer, dtype=np.uint8)
                    view[at + fpad: at + tail_size] = np.frombuffer(trailer, dtype=np.uint8)
                    store._hook("footer")
                fut = store._chunk_writer.submit(store._eng.write_all, f.fd, offset, buf, 0, total, str(tmp))
            except BaseException:
                store._put_staging(item)
                raise
            in_flight.append((fut, item))
            if len(in_flight) > _IN_FLIGHT:
                _retire(store, in_flight)
            offset += total
        # The index entries are built while the last chunks are being written.
        new_recs = _stored_records(store, lay, seg, [r.hash for r, _, _ in raw] if raw is not None
                                   else [p.block_hash for p in records])
        while in_flight:
            _retire(store, in_flight)
        file_bytes = footer_off + tail_size
        if store.durability == "fsync":
            store._hook("fsync")
            store._eng.fsync(f.fd, str(tmp))
        os.close(f.fd)
        f.fd = -1
        store._hook("rename")
        os.rename(tmp, store.path / name)
        published = True
        if store.durability == "fsync":
            _files.fsync_dir(store.path)
        store._hook("published")
    except BaseException:
        for job, item in in_flight:  # let the writes finish before their fd is closed
            try:
                job.result()
            except BaseException:
                pass
            store._put_staging(item)
        if f.fd >= 0:
            os.close(f.fd)
        if not published:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    seg.file_bytes = file_bytes
    with store._lock:
        store._segs[uuid] = seg
        if raw is None:
            store._ix.add_many(new_recs)  # fresh record ids: none is indexed yet
        else:
            for r in new_recs:
                old = store._ix.recs.get(r.rid)
                if old is None:
                    continue  # deleted while being copied: stays deleted
                store._ix.remove(old)
                r.atime_ns = old.atime_ns
                store._ix.add(r)
    return file_bytes


def _stored_records(store: PersistentStore, lay: _Layout, seg: SegmentFile, hashes: list[bytes]) -> list[StoredRecord]:
    """The index entries of a segment's records (added once it is published)."""
    with store._lock:
        kid = [store._ix.key_id(k) for k in lay.keys]
    e = lay.entries
    created = e["created_ns"].tolist()
    return [StoredRecord(rid, parent, seg, off, padded, bi, c, kid[ki], h)
            for rid, parent, off, padded, bi, c, ki, h in zip(
                e["record_id"].tolist(), e["parent_id"].tolist(), lay.offsets, lay.padded,
                e["block_index"].tolist(), created, e["key_index"].tolist(), hashes)]


def _retire(store: PersistentStore, in_flight: list) -> None:
    """Waits for the oldest chunk write (raising its error) and recycles its staging."""
    job, item = in_flight.pop(0)
    try:
        job.result()
    finally:
        store._put_staging(item)


class ChunkWriter:
    """A store's writer thread(s): they write the queued chunks in order while the caller
    encodes the next. Plain daemon threads, not concurrent.futures: that refuses new
    work once interpreter shutdown has begun, and a cache commits its queued writes at exit.
    Threads that are gone (a forked child inherits none) are started again."""

    def __init__(self, threads: int = _WRITER_THREADS):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._n = threads
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Starts the threads that are not running (a writable store does at open, so its
        first commit does not wait for a thread to start)."""
        self._threads = [t for t in self._threads if t.is_alive()]
        while len(self._threads) < self._n:
            t = threading.Thread(target=self._run, name="dsv41-store-write", daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, fn, *args) -> "_Job":
        self.start()  # after a fork the child has none
        job = _Job()
        self._q.put((job, fn, args))
        return job

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, fn, args = item
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to result()
                job.error = e
            job.done.set()

    def stop(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join()
        self._threads = []


class _Job:
    __slots__ = ("done", "error")

    def __init__(self):
        self.done = threading.Event()
        self.error: BaseException | None = None

    def result(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


def _commit_result() -> CommitResult:
    from .store import CommitResult
    return CommitResult()


def commit_pending(store: PersistentStore, pending: list[PendingRecord]) -> CommitResult:
    """Writes records taken from the queue (PersistentStore.commit holds the write lock):
    segments of at most segment_bytes, parents before children, each published on its
    own. An I/O error degrades the tier: the rest is dropped, nothing is raised."""
    res = _commit_result()
    if not pending:
        return res
    if store.degraded:
        res.dropped = [p.rid for p in pending]
        res.error = store.degraded_reason
        store.metrics.persist_failures.inc(cause="degraded")
        return res
    t0 = time.perf_counter()
    groups, cur, cur_bytes = [], [], sf.PAGE * 3
    T, P = store.identity.block_tokens, store.identity.block_bytes
    padded_of: dict[int, int] = {}  # key length -> padded record bytes (put() fixed T and P)
    for p in pending:
        padded = padded_of.get(len(p.key))
        if padded is None:
            padded = padded_of[len(p.key)] = sf.record_geometry(T, len(p.key), P)[2]
        if cur and cur_bytes + padded + 128 > store.segment_bytes:
            groups.append(cur)
            cur, cur_bytes = [], sf.PAGE * 3
        cur.append(p)
        cur_bytes += padded + 128
    groups.append(cur)
    failed_at = None
    for gi, g in enumerate(groups):
        # A record whose parent is gone (dropped, or deleted since put) cannot be
        # stored: the store holds whole prefixes only. Parents come before children.
        alive, ok_rids = [], set()
        with store._lock:
            for p in g:
                if not p.parent or p.parent in store._ix.recs or p.parent in ok_rids:
                    alive.append(p)
                    ok_rids.add(p.rid)
                else:
                    res.dropped.append(p.rid)
        if not alive:
            continue
        try:
            res.bytes_written += write_segment(store, alive, supersedes=[])
            res.persisted += [p.rid for p in alive]
        except OSError as e:
            failed_at = gi
            res.dropped += [p.rid for p in alive]
            store._degrade(e)
            res.error = store.degraded_reason
            break
    if failed_at is not None:
        for g in groups[failed_at + 1:]:
            res.dropped += [p.rid for p in g]
    store.metrics.ssd_commit_seconds.observe(time.perf_counter() - t0)
    store.metrics.bytes_written.inc(res.bytes_written, tier="ssd")
    store.metrics.inserted_blocks.inc(len(res.persisted), tier="ssd")
    store._journal.flush()
    if store.capacity_bytes is not None and store.file_bytes() > store.capacity_bytes:
        store.gc()
    store._update_gauges()
    return res
