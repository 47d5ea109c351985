"""PersistentStore: the SSD tier. Global KV + indexer keys per block, nothing else.

Design (docs/cache.md has the full story and store_format.py the bytes):

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

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import io as _io
from . import store_format as sf
from .errors import MissingParentError, StoreError, StoreLockedError, StoreMismatchError, StoreReadOnlyError
from .metrics import CacheMetrics
from .store import files as _files

__all__ = ["PersistentStore", "StoreIdentity", "CommitResult", "DURABILITY"]

log = logging.getLogger("dsv41.cache.persistent")

DURABILITY = ("fsync", "none")
DEFAULT_TTL_S = 72 * 3600.0
DEFAULT_SEGMENT_BYTES = 128 << 20
_WRITE_CHUNK = 4 << 20
_READ_BATCH = 64 << 20
_GROUP_BYTES = 512 << 10  # contiguous records read by one op (several ops keep every I/O thread busy)
_RECORD_STATUS = _io.RECORD_STATUS  # "ok", "truncated", "header", "checksum", "collision"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass(frozen=True)
class StoreIdentity:
    """What must match between a store directory and the process that opens it."""

    model_fingerprint: str
    layout_fingerprint: str
    block_tokens: int
    block_bytes: int
    payload_format_version: int
    hash_name: str
    digest_bytes: int
    store_format_version: int = sf.STORE_FORMAT_VERSION

    @property
    def store_id(self) -> bytes:
        import hashlib
        canon = json.dumps(self.__dict__, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canon).digest()


@dataclass
class CommitResult:
    persisted: list[int] = field(default_factory=list)  # record ids now durable and visible
    dropped: list[int] = field(default_factory=list)    # record ids that were not persisted
    bytes_written: int = 0
    error: str | None = None


class _Seg:
    __slots__ = ("uuid", "seq", "name", "file_bytes", "live_bytes", "rids", "fd", "direct", "damaged")

    def __init__(self, uuid: bytes, seq: int, name: str, file_bytes: int):
        self.uuid, self.seq, self.name, self.file_bytes = uuid, seq, name, file_bytes
        self.live_bytes = 0
        self.rids: set[int] = set()
        self.fd: int | None = None
        self.direct = False
        self.damaged = False  # footer unusable: indexed by scanning record headers


class _Rec:
    __slots__ = ("rid", "parent", "seg", "offset", "padded", "block_index", "created_ns", "atime_ns",
                 "key_id", "hash")

    def __init__(self, rid, parent, seg, offset, padded, block_index, created_ns, key_id, hash_):
        self.rid, self.parent, self.seg, self.offset, self.padded = rid, parent, seg, offset, padded
        self.block_index, self.created_ns, self.atime_ns = block_index, created_ns, created_ns
        self.key_id, self.hash = key_id, hash_


class _Pending:
    __slots__ = ("rid", "parent", "block_index", "block_hash", "parent_hash", "tokens", "key", "payload")

    def __init__(self, rid, parent, block_index, block_hash, parent_hash, tokens, key, payload):
        self.rid, self.parent, self.block_index = rid, parent, block_index
        self.block_hash, self.parent_hash, self.tokens, self.key, self.payload = \
            block_hash, parent_hash, tokens, key, payload


def _as_bytes_view(payload) -> np.ndarray:
    if isinstance(payload, torch.Tensor):
        if payload.device.type != "cpu":
            payload = payload.cpu()
        return payload.contiguous().view(torch.uint8).reshape(-1).numpy()
    return np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)


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
        self._lock_fd: int | None = None
        self._journal_fd: int | None = None
        self._journal_pos = 0
        self._journal_buf: list[bytes] = []
        self._segs: dict[bytes, _Seg] = {}
        self._recs: dict[int, _Rec] = {}
        self._live_total = 0
        self._children: dict[tuple[int, bytes], list[int]] = {}
        self._kids: dict[int, set[int]] = {}
        self._keys: list[bytes] = []
        self._key_ids: dict[bytes, int] = {}
        self._pending: list[_Pending] = []
        self._pending_rids: set[int] = set()
        self._colliding: set[int] = set()  # record ids found in two segments with different contents
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
        self._write_pool = None
        self._gds_files: dict[bytes, object] = {}

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
            # A store of another model opened as an empty tier is left exactly as it is: no
            # writer lock (its rightful writer may hold it), no recovery, no journal.
            self.identity = self._open_manifest(identity, on_mismatch, locked=False)
            if self.mismatch is None and mode == "w":
                self._take_lock()
                self.identity = self._open_manifest(identity, on_mismatch, locked=True)
            if self.mismatch is None:
                self._recover()
        except BaseException:
            self._release_lock()
            raise
        self.recovery_seconds = time.perf_counter() - t0
        self.metrics.recovery_seconds.set(self.recovery_seconds)
        self._update_gauges()

    # ---- opening ------------------------------------------------------------------------

    def _take_lock(self) -> None:
        lock_path = self.path / sf.LOCK_NAME
        try:
            fd = _files.open_regular(lock_path, os.O_RDWR | os.O_CREAT)
        except _files.NotRegularFileError:
            raise
        except OSError as e:
            raise StoreError(e.errno, f"cannot open the persistent store {self.path} for writing "
                             f"({e.strerror}): a read-only filesystem or directory needs mode='r'",
                             str(lock_path)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise StoreLockedError(
                errno.EBUSY, f"persistent store {self.path} is already open for writing by "
                f"{owner}; one writer per directory: open it read-only (mode='r') or stop that process",
                str(lock_path)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    def _open_manifest(self, identity: StoreIdentity | None, on_mismatch: str, locked: bool) -> StoreIdentity | None:
        """The store's identity from its manifest, checked against `identity`. Before the
        writer lock (locked False) a missing manifest returns None: it is created under
        the lock."""
        mpath = self.path / sf.MANIFEST_NAME
        try:
            fd = _files.open_regular(mpath, os.O_RDONLY)
        except FileNotFoundError:
            fd = None
        if fd is None:
            if self.mode != "w":
                raise StoreError(errno.ENOENT, f"{self.path} is not a dsv41 persistent store "
                                 f"(no {sf.MANIFEST_NAME})")
            if any(sf.parse_segment_name(n) for n in os.listdir(self.path)):
                raise StoreError(errno.EINVAL, f"{self.path} has segment files but no "
                                 f"{sf.MANIFEST_NAME}: refusing to guess which model wrote them")
            if identity is None:
                raise StoreError(errno.EINVAL, f"{self.path} is not a dsv41 persistent store (no "
                                 f"{sf.MANIFEST_NAME}); creating one needs the model's identity")
            if not locked:
                return None  # created under the writer lock
            self._write_manifest(identity)
            return identity
        try:
            with os.fdopen(fd, "rb") as f:
                text = f.read(1 << 20)
            fields = json.loads(text)
            if not isinstance(fields, dict):
                raise ValueError("not a JSON object")
            if fields.get("checksum") != sf.manifest_checksum(fields):
                raise ValueError("checksum mismatch")
            found = StoreIdentity(**{k: fields[k] for k in StoreIdentity.__dataclass_fields__})
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise StoreError(errno.EINVAL, f"{mpath} is damaged or not a dsv41 manifest ({e})") from None
        if found.store_format_version != sf.STORE_FORMAT_VERSION:
            problem = (f"store format version {found.store_format_version}, this dsv41 reads "
                       f"version {sf.STORE_FORMAT_VERSION}")
        elif identity is not None and identity != found:
            diffs = [f"{k}: store has {getattr(found, k)!r}, this process {getattr(identity, k)!r}"
                     for k in StoreIdentity.__dataclass_fields__ if getattr(found, k) != getattr(identity, k)]
            problem = "; ".join(diffs)
        else:
            return found
        msg = (f"persistent store {self.path} belongs to another model, layout or format ({problem}). "
               f"Point the cache at another directory, or open it as an empty tier "
               f"(on_mismatch='empty'); its entries are never mixed with this model's")
        if on_mismatch == "error":
            raise StoreMismatchError(errno.EINVAL, msg)
        if locked:
            return found  # already warned before the lock
        warnings.warn(msg + " -- opened as an empty, read-only tier", stacklevel=3)
        self.mismatch = problem
        return identity if identity is not None else found

    def _write_manifest(self, identity: StoreIdentity) -> None:
        fields = dict(identity.__dict__)
        fields.update(magic="dsv41-persistent-prefix-store",
                      created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        fields["checksum"] = sf.manifest_checksum(fields)
        tmp = self.path / (sf.MANIFEST_NAME + ".tmp")
        with os.fdopen(_files.create_exclusive(tmp), "w") as f:
            json.dump(fields, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / sf.MANIFEST_NAME)
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        _files.fsync_dir(self.path)

    # ---- recovery -----------------------------------------------------------------------

    def _recover(self) -> None:
        names = sorted(os.listdir(self.path))
        if self.mode == "w":
            for n in names:
                if n.startswith(".tmp-"):  # a commit or compaction cut short by a crash
                    try:
                        _files.unlink_if_present(self.path / n)
                        self.counts["torn_temp_files"] += 1
                    except _files.NotRegularFileError as e:
                        self._unusable(n, e)
        loaded = []
        for n in names:
            parsed = sf.parse_segment_name(n)
            if parsed is None:
                continue
            seg_info = self._load_segment(n, *parsed)
            if seg_info is not None:
                loaded.append(seg_info)
        superseded = {u for (_, hdr, _) in loaded for u in hdr.supersedes}
        rec_rows = []
        for seg, hdr, rows in sorted(loaded, key=lambda x: x[0].seq):
            self._next_seq = max(self._next_seq, seg.seq + 1)
            if seg.uuid in superseded:
                # A compaction published its replacement but died before unlinking this one.
                self.counts["superseded_segments"] += 1
                if self.mode == "w":
                    _files.unlink_if_present(self.path / seg.name)
                continue
            self._segs[seg.uuid] = seg
            rec_rows.append((seg, hdr, rows))
        max_rid = 0
        for seg, hdr, rows in rec_rows:
            max_rid = max([max_rid] + [r.rid for r in rows])
            self._add_rows(rows)
        deleted = self._replay_journal()
        for rid in deleted:
            r = self._recs.get(rid)
            if r is not None:
                self._unindex(r)
        # Records whose parent is gone can never be reached: drop them, parents first.
        orphans = []
        for r in sorted(self._recs.values(), key=lambda r: r.block_index):
            if r.parent and r.parent not in self._recs:
                orphans.append(r.rid)
                self._unindex(r)
        self.counts["orphans_dropped"] = len(orphans)
        if self.mode == "w":
            now = self._now_ns()
            for rid in orphans:
                self._journal_buf.append(sf.encode_journal(sf.J_DELETE, rid, now))
            self._flush_journal()
        self._next_rid = max(self._next_rid, max_rid + 1)
        self.counts["recovered_records"] = len(self._recs)
        self.counts["recovered_segments"] = len(self._segs)

    def _add_rows(self, rows: list[_Rec]) -> None:
        """Indexes one segment's records (recovery and refresh). A record id that is
        already indexed is either the same record twice (identical identity: only a
        damaged supersedes list causes that; the newer copy is kept) or two records that
        share an id: two stores merged into one directory. Then neither copy can be
        trusted (a chain could continue into the other store's records): both are
        dropped, and so is any later record with that id; their children become orphans."""
        for r in rows:
            if r.rid in self._colliding:
                self.counts["colliding_records"] += 1
                continue
            old = self._recs.get(r.rid)
            if old is not None:
                if (old.parent, old.hash, old.block_index, old.key_id) == (r.parent, r.hash, r.block_index,
                                                                          r.key_id) and old.seg is not r.seg:
                    self.counts["duplicate_records"] += 1
                    if old.seg.seq > r.seg.seq:
                        continue
                    self._unindex(old)
                else:
                    log.warning("record id %d is in %s and %s with different contents (two stores merged "
                                "into one directory?): neither copy is used", r.rid, old.seg.name, r.seg.name)
                    self._colliding.add(r.rid)
                    self.counts["colliding_records"] += 2
                    self._unindex(old)
                    continue
            self._index(r)

    def _read_exact(self, fd: int, offset: int, length: int) -> bytes:
        out = bytearray()
        while len(out) < length:
            chunk = os.pread(fd, length - len(out), offset + len(out))
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def _load_segment(self, name: str, seq: int, uuid: bytes):
        path = self.path / name
        try:
            fd = _files.open_regular(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except _files.NotRegularFileError as e:
            self._unusable(name, e)
            return None
        try:
            size = os.fstat(fd).st_size
            seg = _Seg(uuid, seq, name, size)
            try:
                hdr = sf.decode_segment_header(self._read_exact(fd, 0, sf.PAGE))
            except sf.FormatError as e:
                hdr = None
                why = str(e)
            if hdr is not None and (hdr.uuid != uuid or hdr.seq != seq):
                hdr, why = None, "segment header does not match the file name"
            if hdr is not None and hdr.store_id != self.identity.store_id:
                self.counts["foreign_segments"] += 1
                log.warning("%s: segment from another store, ignored", path)
                return None
            rows = None
            if hdr is not None:
                try:
                    rows = self._rows_from_footer(fd, size, seg, hdr)
                except sf.FormatError as e:
                    why = str(e)
            if rows is None:
                # Damaged header or footer: scan record headers. Only media damage or outside
                # tampering gets here; segments are published whole by rename.
                log.warning("%s: %s; scanning its records", path, why)
                seg.damaged = True
                self.counts["damaged_segments"] += 1
                rows = self._rows_from_scan(fd, size, seg)
                if hdr is None:
                    hdr = sf.SegmentHeader(uuid, seq, 0, self.identity.store_id, len(rows), [])
            return seg, hdr, rows
        finally:
            os.close(fd)

    def _key_id(self, key: bytes) -> int:
        kid = self._key_ids.get(key)
        if kid is None:
            kid = self._key_ids[key] = len(self._keys)
            self._keys.append(key)
        return kid

    def _rows_from_footer(self, fd: int, size: int, seg: _Seg, hdr) -> list[_Rec]:
        if size < 2 * sf.PAGE or size % sf.PAGE:
            raise sf.FormatError(f"size {size} is not a whole number of pages")
        trailer = sf.decode_trailer(self._read_exact(fd, size - sf.PAGE, sf.PAGE))
        if trailer.uuid != seg.uuid:
            raise sf.FormatError("trailer belongs to another segment")
        if trailer.footer_offset + trailer.footer_bytes > size - sf.PAGE:
            raise sf.FormatError("footer lies outside the file")
        data = self._read_exact(fd, trailer.footer_offset, trailer.footer_bytes)
        if _io.crc32c(data) != trailer.footer_crc:
            raise sf.FormatError("footer checksum mismatch")
        entries, keys = sf.decode_footer(data)
        if len(entries) != trailer.record_count or len(entries) != hdr.record_count:
            raise sf.FormatError("footer record count disagrees with header/trailer")
        if any(len(k) > sf.MAX_KEY_BYTES for k in keys):
            raise sf.FormatError("footer: a key longer than any cache key")
        key_ids = [self._key_id(k) for k in keys]
        T, P = self.identity.block_tokens, self.identity.block_bytes
        rows = []
        for e in entries:
            off, rbytes = int(e["offset"]), int(e["record_bytes"])
            padded = _io.align_up(rbytes)
            if off % sf.PAGE or off < sf.PAGE or off + padded > trailer.footer_offset:
                raise sf.FormatError("footer entry points outside the record area")
            kb = len(keys[int(e["key_index"])])
            if int(e["token_count"]) != T or rbytes != sf.record_geometry(T, kb, P)[1]:
                raise sf.FormatError("footer entry's token count or size does not fit this store's blocks")
            if not sf.valid_record_id(int(e["record_id"])) or int(e["parent_id"]) > sf.MAX_RECORD_ID:
                raise sf.FormatError("footer entry has a record id out of range")
            hb = int(e["hash_bytes"])
            rows.append(_Rec(int(e["record_id"]), int(e["parent_id"]), seg, off, padded,
                             int(e["block_index"]), int(e["created_ns"]), key_ids[int(e["key_index"])],
                             bytes(e["block_hash"])[:hb]))
        return rows

    def _rows_from_scan(self, fd: int, size: int, seg: _Seg) -> list[_Rec]:
        rows = []
        off = sf.PAGE
        while off + sf.PAGE <= size:
            page = self._read_exact(fd, off, sf.PAGE)
            h = np.frombuffer(page[: sf.REC_HEADER_BYTES], dtype=sf.REC_DTYPE)[0]
            ok = (h["magic"] == sf.REC_MAGIC and int(h["version"]) == sf.STORE_FORMAT_VERSION
                  and _io.crc32c(page[:252]) == int(h["header_crc"]))
            if not ok:
                off += sf.PAGE  # resynchronise on the next page
                continue
            rbytes, kb, tc = int(h["record_bytes"]), int(h["key_bytes"]), int(h["token_count"])
            # Every field is bounded before it sizes a read: a crafted header with a valid
            # CRC must not make recovery read gigabytes.
            T, P = self.identity.block_tokens, self.identity.block_bytes
            if (tc != T or kb > sf.MAX_KEY_BYTES or int(h["payload_bytes"]) != P
                    or rbytes != sf.record_geometry(T, kb, P)[1] or not sf.valid_record_id(int(h["record_id"]))
                    or int(h["parent_id"]) > sf.MAX_RECORD_ID):
                off += sf.PAGE
                continue
            padded = _io.align_up(rbytes)
            if off + padded > size:
                break  # truncated: the reads would come up short, so it is not indexed
            kstart = sf.REC_HEADER_BYTES + 4 * tc
            head = self._read_exact(fd, off, kstart + kb)
            key = head[kstart: kstart + kb]
            hb = int(h["hash_bytes"])
            rows.append(_Rec(int(h["record_id"]), int(h["parent_id"]), seg, off, padded,
                             int(h["block_index"]), int(h["created_ns"]), self._key_id(key),
                             bytes(h["block_hash"])[:hb]))
            off += padded
        return rows

    def _replay_journal(self) -> set[int]:
        jpath = self.path / sf.JOURNAL_NAME
        deleted: set[int] = set()
        flags = os.O_RDWR | os.O_CREAT if self.mode == "w" else os.O_RDONLY
        try:
            fd = _files.open_regular(jpath, flags)
        except FileNotFoundError:
            fd = None
        try:
            data = self._read_all(fd) if fd is not None else b""
            entries, valid = sf.decode_journal(data)
            self.counts["journal_torn_bytes"] = len(data) - valid
            self._apply_journal(entries, deleted)
            if self.mode == "w" and valid != len(data):
                os.ftruncate(fd, valid)  # drop the torn tail so new entries stay aligned
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        if self.mode == "w":
            self._journal_fd = fd
        elif fd is not None:
            os.close(fd)
        self._journal_pos = valid
        return deleted

    @staticmethod
    def _read_all(fd: int) -> bytes:
        parts = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    def _unusable(self, name: str, e: OSError) -> None:
        """A name in the store that cannot be one of its files (a link, FIFO, directory):
        skipped, counted, and reported by stats and verify."""
        self.counts["unusable_files"] += 1
        self.unusable.append(f"{name}: {e.strerror or e}")
        log.warning("%s", e.strerror or e)

    def _apply_journal(self, entries, deleted: set[int]) -> None:
        for kind, rid, t, aux in entries:
            if kind == sf.J_ACCESS:
                r = self._recs.get(rid)
                if r is not None and t > r.atime_ns:
                    r.atime_ns = t
            elif kind == sf.J_DELETE:
                deleted.add(rid)
            elif kind == sf.J_WATERMARK:
                self._next_rid = max(self._next_rid, rid)
                self._next_seq = max(self._next_seq, aux)
            self._next_rid = max(self._next_rid, rid + 1 if kind != sf.J_WATERMARK else rid)

    # ---- index --------------------------------------------------------------------------

    def _index(self, r: _Rec) -> None:
        self._recs[r.rid] = r
        self._children.setdefault((r.parent, r.hash), []).append(r.rid)
        if r.parent:
            self._kids.setdefault(r.parent, set()).add(r.rid)
        r.seg.rids.add(r.rid)
        r.seg.live_bytes += r.padded
        self._live_total += r.padded

    def _unindex(self, r: _Rec) -> None:
        self._recs.pop(r.rid, None)
        key = (r.parent, r.hash)
        lst = self._children.get(key)
        if lst is not None:
            try:
                lst.remove(r.rid)
            except ValueError:
                pass
            if not lst:
                del self._children[key]
        if r.parent:
            kids = self._kids.get(r.parent)
            if kids is not None:
                kids.discard(r.rid)
                if not kids:
                    del self._kids[r.parent]
        if r.rid in r.seg.rids:
            r.seg.rids.discard(r.rid)
            r.seg.live_bytes -= r.padded
            self._live_total -= r.padded

    def _delete(self, rid: int, cause: str) -> int:
        """Removes a record and every record below it; returns how many were removed."""
        with self._lock:
            r = self._recs.get(rid)
            if r is None:
                return 0
            stack, removed = [r], 0
            now = self._now_ns()
            while stack:
                cur = stack.pop()
                stack.extend(self._recs[k] for k in list(self._kids.get(cur.rid, ())) if k in self._recs)
                self._unindex(cur)
                removed += 1
                self.metrics.evictions.inc(tier="ssd", cause=cause if cur is r else "orphan")
                if self.mode == "w" and self.mismatch is None:
                    self._journal_buf.append(sf.encode_journal(sf.J_DELETE, cur.rid, now))
            return removed

    def _flush_journal(self) -> None:
        if self._journal_fd is None or not self._journal_buf:
            self._journal_buf.clear()
            return
        data = b"".join(self._journal_buf)
        self._journal_buf.clear()
        try:
            os.pwrite(self._journal_fd, data, self._journal_pos)
            self._journal_pos += len(data)
        except OSError as e:
            # The journal is advisory (access times, deletions GC would redo): losing an
            # append only makes GC less precise after a restart.
            log.warning("journal append failed (%s); continuing", e)

    def _expired(self, r: _Rec, now_ns: int) -> bool:
        return self.ttl_s is not None and now_ns - r.atime_ns > self.ttl_s * 1e9

    # ---- lookups and reads --------------------------------------------------------------

    @property
    def writable(self) -> bool:
        return self.mode == "w" and self.mismatch is None and not self.closed

    @property
    def layout_block_bytes(self) -> int:
        return self.identity.block_bytes

    def __len__(self) -> int:
        return len(self._recs)

    def __contains__(self, rid: int) -> bool:
        return rid in self._recs

    def _now_ns(self) -> int:
        return int(self.clock() * 1e9)

    def walk(self, key: bytes, hashes: list[bytes], parent: int = 0, exclude: set[int] | None = None) -> list[int]:
        """Record ids of the longest chain matching `hashes` below record `parent` (0: from a
        chain's first block, matched on `key`), by the in-memory index only: unverified."""
        out = []
        expired = []
        oldest = None if self.ttl_s is None else self._now_ns() - self.ttl_s * 1e9
        children, recs = self._children, self._recs
        with self._lock:
            kid = self._key_ids.get(key)
            if kid is None and parent == 0:
                return []
            for h in hashes:
                found = None
                for rid in children.get((parent, h), ()):
                    r = recs[rid]
                    if (exclude and rid in exclude) or (parent == 0 and r.key_id != kid):
                        continue
                    if oldest is not None and r.atime_ns < oldest:
                        expired.append(rid)
                        continue
                    found = r
                    break
                if found is None:
                    break
                out.append(found.rid)
                parent = found.rid
        if expired and self.writable:
            for rid in expired:
                self._delete(rid, "ttl")
        return out

    def _get_staging(self, size: int) -> tuple[_io.AlignedBuffer, np.ndarray]:
        with self._lock:
            for i, (buf, view) in enumerate(self._staging):
                if buf.size >= size:
                    return self._staging.pop(i)
        return _io.staging(max(size, 1 << 20))

    def _put_staging(self, item) -> None:
        with self._lock:
            if len(self._staging) < 4:
                self._staging.append(item)

    def _seg_fd(self, seg: _Seg) -> int:
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

    def _read_checked(self, recs: list, tokens: np.ndarray | None, key: bytes | None,
                      out: np.ndarray | None) -> tuple[list[str], tuple, dict[int, int]]:
        """Reads records (None entries are "missing") and checks each one in the I/O worker
        that read it (dsv41/record.h): header and data CRC, identity against the index,
        then token ids (row i of tokens) and key when given; verified payloads go to row i
        of out. Returns (statuses, the staging buffer item, record index -> its offset in
        the staging buffer). The caller must _put_staging(item)."""
        status = ["ok"] * len(recs)
        groups: list[list] = []  # [fd, file_offset, size, [record index, ...]]
        last_seg = None
        fds: dict[bytes, int | None] = {}
        with self._lock:
            for r in recs:
                if r is not None and r.seg.uuid not in fds:
                    try:
                        fds[r.seg.uuid] = self._seg_fd(r.seg)
                    except (FileNotFoundError, OSError):  # gone, or a link/FIFO in its place
                        fds[r.seg.uuid] = None
        for i, r in enumerate(recs):
            fd = None if r is None else fds[r.seg.uuid]
            if fd is None:
                status[i] = "missing"
                continue
            g = groups[-1] if groups else None
            # Records back to back in one segment (a chain written by one commit) share one
            # op of up to _GROUP_BYTES.
            if g is not None and last_seg is r.seg and g[1] + g[2] == r.offset and g[2] + r.padded <= _GROUP_BYTES:
                g[2] += r.padded
                g[3].append(i)
            else:
                groups.append([fd, r.offset, r.padded, [i]])
            last_seg = r.seg
        item = self._get_staging(sum(g[2] for g in groups))
        buf = item[0]
        ops, where, pos = [], {}, 0
        for g in groups:
            specs = []
            for i in g[3]:
                r = recs[i]
                rel = r.offset - g[1]
                where[i] = pos + rel
                specs.append((rel, r.padded, r.rid, r.parent, r.block_index, r.hash, i))
            ops.append((g[0], g[1], g[2], buf, pos, specs))
            pos += g[2]
        results = self._eng._eng.read_records(ops, tokens, key, None if out is None else out.reshape(-1),
                                              self.identity.block_bytes)
        for g, (done, err, codes) in zip(groups, results):
            for i, code in zip(g[3], codes):
                if code != 0 and err and code == 1:  # short because the read failed
                    status[i] = "missing" if err in (errno.ENOENT, errno.EBADF) else "io"
                else:
                    status[i] = _RECORD_STATUS[code]
        return status, item, where

    def read(self, rids: list[int], tokens: np.ndarray | None, key: bytes, out: np.ndarray | None) -> list[str]:
        """Reads and verifies records `rids` (one per row of `tokens`, uint32 [n, T]); copies
        the payload of each verified one into row i of `out` (uint8 [n, block_bytes]).

        Returns one status per record: "ok", "collision" (intact but another prefix: token
        ids or key differ), or the failure that removed it: "missing", "truncated",
        "header", "checksum", "io". With tokens None the token ids are not compared.
        """
        if not rids:
            return []
        t0 = time.perf_counter()
        P = self.identity.block_bytes
        if tokens is not None:
            tokens = np.ascontiguousarray(tokens, dtype="<u4")
            if tokens.ndim != 2 or tokens.shape[0] < len(rids):
                raise ValueError(f"tokens must be uint32 [{len(rids)}, T], got {tokens.shape}")
        if out is not None and (out.dtype != np.uint8 or out.size < len(rids) * P or not out.flags.c_contiguous):
            raise ValueError(f"out must be contiguous uint8 [{len(rids)}, {P}]")
        with self._lock:
            recs = [self._recs.get(rid) for rid in rids]
            self._active_reads += 1
        try:
            status, item, where = self._read_checked(recs, tokens, key, out)
            view = item[1]
            self._check_parents(recs, status, lambda i: view[where[i]: where[i] + sf.REC_HEADER_BYTES]
                                .view(sf.REC_DTYPE)[0])
            self._put_staging(item)
        finally:
            self._end_read()
        self._settle(rids, recs, status, t0)
        return status

    def _check_parents(self, recs: list, status: list[str], header: Callable[[int], np.void]) -> None:
        """Every read checks the link to the parent: the record's parent_hash (from its
        verified header, header(i)) must be the block hash of the record the index holds
        under its parent id. Ids alone are not enough: two stores merged into one
        directory reuse ids, and a chain must never continue into the other store's
        records. A mismatch is status "chain" (removed like corruption)."""
        with self._lock:
            for i, r in enumerate(recs):
                if status[i] != "ok" or r is None or not r.parent:
                    continue
                p = self._recs.get(r.parent)
                h = header(i)
                if p is None or bytes(h["parent_hash"])[: int(h["hash_bytes"])] != p.hash:
                    status[i] = "chain"

    def _settle(self, rids, recs, status, t0) -> None:
        """Counts a batch's outcome and removes what failed verification (never the
        collisions: those records are intact, just another prefix's)."""
        good_bytes = 0
        for i, st in enumerate(status):
            if st == "ok":
                good_bytes += self.identity.block_bytes
            elif st != "collision":
                with self._lock:
                    moved = recs[i] is not None and self._recs.get(rids[i]) is not recs[i]
                if moved:
                    continue  # compaction moved it while we read the old copy: just a miss
                self.metrics.checksum_failures.inc(kind=st)
                log.warning("persistent record %d failed verification (%s): removed, served as a miss",
                            rids[i], st)
                if self.writable:
                    self._delete(rids[i], "missing" if st == "missing" else "corruption")
                else:
                    with self._lock:
                        r = self._recs.get(rids[i])
                        if r is not None:
                            self._unindex(r)
            else:
                self.metrics.collisions.inc(tier="ssd")
        self.metrics.bytes_read.inc(good_bytes, tier="ssd")
        self.metrics.ssd_read_seconds.observe(time.perf_counter() - t0)

    # ---- reads into device memory (GPUDirect Storage) ------------------------------------

    @property
    def gds_available(self) -> bool:
        if self._gds_ok is None:
            self._gds_ok = bool(_io.io_info()["gds_available"])
        return self._gds_ok

    def _device_read(self, seg: _Seg, staging: torch.Tensor, size: int, file_off: int, dev_off: int) -> tuple[int, int]:
        """(bytes read, errno) of one read into `staging`: cuFile on a CUDA device, the
        engine's pread elsewhere (the CPU runs this path in the tests)."""
        path = self.path / seg.name
        if staging.device.type == "cuda":
            with self._lock:
                f = self._gds_files.get(seg.uuid)
                if f is None:
                    if not path.is_file() or path.is_symlink():
                        return 0, errno.ENOENT
                    try:
                        f = self._gds_files[seg.uuid] = _io._io.GdsFile(str(path), False)
                    except RuntimeError:
                        return 0, errno.ENOENT if not path.exists() else errno.EIO
            n = f.read(staging, size, file_off, dev_off)
            return (n, 0) if n >= 0 else (0, -n if -n < 5000 else errno.EIO)
        with self._lock:
            try:
                fd = self._seg_fd(seg)
            except OSError:
                return 0, errno.ENOENT
        [(done, err)] = self._eng.pread([(fd, file_off, size, staging.numpy(), dev_off)])
        return done, err

    def _device_crc(self, staging: torch.Tensor, ranges: list[tuple[int, int]]) -> list[int]:
        if not ranges:
            return []
        if staging.device.type == "cuda":
            off = torch.tensor([o for o, _ in ranges], dtype=torch.long, device=staging.device)
            ln = torch.tensor([n for _, n in ranges], dtype=torch.long, device=staging.device)
            return [c & 0xFFFFFFFF for c in _io._io.crc32c_device(staging, off, ln).cpu().tolist()]
        return self._eng.crc32c_many(staging.numpy(), ranges)

    def read_into(self, rids: list[int], tokens: np.ndarray | None, key: bytes, dst: torch.Tensor) -> list[str]:
        """read() into rows of a tensor on any device. With a CUDA tensor and GPUDirect
        Storage the records go from the SSD straight into device memory; the data CRCs are
        computed there, and only each record's head (header, token ids, key) comes back to
        the host for the remaining checks (the same C++ check as read()). Verified payloads
        are then copied device to device into dst. On the CPU the same steps run with pread
        and the host CRC."""
        if not rids:
            return []
        t0 = time.perf_counter()
        P = self.identity.block_bytes
        if dst.dtype != torch.uint8 or dst.dim() != 2 or dst.shape[1] != P or dst.shape[0] < len(rids):
            raise ValueError(f"dst must be uint8 [{len(rids)}, {P}]")
        if tokens is not None:
            tokens = np.ascontiguousarray(tokens, dtype="<u4")
        status = ["ok"] * len(rids)
        with self._lock:
            recs = [self._recs.get(rid) for rid in rids]
        groups: list[list] = []  # [seg, file_offset, size, [record index, ...]]
        for i, r in enumerate(recs):
            if r is None:
                status[i] = "missing"
                continue
            g = groups[-1] if groups else None
            if g is not None and g[0] is r.seg and g[1] + g[2] == r.offset and g[2] + r.padded <= _GROUP_BYTES:
                g[2] += r.padded
                g[3].append(i)
            else:
                groups.append([r.seg, r.offset, r.padded, [i]])
        staging = torch.empty(max(1, sum(g[2] for g in groups)), dtype=torch.uint8, device=dst.device)
        where, got, pos = {}, {}, 0
        for seg, file_off, size, members in groups:
            done, err = self._device_read(seg, staging, size, file_off, pos)
            for i in members:
                rel_end = recs[i].offset - file_off + recs[i].padded
                where[i] = pos + recs[i].offset - file_off
                got[i] = recs[i].padded if done >= rel_end else max(0, done - (rel_end - recs[i].padded))
                if done < rel_end and err:
                    status[i] = "missing" if err in (errno.ENOENT, errno.EBADF) else "io"
            pos += size
        live = [i for i in range(len(rids)) if status[i] == "ok"]
        if not live:
            self._settle(rids, recs, status, t0)
            return status
        # The heads come back to the host first: their record_bytes say which range to checksum.
        T = self.identity.block_tokens
        head_bytes = _io.align_up(sf.REC_HEADER_BYTES + 4 * T + len(key))
        heads_dev = torch.stack([staging[where[i]: where[i] + head_bytes] if got[i] >= head_bytes
                                 else torch.zeros(head_bytes, dtype=torch.uint8, device=dst.device)
                                 for i in live])
        heads = heads_dev.cpu().numpy()
        hdr = heads[:, : sf.REC_HEADER_BYTES].copy().view(sf.REC_DTYPE).reshape(-1)
        ranges = []
        for k, i in enumerate(live):
            end = min(int(hdr["record_bytes"][k]), got[i])
            ranges.append((where[i] + sf.REC_HEADER_BYTES, max(0, end - sf.REC_HEADER_BYTES)))
        crcs = self._device_crc(staging, ranges)
        specs = [(k * head_bytes, recs[i].padded, recs[i].rid, recs[i].parent, recs[i].block_index, recs[i].hash,
                  i, crcs[k], got[i]) for k, i in enumerate(live)]
        codes = _io._io.check_heads(heads.reshape(-1), specs, tokens, key, P, head_bytes)
        for i, code in zip(live, codes):
            status[i] = _RECORD_STATUS[code]
        row = {i: k for k, i in enumerate(live)}
        self._check_parents(recs, status, lambda i: hdr[row[i]])
        for k, i in enumerate(live):
            if status[i] == "ok":
                po = int(hdr["payload_offset"][k])
                dst[i].copy_(staging[where[i] + po: where[i] + po + P], non_blocking=True)
        self._settle(rids, recs, status, t0)
        return status

    def load(self, key: bytes, hashes: list[bytes], tokens: np.ndarray, out: np.ndarray | torch.Tensor | None,
             parent: int = 0) -> list[int]:
        """The longest verified chain for `hashes` (blocks whose token ids are the rows of
        `tokens`) below record `parent`: copies payloads into the rows of `out` (a host
        array, or a tensor on any device: see read_into) and returns the record ids. A record that is a collision or fails verification ends the chain
        there, after any other candidate for that block has been tried."""
        loaded: list[int] = []
        exclude: set[int] = set()
        per = max(1, _READ_BATCH // self._padded_guess())
        i = 0
        while i < len(hashes):
            chain = self.walk(key, hashes[i:], loaded[-1] if loaded else parent, exclude)
            if not chain:
                break
            stopped = False
            for s in range(0, len(chain), per):
                part = chain[s: s + per]
                rows = None if out is None else out[i: i + len(part)]
                if isinstance(out, torch.Tensor):
                    st = self.read_into(part, tokens[i: i + len(part)], key, rows)
                else:
                    st = self.read(part, tokens[i: i + len(part)], key, rows)
                k = next((j for j, x in enumerate(st) if x != "ok"), len(st))
                loaded += part[:k]
                i += k
                if k < len(part):
                    exclude.add(part[k])  # then look for another candidate for block i
                    stopped = True
                    break
            if not stopped:
                break
        if loaded:
            self.touch(loaded)
        return loaded

    def _padded_guess(self) -> int:
        return _io.align_up(self.identity.block_bytes + 4096)

    def touch(self, rids: list[int]) -> None:
        """Marks records as used now (LRU and TTL count from the last use)."""
        now = self._now_ns()
        with self._lock:
            for rid in rids:
                r = self._recs.get(rid)
                if r is not None:
                    r.atime_ns = now
                    if self.writable:
                        self._journal_buf.append(sf.encode_journal(sf.J_ACCESS, rid, now))
            if len(self._journal_buf) >= 4096:
                self._flush_journal()

    def record_info(self, rid: int) -> dict | None:
        with self._lock:
            r = self._recs.get(rid)
            if r is None:
                return None
            return {"record_id": r.rid, "parent_id": r.parent, "segment": r.seg.name, "offset": r.offset,
                    "padded_bytes": r.padded, "block_index": r.block_index, "created_ns": r.created_ns,
                    "atime_ns": r.atime_ns, "key": self._keys[r.key_id], "hash": r.hash}

    def record_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._recs)

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
        self._check_writable()
        view = _as_bytes_view(payload)
        if view.size != self.identity.block_bytes:
            from .errors import PayloadError
            raise PayloadError(f"payload has {view.size} bytes, a block of this store has "
                               f"{self.identity.block_bytes}")
        tokens = np.ascontiguousarray(tokens, dtype="<u4").reshape(-1)
        if tokens.size != self.identity.block_tokens:
            from .errors import PayloadError
            raise PayloadError(f"a record holds {self.identity.block_tokens} token ids, got {tokens.size}")
        if len(block_hash) > 32 or len(parent_hash) > 32:
            raise ValueError("hashes are at most 32 bytes")
        with self._lock:
            if parent and parent not in self._recs and parent not in self._pending_rids:
                raise MissingParentError(f"parent record {parent} is neither stored nor queued")
            rid = self._next_rid
            self._next_rid += 1
            self._pending.append(_Pending(rid, parent, block_index, block_hash, parent_hash, tokens,
                                          bytes(key), view))
            self._pending_rids.add(rid)
        return rid

    def commit(self) -> CommitResult:
        """Writes the queued records (segments of at most segment_bytes), makes them durable
        (durability "fsync") and visible. Disk full or another I/O error degrades the tier:
        the records are dropped with a warning and commits are skipped for a while; nothing
        is raised."""
        with self._write_lock:
            with self._lock:
                pending, self._pending = self._pending, []
                self._pending_rids = set()
            res = CommitResult()
            if not pending:
                return res
            if self.degraded:
                res.dropped = [p.rid for p in pending]
                res.error = self.degraded_reason
                self.metrics.persist_failures.inc(cause="degraded")
                return res
            t0 = time.perf_counter()
            groups, cur, cur_bytes = [], [], sf.PAGE * 3
            for p in pending:
                padded = sf.record_geometry(p.tokens.size, len(p.key), p.payload.size)[2]
                if cur and cur_bytes + padded + 128 > self.segment_bytes:
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
                with self._lock:
                    for p in g:
                        if not p.parent or p.parent in self._recs or p.parent in ok_rids:
                            alive.append(p)
                            ok_rids.add(p.rid)
                        else:
                            res.dropped.append(p.rid)
                if not alive:
                    continue
                try:
                    res.bytes_written += self._write_segment(alive, supersedes=[])
                    res.persisted += [p.rid for p in alive]
                except OSError as e:
                    failed_at = gi
                    res.dropped += [p.rid for p in alive]
                    self._degrade(e)
                    res.error = self.degraded_reason
                    break
            if failed_at is not None:
                for g in groups[failed_at + 1:]:
                    res.dropped += [p.rid for p in g]
            self.metrics.ssd_commit_seconds.observe(time.perf_counter() - t0)
            self.metrics.bytes_written.inc(res.bytes_written, tier="ssd")
            self.metrics.inserted_blocks.inc(len(res.persisted), tier="ssd")
            self._flush_journal()
            if self.capacity_bytes is not None and self.file_bytes() > self.capacity_bytes:
                self.gc()
            self._update_gauges()
            return res

    def _degrade(self, e: OSError, retry_after_s: float = 30.0) -> None:
        cause = "no_space" if e.errno in _NO_SPACE else "io_error"
        self.metrics.persist_failures.inc(cause=cause)
        self.degraded_reason = f"{cause}: {e}"
        self._degraded_until = self.clock() + retry_after_s
        warnings.warn(f"persistent store {self.path}: batch not persisted ({e}); the memory tiers keep "
                      f"their blocks, SSD writes resume in {retry_after_s:.0f} s", RuntimeWarning, stacklevel=4)

    def _writer(self):
        """One background thread that writes a chunk while the next one is encoded."""
        if self._write_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="dsv41-store-writer")
        return self._write_pool

    def _hook(self, stage: str) -> None:
        if self._fault is not None:
            self._fault(stage)

    def _write_segment(self, records: list, supersedes: list[bytes], raw: list | None = None) -> int:
        """Writes one segment holding `records` (pending records to encode) or `raw` (already
        encoded records, copied verbatim by compaction: list of (rec, view, offset)). Returns
        the file size. On failure nothing is left behind and OSError is raised."""
        seq, uuid = self._next_seq, os.urandom(16)
        self._next_seq += 1
        name = sf.segment_name(seq, uuid)
        tmp = self.path / f".tmp-{name}"
        f = self._eng.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, direct=self.direct)
        published = False
        in_flight = None  # (future, staging item) of the chunk being written
        try:
            seg = _Seg(uuid, seq, name, 0)
            rows, keys, key_ix = [], [], {}
            offset = sf.PAGE
            created = self._now_ns()  # one time for the whole batch: LRU sees its chains as one age
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
                item = self._get_staging(size)
                buf, view = item
                try:
                    at = 0
                    for it in chunk:
                        if raw is not None:
                            rec, src_view, src_off = it
                            view[at: at + rec.padded] = src_view[src_off: src_off + rec.padded]
                            key = self._keys[rec.key_id]
                            ki = key_ix.setdefault(key, len(keys))
                            if ki == len(keys):
                                keys.append(key)
                            rows.append((rec.rid, rec.parent, offset + at, rec.created_ns, rec.padded,
                                         rec.block_index, ki, rec.hash, self._record_bytes(view, at)))
                            at += rec.padded
                        else:
                            at = self._encode(it, view, at, offset, rows, keys, key_ix, created)
                    self._hook("write")
                    fut = self._writer().submit(self._eng.write_all, f.fd, offset, buf, 0, size, str(tmp))
                except BaseException:
                    self._put_staging(item)
                    raise
                if in_flight is not None:
                    done, in_flight = in_flight, None
                    try:
                        done[0].result()
                    finally:
                        self._put_staging(done[1])
                in_flight = (fut, item)
                offset += size
            if in_flight is not None:
                done, in_flight = in_flight, None
                try:
                    done[0].result()
                finally:
                    self._put_staging(done[1])
            # Footer and trailer.
            entries = np.zeros(len(rows), dtype=sf.FOOTER_DTYPE)
            for j, (rid, parent, off, created, padded, bi, ki, h, rbytes) in enumerate(rows):
                entries[j] = (rid, parent, off, created, rbytes, bi, ki, self.identity.block_tokens,
                              len(h), b"", h.ljust(32, b"\0"))
            footer = sf.encode_footer(entries, keys)
            footer_off = offset
            fpad = _io.align_up(len(footer))
            trailer = sf.encode_trailer(sf.SegmentTrailer(uuid, footer_off, len(footer), len(rows),
                                                          _io.crc32c(footer)))
            header = sf.encode_segment_header(sf.SegmentHeader(uuid, seq, time.time_ns(), self.identity.store_id,
                                                               len(rows), list(supersedes)))
            tail_size = fpad + sf.PAGE
            item = self._get_staging(tail_size)
            buf, view = item
            try:
                view[:tail_size] = 0
                view[: len(footer)] = np.frombuffer(footer, dtype=np.uint8)
                view[fpad: fpad + sf.PAGE] = np.frombuffer(trailer, dtype=np.uint8)
                self._hook("footer")
                self._eng.write_all(f.fd, footer_off, buf, 0, tail_size, str(tmp))
                view[: sf.PAGE] = np.frombuffer(header, dtype=np.uint8)
                self._eng.write_all(f.fd, 0, buf, 0, sf.PAGE, str(tmp))
            finally:
                self._put_staging(item)
            file_bytes = footer_off + tail_size
            if self.durability == "fsync":
                self._hook("fsync")
                self._eng.fsync(f.fd, str(tmp))
            os.close(f.fd)
            f.fd = -1
            self._hook("rename")
            os.rename(tmp, self.path / name)
            published = True
            if self.durability == "fsync":
                self._fsync_dir()
            self._hook("published")
        except BaseException:
            if in_flight is not None:  # let the last write finish before its fd is closed
                try:
                    in_flight[0].result()
                except BaseException:
                    pass
                self._put_staging(in_flight[1])
            if f.fd >= 0:
                os.close(f.fd)
            if not published:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
            raise
        seg.file_bytes = file_bytes
        with self._lock:
            self._segs[uuid] = seg
            for rid, parent, off, created, padded, bi, ki, h, rbytes in rows:
                old = self._recs.get(rid)
                if raw is not None and old is None:
                    continue  # deleted while being copied: stays deleted
                if old is not None:
                    self._unindex(old)
                    atime = old.atime_ns
                else:
                    atime = None
                r = _Rec(rid, parent, seg, off, padded, bi, created, self._key_id(keys[ki]), h)
                if atime is not None:
                    r.atime_ns = atime
                self._index(r)
        return file_bytes

    @staticmethod
    def _record_bytes(view: np.ndarray, at: int) -> int:
        return int(view[at: at + sf.REC_HEADER_BYTES].view(sf.REC_DTYPE)[0]["record_bytes"])

    def _encode(self, p: _Pending, view: np.ndarray, at: int, file_off: int, rows, keys, key_ix,
                created: int) -> int:
        T, K, P = p.tokens.size, len(p.key), p.payload.size
        po, rbytes, padded = sf.record_geometry(T, K, P)
        base = at + sf.REC_HEADER_BYTES
        view[base: base + 4 * T] = p.tokens.view(np.uint8)
        view[base + 4 * T: base + 4 * T + K] = np.frombuffer(p.key, dtype=np.uint8)
        view[base + 4 * T + K: at + po] = 0  # alignment gap before the payload
        view[at + po: at + po + P] = p.payload
        view[at + rbytes: at + padded] = 0  # padding to the page
        data_crc = _io.crc32c(view[base: at + rbytes])
        head = sf.pack_record_header(record_id=p.rid, parent_id=p.parent, created_ns=created,
                                     block_index=p.block_index, token_count=T, key_bytes=K, payload_offset=po,
                                     payload_bytes=P, record_bytes=rbytes, block_hash=p.block_hash,
                                     parent_hash=p.parent_hash, data_crc=data_crc)
        view[at: at + sf.REC_HEADER_BYTES] = np.frombuffer(head, dtype=np.uint8)
        ki = key_ix.setdefault(p.key, len(keys))
        if ki == len(keys):
            keys.append(p.key)
        rows.append((p.rid, p.parent, file_off + at, created, padded, p.block_index, ki, p.block_hash, rbytes))
        return at + padded

    # ---- GC -----------------------------------------------------------------------------

    def file_bytes(self) -> int:
        with self._lock:
            return sum(s.file_bytes for s in self._segs.values())

    def live_bytes(self) -> int:
        return self._live_total

    def gc(self, *, low_water: float = 0.9, compact_dead_fraction: float = 0.5) -> dict:
        """Expires records past the TTL, evicts least recently used records until the live
        bytes fit `low_water` x capacity, then reclaims space: deletes segments without
        live records and rewrites segments that are mostly dead (or too many small ones)
        into new segments that supersede them."""
        self._check_writable()
        report = {"expired": 0, "evicted": 0, "segments_deleted": 0, "segments_compacted": 0,
                  "bytes_before": 0, "bytes_after": 0, "corrupt_dropped": 0}
        with self._write_lock:
            report["bytes_before"] = self.file_bytes()
            now = self._now_ns()
            with self._lock:
                expired = [r.rid for r in self._recs.values() if self._expired(r, now)]
            for rid in expired:
                report["expired"] += self._delete(rid, "ttl")
            target = None if self.capacity_bytes is None else int(self.capacity_bytes * low_water)
            for _ in range(8):
                if target is not None:
                    with self._lock:
                        order = sorted(self._recs.values(), key=lambda r: (r.atime_ns, -r.block_index))
                    for r in order:
                        if self.live_bytes() <= target:
                            break
                        report["evicted"] += self._delete(r.rid, "capacity")
                self._flush_journal()
                deleted, compacted, corrupt = self._reclaim(compact_dead_fraction)
                report["segments_deleted"] += deleted
                report["segments_compacted"] += compacted
                report["corrupt_dropped"] += corrupt
                if self.capacity_bytes is None or self.file_bytes() <= self.capacity_bytes or not self._recs:
                    break
                # Segment headers and footers still overshoot the cap: evict that much more.
                target = max(0, self.live_bytes() - (self.file_bytes() - self.capacity_bytes))
            report["bytes_after"] = self.file_bytes()
            self._rewrite_journal_if_large()
            self._update_gauges()
        return report

    def _retire(self, segs: list[_Seg], unlink: bool = True) -> None:
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

    def _reclaim(self, dead_fraction: float) -> tuple[int, int, int]:
        with self._lock:
            segs = list(self._segs.values())
        empty = [s for s in segs if not s.rids]
        self._retire(empty)
        live = [s for s in segs if s.rids]
        must = [s for s in live if s.damaged or s.live_bytes < (1 - dead_fraction) * s.file_bytes]
        small = [s for s in live if s.file_bytes < self.segment_bytes // 8 and s not in must]
        if len(small) > 16:  # many small commits: merge them
            must += small
        compacted = corrupt = 0

        def run(batch):
            nonlocal compacted, corrupt
            c, d = self._compact(batch)
            compacted, corrupt = compacted + c, corrupt + d

        for batch in self._batches(must):
            run(batch)
        if self.capacity_bytes is not None:
            # Still over the cap: rewrite the deadest segments, one batch at a time.
            with self._lock:
                rest = sorted((s for s in self._segs.values() if s.rids and s not in must),
                              key=lambda s: s.live_bytes / s.file_bytes)
            while rest and self.file_bytes() > self.capacity_bytes:
                batch = next(self._batches(rest))
                rest = rest[len(batch):]
                run(batch)
        return len(empty), compacted, corrupt

    def _batches(self, segs: list[_Seg]):
        batch, size = [], 0
        for s in segs:
            batch.append(s)
            size += s.live_bytes
            if size >= self.segment_bytes // 2 or len(batch) >= sf.MAX_SUPERSEDES:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch

    def _compact(self, segs: list[_Seg]) -> tuple[int, int]:
        """Rewrites the live records of `segs` into one new segment that supersedes them."""
        with self._lock:
            recs = sorted((self._recs[rid] for s in segs for rid in s.rids if rid in self._recs),
                          key=lambda r: (r.block_index, r.rid))
        corrupt = 0
        raw = []
        item = None
        if recs:
            with self._reading():
                status, item, where = self._read_checked(recs, None, None, None)
            view = item[1]
            for i, (r, st) in enumerate(zip(recs, status)):
                if st != "ok":
                    corrupt += 1
                    self.metrics.checksum_failures.inc(kind=st)
                    self._delete(r.rid, "corruption")
                    continue
                raw.append((r, view, where[i]))
            # A record whose parent was just dropped is an orphan: _delete removed it too.
            raw = [x for x in raw if x[0].rid in self._recs]
        try:
            if raw:
                self._write_segment([], supersedes=[s.uuid for s in segs], raw=raw)
        except OSError as e:
            self._degrade(e)
            return 0, corrupt
        finally:
            if item is not None:
                self._put_staging(item)
        self._retire(segs)
        return len(segs), corrupt

    def _rewrite_journal_if_large(self) -> None:
        if self._journal_fd is None or self._journal_pos < 64 * 32 + 4 * 32 * len(self._recs):
            return
        now = self._now_ns()
        with self._lock:
            parts = [sf.encode_journal(sf.J_WATERMARK, self._next_rid, now, self._next_seq)]
            parts += [sf.encode_journal(sf.J_ACCESS, r.rid, r.atime_ns) for r in self._recs.values()
                      if r.atime_ns != r.created_ns]
            data = b"".join(parts)
            tmp = self.path / (sf.JOURNAL_NAME + ".tmp")
            fd = _files.create_exclusive(tmp)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path / sf.JOURNAL_NAME)
            self._fsync_dir()
            os.close(self._journal_fd)
            self._journal_fd = _files.open_regular(self.path / sf.JOURNAL_NAME, os.O_RDWR)
            self._journal_pos = len(data)

    # ---- full verification (dsv41 cache verify) -----------------------------------------

    def verify(self, progress: Callable[[int, int], None] | None = None, repair: bool = False) -> dict:
        """Reads and checks every record (header and data CRC, identity, chain links, and the
        block hash when the hash function is known). With repair (writer only) failed
        records are removed; without it they are only reported."""
        if repair:
            self._check_writable()
        with self._lock:
            recs = sorted(self._recs.values(), key=lambda r: (r.seg.seq, r.offset))
            hashes = {r.rid: r.hash for r in recs}
        total = sum(r.padded for r in recs)
        report = {"records": len(recs), "bytes": total, "ok": 0, "failed": {}, "failed_records": [],
                  "damaged_segments": sum(1 for s in self._segs.values() if s.damaged),
                  # Problems found while opening: segments of another store (a manifest
                  # rewritten for another model makes every segment foreign), names that are
                  # links, FIFOs or directories, record ids claimed by two different records.
                  "foreign_segments": self.counts["foreign_segments"],
                  "unusable_files": list(self.unusable),
                  "colliding_records": self.counts["colliding_records"],
                  "hash_checked": self.hash_fn is not None}
        done_bytes = 0
        i = 0
        while i < len(recs):
            batch, size = [], 0
            while i < len(recs) and (not batch or size + recs[i].padded <= _READ_BATCH):
                batch.append(recs[i])
                size += recs[i].padded
                i += 1
            with self._reading():
                status, item, where = self._read_checked(batch, None, None, None)
            view = item[1]
            for j, (r, st) in enumerate(zip(batch, status)):
                off = where.get(j)
                if st == "ok":
                    st = self._verify_links(r, view, off, hashes)
                if st == "ok":
                    report["ok"] += 1
                else:
                    report["failed"][st] = report["failed"].get(st, 0) + 1
                    report["failed_records"].append({"record_id": r.rid, "segment": r.seg.name,
                                                     "offset": r.offset, "problem": st})
                    self.metrics.checksum_failures.inc(kind=st)
                    if repair:
                        self._delete(r.rid, "corruption")
                done_bytes += r.padded
            self._put_staging(item)
            if progress is not None:
                progress(done_bytes, total)
        if repair:
            self._flush_journal()
        report["corrupt"] = len(report["failed_records"])
        return report

    def _verify_links(self, r: _Rec, view: np.ndarray, off: int, hashes: dict) -> str:
        h = view[off: off + sf.REC_HEADER_BYTES].view(sf.REC_DTYPE)[0]
        hb = int(h["hash_bytes"])
        parent_hash = bytes(h["parent_hash"])[:hb]
        if r.parent and r.parent in hashes and hashes[r.parent] != parent_hash:
            return "chain"
        if self.hash_fn is not None:
            from .hashing import _DOMAIN_BLOCK, _field, _DOMAIN_ROOT
            base = off + sf.REC_HEADER_BYTES
            tc, kb = int(h["token_count"]), int(h["key_bytes"])
            tokens = bytes(view[base: base + 4 * tc])
            key = bytes(view[base + 4 * tc: base + 4 * tc + kb])
            if not r.parent and parent_hash != self.hash_fn(_DOMAIN_ROOT + _field(b"key", key)):
                return "hash"
            want = self.hash_fn(_DOMAIN_BLOCK + _field(b"parent", parent_hash) + _field(b"tokens", tokens)
                                + _field(b"key", key))
            if want != r.hash:
                return "hash"
        return "ok"

    # ---- readers ------------------------------------------------------------------------

    def refresh(self) -> dict:
        """Reader: index segments published since the last look, forget removed ones, and
        apply new journal entries. Returns what changed."""
        if self.mode != "r" or self.mismatch is not None:
            return {"added_segments": 0, "removed_segments": 0}
        names = set(os.listdir(self.path))
        added = removed = 0
        with self._lock:
            known = {s.name for s in self._segs.values()}
            for s in list(self._segs.values()):
                if s.name not in names:
                    for rid in list(s.rids):
                        if rid in self._recs:
                            self._unindex(self._recs[rid])
                    self._retire([s], unlink=False)
                    removed += 1
            for n in sorted(names - known):
                parsed = sf.parse_segment_name(n)
                if parsed is None:
                    continue
                info = self._load_segment(n, *parsed)
                if info is None:
                    continue
                seg, hdr, rows = info
                for u in hdr.supersedes:
                    old = self._segs.get(u)
                    if old is not None:
                        for rid in list(old.rids):
                            if rid in self._recs:
                                self._unindex(self._recs[rid])
                        self._retire([old], unlink=False)
                self._segs[seg.uuid] = seg
                self._add_rows(rows)
                added += 1
            try:
                fd = _files.open_regular(self.path / sf.JOURNAL_NAME, os.O_RDONLY)
            except FileNotFoundError:
                data = b""
            else:
                try:
                    data = self._read_all(fd)
                finally:
                    os.close(fd)
            if len(data) < self._journal_pos:
                self._journal_pos = 0  # the writer rewrote it
            entries, valid = sf.decode_journal(data[self._journal_pos:])
            deleted: set[int] = set()
            self._apply_journal(entries, deleted)
            self._journal_pos += valid
            for rid in deleted:
                r = self._recs.get(rid)
                if r is not None:
                    self._unindex(r)
        return {"added_segments": added, "removed_segments": removed}

    # ---- stats and shutdown -------------------------------------------------------------

    def _update_gauges(self) -> None:
        self.metrics.entries.set(len(self._recs), tier="ssd")
        self.metrics.bytes.set(self.file_bytes(), tier="ssd")

    def stats(self) -> dict:
        from .hashing import decode_key
        with self._lock:
            per_ns: dict[str, dict] = {}
            for r in self._recs.values():
                ns = decode_key(self._keys[r.key_id]).get("namespace", "?")
                d = per_ns.setdefault(ns, {"records": 0, "bytes": 0})
                d["records"] += 1
                d["bytes"] += r.padded
            atimes = [r.atime_ns for r in self._recs.values()]
            out = {
                "path": str(self.path),
                "mode": self.mode,
                "identity": dict(self.identity.__dict__),
                "mismatch": self.mismatch,
                "records": len(self._recs),
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
            }
        return out

    def close(self) -> None:
        if self.closed:
            return
        with self._write_lock:
            if self._pending and self.writable:
                self.commit()
            self._flush_journal()
            if self._journal_fd is not None:
                if self.durability == "fsync":
                    try:
                        os.fsync(self._journal_fd)
                    except OSError:
                        pass
                os.close(self._journal_fd)
                self._journal_fd = None
            with self._lock:
                for s in self._segs.values():
                    if s.fd is not None:
                        os.close(s.fd)
                        s.fd = None
                for fd in self._fd_graveyard:
                    os.close(fd)
                self._fd_graveyard.clear()
                self._gds_files.clear()
            if self._write_pool is not None:
                self._write_pool.shutdown(wait=True)
                self._write_pool = None
            self._release_lock()
            self.closed = True

    def __enter__(self) -> "PersistentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self.closed and self._lock_fd is not None:
                self.close()
        except Exception:
            pass
