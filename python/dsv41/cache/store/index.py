"""The in-memory index of a store: which records exist, where, and how they chain.

Nothing here touches a file or takes a lock: the facade (store.py) holds its index lock
around every call. Records are found by (parent record id, block hash); a chain's first
block has parent 0 and is told apart by its key (kept once per distinct key).
"""
from __future__ import annotations

import logging
from typing import Callable

__all__ = ["SegmentFile", "StoredRecord", "RecordIndex"]

log = logging.getLogger("dsv41.cache.store")


class SegmentFile:
    """One segment file of the store as the index knows it (not the model's Segment of a
    forward batch, nor a layout's payload array)."""

    __slots__ = ("uuid", "seq", "name", "file_bytes", "live_bytes", "rids", "fd", "direct", "damaged")

    def __init__(self, uuid: bytes, seq: int, name: str, file_bytes: int):
        self.uuid, self.seq, self.name, self.file_bytes = uuid, seq, name, file_bytes
        self.live_bytes = 0
        self.rids: set[int] = set()
        self.fd: int | None = None
        self.direct = False
        self.damaged = False  # footer unusable: indexed by scanning record headers


class StoredRecord:
    """Where one record lives and what the index needs to match and verify it."""

    # offset: where the record starts in its segment (a multiple of RECORD_ALIGN); span:
    # the bytes it takes there (format.record_span), which live-byte counts add up.
    __slots__ = ("rid", "parent", "seg", "offset", "span", "block_index", "created_ns", "atime_ns",
                 "key_id", "hash")

    def __init__(self, rid, parent, seg, offset, span, block_index, created_ns, key_id, hash_):
        self.rid, self.parent, self.seg, self.offset, self.span = rid, parent, seg, offset, span
        self.block_index, self.created_ns, self.atime_ns = block_index, created_ns, created_ns
        self.key_id, self.hash = key_id, hash_


def _add_to(d: dict, k, rid: int) -> None:
    """Adds rid under k of a one-or-many dict (_members)."""
    cur = d.get(k)
    if cur is None:
        d[k] = rid
    elif type(cur) is int:
        d[k] = [cur, rid]
    else:
        cur.append(rid)


def _remove_from(d: dict, k, rid: int) -> None:
    """Removes rid from under k of a one-or-many dict, if it is there."""
    cur = d.get(k)
    if cur is None:
        return
    if type(cur) is int:
        if cur == rid:
            del d[k]
        return
    if rid in cur:
        cur.remove(rid)
        if len(cur) == 1:
            d[k] = cur[0]  # back to the untracked form


def _members(v) -> tuple | list:
    """The ids a one-or-many dict holds under a key (its get(), possibly None)."""
    if v is None:
        return ()
    return (v,) if type(v) is int else v


class RecordIndex:
    """Record id -> StoredRecord, plus the two ways to walk between records. Both of those
    map a key to one id (an int) or, rarely, to a list of several: almost every record has
    one child, and an int is not a container the garbage collector tracks, where a list or
    set per record was two more tracked objects each. Invariant: one tracked object per
    record (its StoredRecord), since a full collection walks every tracked object and
    stalls every thread meanwhile (docs/cache.md, Known limits, has what that costs;
    tests/cache/test_record_index.py holds the bound)."""

    def __init__(self):
        self.recs: dict[int, StoredRecord] = {}
        self.children: dict[tuple[int, bytes], int | list[int]] = {}  # (parent id, block hash) -> id(s)
        self.kids: dict[int, int | list[int]] = {}                     # parent id -> child id(s)
        self.keys: list[bytes] = []
        self.key_ids: dict[bytes, int] = {}
        self.live_total = 0
        self.colliding: set[int] = set()  # ids found in two segments with different contents

    def __len__(self) -> int:
        return len(self.recs)

    def __contains__(self, rid: int) -> bool:
        return rid in self.recs

    def key_id(self, key: bytes) -> int:
        kid = self.key_ids.get(key)
        if kid is None:
            kid = self.key_ids[key] = len(self.keys)
            self.keys.append(key)
        return kid

    def candidates(self, parent: int, block_hash: bytes) -> tuple | list:
        """Ids of the records under `parent` whose block hash is block_hash, oldest first."""
        return _members(self.children.get((parent, block_hash)))

    def child_ids(self, parent: int) -> tuple | list:
        """Ids of every record whose parent is `parent`."""
        return _members(self.kids.get(parent))

    def add(self, r: StoredRecord) -> None:
        self.add_many((r,))

    def add_many(self, rows) -> None:
        """add() of each row, none of them indexed yet (a commit's fresh records)."""
        recs, children, kids = self.recs, self.children, self.kids
        for r in rows:
            rid = r.rid
            recs[rid] = r
            _add_to(children, (r.parent, r.hash), rid)
            if r.parent:
                _add_to(kids, r.parent, rid)
            seg = r.seg
            seg.rids.add(rid)
            seg.live_bytes += r.span
            self.live_total += r.span

    def remove(self, r: StoredRecord) -> None:
        self.recs.pop(r.rid, None)
        _remove_from(self.children, (r.parent, r.hash), r.rid)
        if r.parent:
            _remove_from(self.kids, r.parent, r.rid)
        if r.rid in r.seg.rids:
            r.seg.rids.discard(r.rid)
            r.seg.live_bytes -= r.span
            self.live_total -= r.span

    def remove_subtree(self, r: StoredRecord) -> list[StoredRecord]:
        """Removes a record and every record below it (unreachable without it); returns
        them, `r` first."""
        stack, removed = [r], []
        while stack:
            cur = stack.pop()
            stack.extend(self.recs[k] for k in list(self.child_ids(cur.rid)) if k in self.recs)
            self.remove(cur)
            removed.append(cur)
        return removed

    def remove_segment(self, seg: SegmentFile) -> None:
        for rid in list(seg.rids):
            if rid in self.recs:
                self.remove(self.recs[rid])

    def add_rows(self, rows: list[StoredRecord], counts: dict,
                 same_bytes: Callable[[StoredRecord, StoredRecord], bool]) -> None:
        """Indexes one segment's records (recovery and refresh). A record id that is
        already indexed is either the same record twice (a compaction's verbatim copy
        whose superseded list was lost: same identity, same creation time, and
        same_bytes() finds their headers byte-identical, data CRC included; the newer
        copy is kept) or two records that share an id: two stores merged into one
        directory. Their identities can agree (a weak hash collides, and then so does the
        parent hash that should stop a chain from continuing into the other store), so
        only the bytes tell them apart. Neither copy can be trusted: both are dropped, and
        so is any later record with that id; their children become orphans."""
        for r in rows:
            if r.rid in self.colliding:
                counts["colliding_records"] += 1
                continue
            old = self.recs.get(r.rid)
            if old is not None:
                same = (old.parent, old.hash, old.block_index, old.key_id, old.created_ns) == \
                    (r.parent, r.hash, r.block_index, r.key_id, r.created_ns)
                if same and old.seg is not r.seg and same_bytes(old, r):
                    counts["duplicate_records"] += 1
                    if old.seg.seq > r.seg.seq:
                        continue
                    self.remove(old)
                else:
                    log.warning("record id %d is in %s and %s with different contents (two stores merged "
                                "into one directory?): neither copy is used", r.rid, old.seg.name, r.seg.name)
                    self.colliding.add(r.rid)
                    counts["colliding_records"] += 2
                    self.remove(old)
                    continue
            self.add(r)

    def drop_orphans(self) -> list[int]:
        """Removes records whose parent is gone (they can never be reached), parents first."""
        orphans = []
        for r in sorted(self.recs.values(), key=lambda r: r.block_index):
            if r.parent and r.parent not in self.recs:
                orphans.append(r.rid)
                self.remove(r)
        return orphans

    def walk(self, key: bytes, hashes: list[bytes], parent: int, exclude: set[int] | None,
             oldest_ns: float | None) -> tuple[list[StoredRecord], list[int]]:
        """(records of the longest chain matching `hashes` below `parent`, ids passed over
        because their last use is before oldest_ns). One dict lookup per block on the usual
        path (one candidate, an int): a 64K-token prefix walks a thousand blocks."""
        out, expired = [], []
        kid = self.key_ids.get(key)
        if kid is None and parent == 0:
            return out, expired
        recs, children = self.recs, self.children.get
        for h in hashes:
            found = None
            v = children((parent, h))
            for rid in ((v,) if type(v) is int else v or ()):
                r = recs[rid]
                if (exclude and rid in exclude) or (parent == 0 and r.key_id != kid):
                    continue
                if oldest_ns is not None and r.atime_ns < oldest_ns:
                    expired.append(rid)
                    continue
                found = r
                break
            if found is None:
                break
            out.append(found)
            parent = found.rid
        return out, expired
