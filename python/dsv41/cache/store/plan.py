"""Planning a verified read: which I/O ops read which records, and what each must be.

Both read paths (host: reads.RecordReader, device: device.DevicePath) group the records
that lie back to back in one segment into one op (plan_reads), and hand each record's
expectation (identity, and the link to its parent) to the C++ check (dsv41/record.h).
"""
from __future__ import annotations

from typing import Callable

from .. import io as _io
from . import format as sf
from .fds import SegmentFds
from .state import StoreState

__all__ = ["plan_reads", "RECORD_STATUS", "DAMAGED", "GROUP_BYTES"]

# Contiguous records read by one op. A read's time follows the number of disk requests
# more than their size, so one op covers as many records as a raw read of their bytes
# would, and the checks of one op run while the others are still being read. What 512 KiB
# and 1 MiB ops measured: docs/performance.md#what-moved-the-reads-and-writes-no-json.
GROUP_BYTES = 1 << 20
RECORD_STATUS = _io.RECORD_STATUS  # "ok", "truncated", "header", "checksum", "collision", "chain"
# Statuses that prove the bytes on disk are not the record the index holds: the record is
# removed (with its subtree). "missing" (its segment file is gone) forgets it in memory
# only; "io" (a read that failed) proves nothing and removes nothing.
DAMAGED = frozenset(("truncated", "header", "checksum", "chain"))


def _parent_hash(get: Callable, r) -> bytes | None:
    """What a record spec carries for the parent link (dsv41/record.h, checked in C++ with
    the rest of the record): the block hash of the record the index holds under r's
    parent id (None when it holds none: the check fails), or b"" for a chain's first
    record (nothing to check). Ids alone are not enough: two stores merged into one
    directory reuse ids, and a chain must never continue into the other store's records.
    `get` is the index's lookup, called under the state lock."""
    if not r.parent:
        return b""
    p = get(r.parent)
    return None if p is None else p.hash


def plan_reads(state: StoreState, fds: SegmentFds, recs: list, status: list[str],
               links: bool) -> tuple[list[list], dict]:
    """The grouping and each record's spec for read_records in one pass (a 64K-token
    prefix is a thousand records, and this Python runs before its first read): returns
    [segment, file offset, size, [record index, ...], end of its last record, [spec,
    ...]] per I/O, and the segments' fds. Call under state.lock. A record that is None
    gets status "missing"; one whose segment will not open, "missing" (the file is gone)
    or "io" (EMFILE, EACCES, a link in its place: nothing proven, counted). The parent
    link of a record that follows its parent in `recs` (a chain) is checked against that
    record's hash, which the same read verifies; otherwise against the index's."""
    opened: dict[bytes, int | str] = {}
    groups: list[list] = []
    get, g, prev, page = state.index.recs.get, None, None, sf.PAGE
    for i, r in enumerate(recs):
        if r is None:
            status[i] = "missing"
            prev = None
            continue
        seg = r.seg
        fd = opened.get(seg.uuid)
        if fd is None:
            try:
                fd = opened[seg.uuid] = fds.fd(seg)
            except FileNotFoundError:  # the file is gone
                fd = opened[seg.uuid] = "missing"
            except OSError:  # EMFILE, EACCES, a link or FIFO in its place: nothing proven
                fd = opened[seg.uuid] = "io"
        if type(fd) is str:
            status[i] = fd
            if fd == "io":
                state.metrics.read_errors.inc(tier="ssd", kind="open")
            prev = None
            continue
        off, span, parent = r.offset, r.span, r.parent
        end = off + span
        if g is not None and g[0] is seg and g[4] == off and -(-end // page) * page - g[1] <= GROUP_BYTES:
            g[2] = -(-end // page) * page - g[1]
            g[3].append(i)
            g[4] = end
        else:
            lo = off // page * page
            g = [seg, lo, -(-end // page) * page - lo, [i], end, []]
            groups.append(g)
        if not links or not parent:
            ph = b""
        elif prev is not None and prev.rid == parent:
            ph = prev.hash
        else:
            ph = _parent_hash(get, r)
        g[5].append((off - g[1], span, r.rid, parent, r.block_index, r.hash, i, ph))
        prev = r
    return groups, opened
