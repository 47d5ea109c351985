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

# Small chunks keep encoding and writing overlapped: with bench/bench_cache.py on the 2-core
# dev machine 1 MiB chunks wrote faster than 4 and 16 MiB ones (noisy, but every time).
_WRITE_CHUNK = 1 << 20  # staging chunk: encoded while the ones before are written
_IN_FLIGHT = 2          # chunk writes in flight while the next chunk is encoded


def write_segment(store: PersistentStore, records: list, supersedes: list[bytes], raw: list | None = None) -> int:
    """Writes one segment holding `records` (pending records to encode) or `raw` (already
    encoded records, copied verbatim by compaction: list of (rec, view, offset)). Returns
    the file size. On failure nothing is left behind and OSError is raised."""
    seq, uuid = store._next_seq, os.urandom(16)
    store._next_seq += 1
    name = sf.segment_name(seq, uuid)
    tmp = store.path / f".tmp-{name}"
    f = store._eng.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, direct=store.direct)
    published = False
    in_flight: list = []  # (job, staging item) of the chunks being written, oldest first
    try:
        seg = SegmentFile(uuid, seq, name, 0)
        rows, keys, key_ix = [], [], {}
        offset = sf.PAGE
        created = store._now_ns()  # one time for the whole batch: LRU sees its chains as one age
        items = raw if raw is not None else records
        pos = 0
        while pos < len(items):
            # One staging chunk of records at a time.
            chunk, size = [], 0
            while pos < len(items):
                it = items[pos]
                padded = it[0].padded if raw is not None else \
                    sf.record_geometry(it.tokens.size, len(it.key), it.payload.size)[2]
                if chunk and size + padded > _WRITE_CHUNK:
                    break
                chunk.append(it)
                size += padded
                pos += 1
            # Encode this chunk while the previous one is being written (double buffering).
            item = store._get_staging(size)
            buf, view = item
            try:
                at, specs = 0, []
                for it in chunk:
                    if raw is not None:
                        rec, src_view, src_off = it
                        view[at: at + rec.padded] = src_view[src_off: src_off + rec.padded]
                        key = store._ix.keys[rec.key_id]
                        ki = key_ix.setdefault(key, len(keys))
                        if ki == len(keys):
                            keys.append(key)
                        rows.append((rec.rid, rec.parent, offset + at, rec.created_ns, rec.padded,
                                     rec.block_index, ki, rec.hash, _record_bytes(view, at)))
                        at += rec.padded
                    else:
                        at = _head(it, at, offset, specs, rows, keys, key_ix, created)
                if specs:
                    store._eng.encode_records(buf, specs)
                store._hook("write")
                fut = store._chunk_writer.submit(store._eng.write_all, f.fd, offset, buf, 0, size, str(tmp))
            except BaseException:
                store._put_staging(item)
                raise
            in_flight.append((fut, item))
            if len(in_flight) > _IN_FLIGHT:
                _retire(store, in_flight)
            offset += size
        while in_flight:
            _retire(store, in_flight)
        # Footer and trailer.
        T = store.identity.block_tokens
        entries = np.array([(rid, parent, off, created, rbytes, bi, ki, T, len(h), b"", h.ljust(32, b"\0"))
                            for rid, parent, off, created, padded, bi, ki, h, rbytes in rows],
                           dtype=sf.FOOTER_DTYPE).reshape(len(rows))
        footer = sf.encode_footer(entries, keys)
        footer_off = offset
        fpad = _io.align_up(len(footer))
        trailer = sf.encode_trailer(sf.SegmentTrailer(uuid, footer_off, len(footer), len(rows),
                                                      _io.crc32c(footer)))
        header = sf.encode_segment_header(sf.SegmentHeader(uuid, seq, time.time_ns(), store.identity.store_id,
                                                           len(rows), list(supersedes)))
        tail_size = fpad + sf.PAGE
        item = store._get_staging(tail_size)
        buf, view = item
        try:
            view[:tail_size] = 0
            view[: len(footer)] = np.frombuffer(footer, dtype=np.uint8)
            view[fpad: fpad + sf.PAGE] = np.frombuffer(trailer, dtype=np.uint8)
            store._hook("footer")
            store._eng.write_all(f.fd, footer_off, buf, 0, tail_size, str(tmp))
            view[: sf.PAGE] = np.frombuffer(header, dtype=np.uint8)
            store._eng.write_all(f.fd, 0, buf, 0, sf.PAGE, str(tmp))
        finally:
            store._put_staging(item)
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
        for rid, parent, off, created, padded, bi, ki, h, rbytes in rows:
            old = store._ix.recs.get(rid)
            if raw is not None and old is None:
                continue  # deleted while being copied: stays deleted
            if old is not None:
                store._ix.remove(old)
                atime = old.atime_ns
            else:
                atime = None
            r = StoredRecord(rid, parent, seg, off, padded, bi, created, store._ix.key_id(keys[ki]), h)
            if atime is not None:
                r.atime_ns = atime
            store._ix.add(r)
    return file_bytes


def _retire(store: PersistentStore, in_flight: list) -> None:
    """Waits for the oldest chunk write (raising its error) and recycles its staging."""
    job, item = in_flight.pop(0)
    try:
        job.result()
    finally:
        store._put_staging(item)


def _record_bytes(view: np.ndarray, at: int) -> int:
    return int(view[at: at + sf.REC_HEADER_BYTES].view(sf.REC_DTYPE)[0]["record_bytes"])


def _head(p: PendingRecord, at: int, file_off: int, specs: list, rows, keys, key_ix, created: int) -> int:
    """Packs one record's head and queues it for encode_records (which writes token ids,
    key, payload and padding and fills both CRCs)."""
    T, K, P = p.tokens.size, len(p.key), p.payload.size
    po, rbytes, padded = sf.record_geometry(T, K, P)
    head = sf.pack_record_header(record_id=p.rid, parent_id=p.parent, created_ns=created,
                                 block_index=p.block_index, token_count=T, key_bytes=K, payload_offset=po,
                                 payload_bytes=P, record_bytes=rbytes, block_hash=p.block_hash,
                                 parent_hash=p.parent_hash, sealed=False)
    specs.append((at, head, p.tokens, p.key, p.payload))
    ki = key_ix.setdefault(p.key, len(keys))
    if ki == len(keys):
        keys.append(p.key)
    rows.append((p.rid, p.parent, file_off + at, created, padded, p.block_index, ki, p.block_hash, rbytes))
    return at + padded


class ChunkWriter:
    """A store's writer threads (one per write in flight): they write chunks while the
    caller encodes the next. Plain daemon threads, not concurrent.futures: that refuses new
    work once interpreter shutdown has begun, and a cache commits its queued writes at exit.
    Threads that are gone (a forked child inherits none) are started again."""

    def __init__(self, threads: int = _IN_FLIGHT):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._n = threads
        self._threads: list[threading.Thread] = []

    def submit(self, fn, *args) -> "_Job":
        self._threads = [t for t in self._threads if t.is_alive()]
        if len(self._threads) < self._n:
            t = threading.Thread(target=self._run, name="dsv41-store-write", daemon=True)
            t.start()
            self._threads.append(t)
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
    for p in pending:
        padded = sf.record_geometry(p.tokens.size, len(p.key), p.payload.size)[2]
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
