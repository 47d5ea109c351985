"""Reading a segment file's index: one loader for recovery (writer and reader) and refresh.

A segment's footer lists its records, so loading reads two pages and the footer, never the
payloads. A segment whose header or footer is damaged is scanned record header by record
header instead. Every header field is bounded before it sizes a read: a crafted record
with a valid CRC must not make recovery read gigabytes.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import numpy as np

from .. import io as _io
from . import files as _files
from . import format as sf
from .index import RecordIndex, SegmentFile, StoredRecord
from .manifest import StoreIdentity

__all__ = ["SegmentLoader", "read_exact"]

log = logging.getLogger("dsv41.cache.store")

SCAN_WINDOW = 1 << 20  # bytes a scan reads at a time while it looks for record headers


def read_exact(fd: int, offset: int, length: int) -> bytes:
    """Up to `length` bytes at `offset` (fewer only at the end of the file)."""
    out = bytearray()
    while len(out) < length:
        chunk = os.pread(fd, length - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


class SegmentLoader:
    def __init__(self, directory: Path, identity: StoreIdentity, index: RecordIndex, counts: dict,
                 unusable: Callable[[str, OSError], None]):
        self.dir, self.identity, self.index, self.counts, self.unusable = directory, identity, index, counts, unusable

    def same_bytes(self, a: StoredRecord, b: StoredRecord) -> bool:
        """Whether two index entries lead to byte-identical record headers (identity,
        creation time, data CRC, header CRC): one record copied verbatim, not two records
        that share an id. False when either cannot be read."""
        heads = []
        for r in (a, b):
            try:
                fd = _files.open_regular(self.dir / r.seg.name, os.O_RDONLY)
            except OSError:
                return False
            try:
                heads.append(read_exact(fd, r.offset, sf.REC_HEADER_BYTES))
            except OSError:
                return False
            finally:
                os.close(fd)
        return len(heads[0]) == sf.REC_HEADER_BYTES and heads[0] == heads[1]

    def load(self, name: str, seq: int, uuid: bytes):
        """(segment, header, records) of one segment file, or None when it is gone, not a
        regular file, or another store's."""
        path = self.dir / name
        try:
            fd = _files.open_regular(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except _files.NotRegularFileError as e:
            self.unusable(name, e)
            return None
        try:
            size = os.fstat(fd).st_size
            seg = SegmentFile(uuid, seq, name, size)
            try:
                hdr = sf.decode_segment_header(read_exact(fd, 0, sf.PAGE))
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

    def _rows_from_footer(self, fd: int, size: int, seg: SegmentFile, hdr) -> list[StoredRecord]:
        if size < 2 * sf.PAGE or size % sf.PAGE:
            raise sf.FormatError(f"size {size} is not a whole number of pages")
        trailer = sf.decode_trailer(read_exact(fd, size - sf.PAGE, sf.PAGE))
        if trailer.uuid != seg.uuid:
            raise sf.FormatError("trailer belongs to another segment")
        if trailer.footer_offset + trailer.footer_bytes > size - sf.PAGE:
            raise sf.FormatError("footer lies outside the file")
        if trailer.footer_offset % sf.PAGE or trailer.footer_offset < sf.PAGE:
            raise sf.FormatError("footer offset is not a page boundary after the header")
        data = read_exact(fd, trailer.footer_offset, trailer.footer_bytes)
        if _io.crc32c(data) != trailer.footer_crc:
            raise sf.FormatError("footer checksum mismatch")
        entries, keys = sf.decode_footer(data)
        if len(entries) != trailer.record_count or len(entries) != hdr.record_count:
            raise sf.FormatError("footer record count disagrees with header/trailer")
        if any(len(k) > sf.MAX_KEY_BYTES for k in keys):
            raise sf.FormatError("footer: a key longer than any cache key")
        key_ids = [self.index.key_id(k) for k in keys]
        T, P = self.identity.block_tokens, self.identity.block_bytes
        rows = []
        # Each record must start at a RECORD_ALIGN boundary in [PAGE, footer_offset) and
        # end before the next one (by offset) starts: an entry overlapping another would
        # let two index entries claim the same bytes.
        for e in entries:
            off, rbytes = int(e["offset"]), int(e["record_bytes"])
            span = sf.record_span(rbytes)
            if off % sf.RECORD_ALIGN or off < sf.PAGE or off + span > trailer.footer_offset:
                raise sf.FormatError("footer entry points outside the record area")
            kb = len(keys[int(e["key_index"])])
            if int(e["token_count"]) != T or rbytes != sf.record_geometry(T, kb, P)[1]:
                raise sf.FormatError("footer entry's token count or size does not fit this store's blocks")
            if not sf.valid_record_id(int(e["record_id"])) or int(e["parent_id"]) > sf.MAX_RECORD_ID:
                raise sf.FormatError("footer entry has a record id out of range")
            hb = int(e["hash_bytes"])
            rows.append(StoredRecord(int(e["record_id"]), int(e["parent_id"]), seg, off, span,
                             int(e["block_index"]), int(e["created_ns"]), key_ids[int(e["key_index"])],
                             bytes(e["block_hash"])[:hb]))
        if len(rows) > 1:
            starts = np.array([r.offset for r in rows], dtype=np.int64)
            ends = starts + np.array([r.span for r in rows], dtype=np.int64)
            order = np.argsort(starts, kind="stable")
            if (starts[order[1:]] < ends[order[:-1]]).any():
                raise sf.FormatError("footer entries overlap")
        return rows

    def _rows_from_scan(self, fd: int, size: int, seg: SegmentFile) -> list[StoredRecord]:
        rows = []
        off = sf.PAGE
        # Records are packed at RECORD_ALIGN, so a damaged header is skipped by trying
        # the next RECORD_ALIGN boundary. The file is read a window at a time (a pread per
        # 64-byte step would be thousands of syscalls per megabyte of damage).
        win, win_off = b"", 0
        while off + sf.REC_HEADER_BYTES <= size:
            if not (win_off <= off and off + sf.REC_HEADER_BYTES <= win_off + len(win)):
                win_off, win = off, read_exact(fd, off, SCAN_WINDOW)
                if len(win) < sf.REC_HEADER_BYTES:
                    break
            at = off - win_off
            hb_ = win[at: at + sf.REC_HEADER_BYTES]
            h = np.frombuffer(hb_, dtype=sf.REC_DTYPE)[0]
            ok = (h["magic"] == sf.REC_MAGIC and int(h["version"]) == sf.RECORD_FORMAT_VERSION
                  and _io.crc32c(hb_[:252]) == int(h["header_crc"]))
            if not ok:
                off += sf.RECORD_ALIGN  # resynchronise on the next record boundary
                continue
            rbytes, kb, tc = int(h["record_bytes"]), int(h["key_bytes"]), int(h["token_count"])
            # Every field is bounded before it sizes a read: a crafted header with a valid
            # CRC must not make recovery read gigabytes.
            T, P = self.identity.block_tokens, self.identity.block_bytes
            if (tc != T or kb > sf.MAX_KEY_BYTES or int(h["payload_bytes"]) != P
                    or rbytes != sf.record_geometry(T, kb, P)[1] or not sf.valid_record_id(int(h["record_id"]))
                    or int(h["parent_id"]) > sf.MAX_RECORD_ID):
                off += sf.RECORD_ALIGN
                continue
            span = sf.record_span(rbytes)
            if off + span > size:
                break  # truncated: the reads would come up short, so it is not indexed
            kstart = sf.REC_HEADER_BYTES + 4 * tc
            head = read_exact(fd, off, kstart + kb)
            key = head[kstart: kstart + kb]
            hb = int(h["hash_bytes"])
            rows.append(StoredRecord(int(h["record_id"]), int(h["parent_id"]), seg, off, span,
                             int(h["block_index"]), int(h["created_ns"]), self.index.key_id(key),
                             bytes(h["block_hash"])[:hb]))
            off += span
        return rows
