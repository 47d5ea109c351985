"""Byte-level on-disk format of the persistent prefix store (store format version 2,
record format version 1).

docs/cache.md ("On-disk format") is the prose version of this file; keep them in step.
All integers are little-endian. A store directory holds:

    MANIFEST.json            identity: formats, model fingerprint, layout (written once)
    LOCK                     flock'd by the one writer; holds its pid
    journal.log              32-byte entries: access times, deletions, id watermarks
    seg-<seq>-<uuid>.dsv41   immutable segment files, published by rename

Segment file (header, footer and trailer start on 4 KiB boundaries; records are packed):

    [0, 4096)               segment header (SEG_HEADER + superseded uuids + crc)
    [4096, records_end)     records back to back: each at the previous one's offset + its
                            span (record_bytes rounded up to RECORD_ALIGN = 64)
    [records_end, footer_offset)  zeros; footer_offset = records_end rounded up to 4096
    [footer_offset, ...)    footer: index of the records (FOOTER_ENTRY each) + key table
    last 4096 bytes         trailer (SEG_TRAILER + crc): where the footer is, its crc

Every read and write of a segment still covers whole 4 KiB pages at 4 KiB offsets (O_DIRECT):
a record is read as the page-aligned range around it, and the writer carries a chunk's
last partial page over into the next chunk's write.

Record (REC_HEADER, 256 bytes, then the data region):

    [0, 256)                header; data_crc at 248, header_crc at 252
    [256, 256 + 4 T)        token ids, uint32
    [.., + K)               the cache key encoding (namespace, model, format version)
    [payload_offset, +P)    the block payload (payload_offset = 64-byte aligned)
    record_bytes = payload_offset + P; zero fill to the span (a multiple of 64)

header_crc = CRC-32C of header bytes [0, 252); data_crc = CRC-32C of [256, record_bytes).
Both are verified on every read; together they cover every byte of the record.

Versions: STORE_FORMAT_VERSION is the store's (manifest, segment header and trailer);
version 1 padded every record to 4 KiB, so a version-1 store is refused at its manifest
like any other format mismatch. RECORD_FORMAT_VERSION is a record's own bytes, unchanged
by the packing (only where records lie changed), and shared with the remote tier's
values (cache/remote/record.py) and the C++ check (include/dsv41/record.h).
"""
from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass

import numpy as np

from .. import io as _io

__all__ = ["STORE_FORMAT_VERSION", "RECORD_FORMAT_VERSION", "RECORD_ALIGN", "PAGE", "REC_MAGIC", "REC_HEADER",
           "REC_HEADER_BYTES", "REC_DTYPE", "record_span", "record_geometry", "pack_record_headers", "SEG_MAGIC",
           "SEG_TRAILER_MAGIC", "FOOTER_DTYPE", "JOURNAL_ENTRY", "J_ACCESS", "J_DELETE", "J_WATERMARK",
           "encode_segment_header", "decode_segment_header", "encode_trailer", "decode_trailer", "encode_footer",
           "decode_footer", "encode_journal", "encode_journal_many",
           "decode_journal", "MANIFEST_NAME", "LOCK_NAME", "JOURNAL_NAME", "segment_name",
           "parse_segment_name", "manifest_checksum", "FormatError", "MAX_RECORD_ID", "MAX_KEY_BYTES",
           "MAX_SEGMENT_SEQ", "valid_record_id"]

STORE_FORMAT_VERSION = 2  # 2: records packed at RECORD_ALIGN (1: each padded to 4 KiB)
RECORD_FORMAT_VERSION = 1  # a record's bytes (include/dsv41/record.h kFormatVersion)
PAGE = _io.ALIGN  # 4096
PAYLOAD_ALIGN = 64
RECORD_ALIGN: int = _io.RECORD_ALIGN  # 64, from include/dsv41/record.h: the one definition
MANIFEST_NAME = "MANIFEST.json"
LOCK_NAME = "LOCK"
JOURNAL_NAME = "journal.log"


class FormatError(ValueError):
    """Bytes that are not a valid structure of this format."""


# ---- records ------------------------------------------------------------------------------

REC_MAGIC = b"DSV41REC"
#   magic, version u16, header_bytes u16, flags u32, record_id u64, parent_id u64,
#   created_ns u64, block_index u32, token_count u32, key_bytes u32, payload_offset u32,
#   payload_bytes u32, record_bytes u32, hash_bytes u8, 7 reserved, block_hash 32,
#   parent_hash 32, 112 reserved, data_crc u32, header_crc u32
REC_HEADER = struct.Struct("<8sHHIQQQIIIIIIB7s32s32s112sII")
REC_HEADER_BYTES = 256
assert REC_HEADER.size == REC_HEADER_BYTES
REC_DTYPE = np.dtype([
    ("magic", "S8"), ("version", "<u2"), ("header_bytes", "<u2"), ("flags", "<u4"),
    ("record_id", "<u8"), ("parent_id", "<u8"), ("created_ns", "<u8"), ("block_index", "<u4"),
    ("token_count", "<u4"), ("key_bytes", "<u4"), ("payload_offset", "<u4"), ("payload_bytes", "<u4"),
    ("record_bytes", "<u4"), ("hash_bytes", "u1"), ("_r0", "V7"), ("block_hash", "V32"),
    ("parent_hash", "V32"), ("_r1", "V112"), ("data_crc", "<u4"), ("header_crc", "<u4")])
assert REC_DTYPE.itemsize == REC_HEADER_BYTES


# Bounds on header fields, checked before a field sizes a read or an allocation. Record ids
# stay below 2^63 so that "the next id" always fits the u64 fields.
MAX_RECORD_ID = (1 << 63) - 1
MAX_KEY_BYTES = 1 << 16
MAX_SEGMENT_SEQ = 10 ** 12 - 1  # segment names hold 12 digits


def valid_record_id(rid: int) -> bool:
    return 0 < rid <= MAX_RECORD_ID


def record_span(record_bytes: int) -> int:
    """The bytes a record of `record_bytes` takes in a segment: the offset of the next one."""
    return -(-record_bytes // RECORD_ALIGN) * RECORD_ALIGN


@functools.lru_cache(maxsize=64)
def record_geometry(token_count: int, key_bytes: int, payload_bytes: int) -> tuple[int, int, int]:
    """(payload_offset, record_bytes, span) of a record."""
    payload_offset = -(-(REC_HEADER_BYTES + 4 * token_count + key_bytes) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
    record_bytes = payload_offset + payload_bytes
    return payload_offset, record_bytes, record_span(record_bytes)


def pack_record_header(*, record_id: int, parent_id: int, created_ns: int, block_index: int,
                       token_count: int, key_bytes: int, payload_offset: int, payload_bytes: int,
                       record_bytes: int, block_hash: bytes, parent_hash: bytes, data_crc: int = 0,
                       sealed: bool = True) -> bytes:
    """The 256-byte record header. sealed=False leaves data_crc and header_crc for the
    encoder to fill (IoEngine.encode_records computes both while it writes the record)."""
    head = REC_HEADER.pack(REC_MAGIC, RECORD_FORMAT_VERSION, REC_HEADER_BYTES, 0, record_id, parent_id,
                           created_ns, block_index, token_count, key_bytes, payload_offset, payload_bytes,
                           record_bytes, len(block_hash), b"", block_hash, parent_hash, b"", data_crc, 0)
    if not sealed:
        return head
    crc = _io.crc32c(memoryview(head)[:252])
    return head[:252] + crc.to_bytes(4, "little")


def pack_record_headers(*, record_ids, parent_ids, created_ns: int, block_indices, token_count: int,
                        key_bytes, payload_bytes: int, block_hashes: list[bytes],
                        parent_hashes: list[bytes]) -> np.ndarray:
    """The headers of many records at once, unsealed (data_crc and header_crc 0, for the
    encoder to fill): REC_DTYPE [n], byte for byte pack_record_header(sealed=False) of each.
    key_bytes is one length or one per record; the geometry follows record_geometry."""
    n = len(record_ids)
    kb = np.broadcast_to(np.asarray(key_bytes, dtype=np.int64), (n,))
    po = -(-(REC_HEADER_BYTES + 4 * token_count + kb) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
    h = np.zeros(n, REC_DTYPE)
    h["magic"] = REC_MAGIC
    h["version"] = RECORD_FORMAT_VERSION
    h["header_bytes"] = REC_HEADER_BYTES
    h["record_id"] = record_ids
    h["parent_id"] = parent_ids
    h["created_ns"] = created_ns
    h["block_index"] = block_indices
    h["token_count"] = token_count
    h["key_bytes"] = kb
    h["payload_offset"] = po
    h["payload_bytes"] = payload_bytes
    h["record_bytes"] = po + payload_bytes
    hash_len = list(map(len, block_hashes))
    h["hash_bytes"] = hash_len
    h["block_hash"] = _hash_column(block_hashes, hash_len)
    h["parent_hash"] = _hash_column(parent_hashes, list(map(len, parent_hashes)))
    return h


def _hash_column(hashes, lengths: list[int]) -> np.ndarray:
    """Hashes as one V32 column, each zero-padded to 32 bytes (SHA-256 hashes need none:
    then one join)."""
    if lengths.count(32) == len(lengths):
        return np.frombuffer(b"".join(hashes), "V32")
    return np.frombuffer(b"".join(x.ljust(32, b"\0") for x in hashes), "V32")


# ---- segments -----------------------------------------------------------------------------

SEG_MAGIC = b"DSV41SEG"
SEG_TRAILER_MAGIC = b"DSV41END"
# magic, version u16, pad u16, flags u32, uuid 16, seq u64, created_ns u64, store_id 32,
# record_count u32, superseded count u32; then superseded uuids (16 bytes each); crc at 4092.
SEG_HEADER = struct.Struct("<8sHHI16sQQ32sII")
MAX_SUPERSEDES = (PAGE - 4 - SEG_HEADER.size) // 16
# magic, version u16, pad u16, pad u32, uuid 16, footer_offset u64, footer_bytes u64,
# record_count u32, footer_crc u32; crc at 4092.
SEG_TRAILER = struct.Struct("<8sHHI16sQQII")
FOOTER_DTYPE = np.dtype([
    ("record_id", "<u8"), ("parent_id", "<u8"), ("offset", "<u8"), ("created_ns", "<u8"),
    ("record_bytes", "<u4"), ("block_index", "<u4"), ("key_index", "<u4"), ("token_count", "<u4"),
    ("hash_bytes", "u1"), ("_pad", "V7"), ("block_hash", "V32")])
assert FOOTER_DTYPE.itemsize == 88
_FOOTER_HEAD = struct.Struct("<II")  # entry count, key count


def _page_with_crc(body: bytes) -> bytes:
    if len(body) > PAGE - 4:
        raise FormatError("page body too large")
    page = body + bytes(PAGE - 4 - len(body))
    return page + _io.crc32c(page).to_bytes(4, "little")


def _check_page(page: bytes | memoryview, what: str) -> memoryview:
    page = memoryview(page)
    if len(page) != PAGE:
        raise FormatError(f"{what}: {len(page)} bytes, expected {PAGE}")
    if _io.crc32c(page[: PAGE - 4]) != int.from_bytes(page[PAGE - 4:], "little"):
        raise FormatError(f"{what}: checksum mismatch")
    return page


@dataclass
class SegmentHeader:
    uuid: bytes
    seq: int
    created_ns: int
    store_id: bytes
    record_count: int
    supersedes: list[bytes]


def encode_segment_header(h: SegmentHeader) -> bytes:
    if len(h.supersedes) > MAX_SUPERSEDES:
        raise FormatError(f"a segment supersedes at most {MAX_SUPERSEDES} others")
    body = SEG_HEADER.pack(SEG_MAGIC, STORE_FORMAT_VERSION, 0, 0, h.uuid, h.seq, h.created_ns,
                           h.store_id, h.record_count, len(h.supersedes)) + b"".join(h.supersedes)
    return _page_with_crc(body)


def decode_segment_header(page) -> SegmentHeader:
    page = _check_page(page, "segment header")
    magic, version, _, _, uuid, seq, created, store_id, count, nsup = SEG_HEADER.unpack_from(page)
    if magic != SEG_MAGIC:
        raise FormatError("segment header: bad magic")
    if version != STORE_FORMAT_VERSION:
        raise FormatError(f"segment header: format version {version}, expected {STORE_FORMAT_VERSION}")
    if nsup > MAX_SUPERSEDES:
        raise FormatError("segment header: bad superseded count")
    base = SEG_HEADER.size
    sup = [bytes(page[base + 16 * i: base + 16 * (i + 1)]) for i in range(nsup)]
    return SegmentHeader(uuid, seq, created, store_id, count, sup)


@dataclass
class SegmentTrailer:
    uuid: bytes
    footer_offset: int
    footer_bytes: int
    record_count: int
    footer_crc: int


def encode_trailer(t: SegmentTrailer) -> bytes:
    return _page_with_crc(SEG_TRAILER.pack(SEG_TRAILER_MAGIC, STORE_FORMAT_VERSION, 0, 0, t.uuid,
                                           t.footer_offset, t.footer_bytes, t.record_count, t.footer_crc))


def decode_trailer(page) -> SegmentTrailer:
    page = _check_page(page, "segment trailer")
    magic, version, _, _, uuid, off, nbytes, count, fcrc = SEG_TRAILER.unpack_from(page)
    if magic != SEG_TRAILER_MAGIC or version != STORE_FORMAT_VERSION:
        raise FormatError("segment trailer: bad magic or version")
    return SegmentTrailer(uuid, off, nbytes, count, fcrc)


def encode_footer(entries: np.ndarray, keys: list[bytes]) -> bytes:
    parts = [_FOOTER_HEAD.pack(len(entries), len(keys)), entries.astype(FOOTER_DTYPE, copy=False).tobytes()]
    for k in keys:
        parts += [len(k).to_bytes(4, "little"), k]
    return b"".join(parts)


def decode_footer(data: bytes | memoryview) -> tuple[np.ndarray, list[bytes]]:
    data = memoryview(data)
    if len(data) < _FOOTER_HEAD.size:
        raise FormatError("footer: too short")
    n, nkeys = _FOOTER_HEAD.unpack_from(data)
    pos = _FOOTER_HEAD.size
    end = pos + n * FOOTER_DTYPE.itemsize
    if end > len(data):
        raise FormatError("footer: entries overrun")
    entries = np.frombuffer(data[pos:end], dtype=FOOTER_DTYPE).copy()
    keys = []
    pos = end
    for _ in range(nkeys):
        if pos + 4 > len(data):
            raise FormatError("footer: key table overrun")
        k = int.from_bytes(data[pos: pos + 4], "little")
        pos += 4
        if pos + k > len(data):
            raise FormatError("footer: key overrun")
        keys.append(bytes(data[pos: pos + k]))
        pos += k
    if len(entries) and int(entries["key_index"].max()) >= len(keys):
        raise FormatError("footer: key index out of range")
    return entries, keys


def segment_name(seq: int, uuid: bytes) -> str:
    return f"seg-{seq:012d}-{uuid.hex()}.dsv41"


def parse_segment_name(name: str) -> tuple[int, bytes] | None:
    if not (name.startswith("seg-") and name.endswith(".dsv41")):
        return None
    parts = name[4:-6].split("-")
    if len(parts) != 2 or len(parts[0]) != 12 or len(parts[1]) != 32:
        return None
    try:
        return int(parts[0]), bytes.fromhex(parts[1])
    except ValueError:
        return None


# ---- journal ------------------------------------------------------------------------------

# crc u32 (over bytes 4..32), kind u8, 3 pad, record_id u64, time_ns u64, aux u64
JOURNAL_ENTRY = struct.Struct("<IB3xQQQ")
J_ACCESS, J_DELETE, J_WATERMARK = 1, 2, 3


def encode_journal(kind: int, record_id: int, time_ns: int, aux: int = 0) -> bytes:
    body = JOURNAL_ENTRY.pack(0, kind, record_id, time_ns, aux)[4:]
    return _io.crc32c(body).to_bytes(4, "little") + body


# JOURNAL_ENTRY as a numpy row (the test of encode_journal_many holds them equal).
_JOURNAL_DTYPE = np.dtype({"names": ["crc", "kind", "rid", "t", "aux"], "formats": ["<u4", "u1", "<u8", "<u8", "<u8"],
                           "offsets": [0, 4, 8, 16, 24], "itemsize": JOURNAL_ENTRY.size})


def encode_journal_many(kind: int, record_ids, time_ns: int) -> bytes:
    """encode_journal for many records at one time, in one pass (a load's access times: a
    64K-token prefix touches a thousand records; docs/cache.md, "TTL, LRU, capacity and
    GC", has the cost of each way)."""
    e = np.zeros(len(record_ids), _JOURNAL_DTYPE)
    e["kind"], e["rid"], e["t"] = kind, record_ids, time_ns
    raw = e.view(np.uint8)
    _io.crc32c_lead_rows(raw, JOURNAL_ENTRY.size)
    return raw.tobytes()


def decode_journal(data: bytes) -> tuple[list[tuple[int, int, int, int]], int]:
    """Valid entries (kind, record_id, time_ns, aux) and the byte length of the valid
    prefix (a torn or damaged entry ends it: later bytes were written after a crash cut
    the journal, or are damage)."""
    out = []
    n = len(data) // JOURNAL_ENTRY.size
    mv = memoryview(data)
    for i in range(n):
        e = mv[i * 32: (i + 1) * 32]
        crc = int.from_bytes(e[:4], "little")
        if _io.crc32c(e[4:]) != crc:
            return out, i * 32
        _, kind, rid, t, aux = JOURNAL_ENTRY.unpack(e)
        if kind not in (J_ACCESS, J_DELETE, J_WATERMARK) or not valid_record_id(rid) \
                or (kind == J_WATERMARK and aux > MAX_SEGMENT_SEQ):
            return out, i * 32  # out-of-range ids are damage, like a bad checksum
        out.append((kind, rid, t, aux))
    return out, n * 32


# ---- manifest -----------------------------------------------------------------------------

def manifest_checksum(fields: dict) -> str:
    body = {k: v for k, v in fields.items() if k != "checksum"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{_io.crc32c(canon):08x}"
