"""journal.log: append-only 32-byte entries (access times, deletions, id watermarks).

The journal is advisory: segments are the truth, and losing the journal's tail only makes
LRU and TTL less precise and brings deleted records back until GC deletes them again.
A damaged or torn entry ends the valid prefix; the writer truncates the rest away so new
entries stay aligned.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from . import files as _files
from . import format as sf

__all__ = ["Journal", "apply_entries"]

log = logging.getLogger("dsv41.cache.store")


def _read_all(fd: int) -> bytes:
    parts = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)


class Journal:
    def __init__(self, directory: Path, writable: bool):
        self.dir = directory
        self.path = directory / sf.JOURNAL_NAME
        self.writable = writable
        self.fd: int | None = None  # the writer's append fd
        self.pos = 0                # bytes of valid entries read or written so far
        self.buf: list[bytes] = []  # encoded entries not yet written, one or many per item
        self.pending_bytes = 0
        self.torn_bytes = 0

    def _read(self, flags: int) -> tuple[int | None, bytes]:
        try:
            fd = _files.open_regular(self.path, flags)
        except FileNotFoundError:
            return None, b""
        try:
            return fd, _read_all(fd)
        except BaseException:
            os.close(fd)
            raise

    def open(self) -> list[tuple[int, int, int, int]]:
        """Reads the journal (the writer creates it and keeps it open for appending) and
        returns its valid entries."""
        fd, data = self._read(os.O_RDWR | os.O_CREAT if self.writable else os.O_RDONLY)
        entries, valid = sf.decode_journal(data)
        self.torn_bytes = len(data) - valid
        try:
            if self.writable and valid != len(data):
                os.ftruncate(fd, valid)  # drop the torn tail so new entries stay aligned
        except BaseException:
            os.close(fd)
            raise
        if self.writable:
            self.fd = fd
        elif fd is not None:
            os.close(fd)
        self.pos = valid
        return entries

    def read_new(self) -> list[tuple[int, int, int, int]]:
        """A reader's look at entries appended since the last one."""
        fd, data = self._read(os.O_RDONLY)
        if fd is not None:
            os.close(fd)
        if len(data) < self.pos:
            self.pos = 0  # the writer rewrote it
        entries, valid = sf.decode_journal(data[self.pos:])
        self.pos += valid
        return entries

    def append(self, kind: int, rid: int, time_ns: int, aux: int = 0) -> None:
        if self.writable:
            self.buf.append(sf.encode_journal(kind, rid, time_ns, aux))
            self.pending_bytes += sf.JOURNAL_ENTRY.size

    def append_many(self, kind: int, rids, time_ns: int) -> None:
        """append() of one entry per record, all at time_ns, encoded in one pass."""
        if self.writable and len(rids):
            self.buf.append(sf.encode_journal_many(kind, rids, time_ns))
            self.pending_bytes += len(rids) * sf.JOURNAL_ENTRY.size

    def flush(self) -> None:
        if self.fd is None or not self.buf:
            self.buf.clear()
            self.pending_bytes = 0
            return
        data = b"".join(self.buf)
        self.buf.clear()
        self.pending_bytes = 0
        try:
            os.pwrite(self.fd, data, self.pos)
            self.pos += len(data)
        except OSError as e:
            # The journal is advisory (access times, deletions GC would redo): losing an
            # append only makes GC less precise after a restart.
            log.warning("journal append failed (%s); continuing", e)

    def rewrite(self, entries: list[bytes]) -> None:
        """Replaces the journal with `entries` (encoded), atomically (temp file, rename)."""
        data = b"".join(entries)
        tmp = self.dir / (sf.JOURNAL_NAME + ".tmp")
        fd = _files.create_exclusive(tmp)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _files.fsync_dir(self.dir)
        if self.fd is not None:
            os.close(self.fd)
        self.fd = _files.open_regular(self.path, os.O_RDWR)
        self.pos = len(data)

    def close(self, fsync: bool) -> None:
        self.flush()
        if self.fd is not None:
            if fsync:
                try:
                    os.fsync(self.fd)
                except OSError:
                    pass
            os.close(self.fd)
            self.fd = None


def apply_entries(entries, recs: dict, next_rid: int, next_seq: int) -> tuple[set[int], int, int]:
    """Applies journal entries to the records' access times; returns (deleted ids, the
    next record id, the next segment sequence number) the entries imply."""
    deleted: set[int] = set()
    for kind, rid, t, aux in entries:
        if kind == sf.J_ACCESS:
            r = recs.get(rid)
            if r is not None and t > r.atime_ns:
                r.atime_ns = t
        elif kind == sf.J_DELETE:
            deleted.add(rid)
        elif kind == sf.J_WATERMARK:
            next_rid = max(next_rid, rid)
            next_seq = max(next_seq, aux)
        next_rid = max(next_rid, rid + 1 if kind != sf.J_WATERMARK else rid)
    return deleted, next_rid, next_seq
