"""SegmentLayout: where a segment's records go and what its footer says, as arrays.

A commit of 64K-token prefixes holds thousands of records: the layout takes one Python step
per record at most. Records are packed back to back after the header page; chunks() says
which records each staging buffer of a streamed write holds.
"""
from __future__ import annotations

import numpy as np

from .. import io as _io
from . import format as sf

__all__ = ["SegmentLayout"]


class SegmentLayout:
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
    def for_new(cls, records: list, created: int, block_tokens: int, block_bytes: int) -> "SegmentLayout":
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
    def for_copies(cls, raw: list, index) -> "SegmentLayout":
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
