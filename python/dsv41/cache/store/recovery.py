"""Opening a store's files (recovery) and a reader's later look (refresh), both through
the one SegmentLoader. Recovery deletes what a crash left (writer), drops superseded
segments, indexes the rest (ids claimed twice: see RecordIndex.add_rows), replays the
journal and drops orphans; refresh picks up segments published and removed since.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import files as _files
from . import format as sf
from .journal import apply_entries

if TYPE_CHECKING:
    from .store import PersistentStore

__all__ = ["recover", "refresh"]


def recover(store: PersistentStore) -> None:
    names = sorted(os.listdir(store.path))
    if store.mode == "w":
        for n in names:
            if n.startswith(".tmp-"):  # a commit or compaction cut short by a crash
                try:
                    _files.unlink_if_present(store.path / n)
                    store.counts["torn_temp_files"] += 1
                except _files.NotRegularFileError as e:
                    store._unusable(n, e)
    loaded, loader = [], store._loader()
    for n in names:
        parsed = sf.parse_segment_name(n)
        if parsed is None:
            continue
        seg_info = loader.load(n, *parsed)
        if seg_info is not None:
            loaded.append(seg_info)
    superseded = {u for (_, hdr, _) in loaded for u in hdr.supersedes}
    rec_rows = []
    for seg, hdr, rows in sorted(loaded, key=lambda x: x[0].seq):
        store._next_seq = max(store._next_seq, seg.seq + 1)
        if seg.uuid in superseded:
            # A compaction published its replacement but died before unlinking this one.
            store.counts["superseded_segments"] += 1
            if store.mode == "w":
                _files.unlink_if_present(store.path / seg.name)
            continue
        store._segs[seg.uuid] = seg
        rec_rows.append((seg, hdr, rows))
    max_rid = 0
    for seg, hdr, rows in rec_rows:
        max_rid = max([max_rid] + [r.rid for r in rows])
        store._ix.add_rows(rows, store.counts, loader.same_bytes)
    entries = store._journal.open()
    store.counts["journal_torn_bytes"] = store._journal.torn_bytes
    deleted, store._next_rid, store._next_seq = apply_entries(entries, store._ix.recs, store._next_rid,
                                                            store._next_seq)
    for rid in deleted:
        r = store._ix.recs.get(rid)
        if r is not None:
            store._ix.remove(r)
    orphans = store._ix.drop_orphans()
    store.counts["orphans_dropped"] = len(orphans)
    if store.mode == "w":
        now = store._now_ns()
        for rid in orphans:
            store._journal.append(sf.J_DELETE, rid, now)
        store._journal.flush()
    store._next_rid = max(store._next_rid, max_rid + 1)
    store.counts["recovered_records"] = len(store._ix.recs)
    store.counts["recovered_segments"] = len(store._segs)


def refresh(store: PersistentStore) -> dict:
    """Reader: index segments published since the last look, forget removed ones, and
    apply new journal entries. Returns what changed."""
    if store.mode != "r" or store.mismatch is not None:
        return {"added_segments": 0, "removed_segments": 0}
    names = set(os.listdir(store.path))
    added = removed = 0
    with store._lock:
        known = {s.name for s in store._segs.values()}
        for s in list(store._segs.values()):
            if s.name not in names:
                store._ix.remove_segment(s)
                store._retire([s], unlink=False)
                removed += 1
        loader = store._loader()
        for n in sorted(names - known):
            parsed = sf.parse_segment_name(n)
            if parsed is None or any(n in u for u in store.unusable):
                continue
            info = loader.load(n, *parsed)
            if info is None:
                continue
            seg, hdr, rows = info
            for u in hdr.supersedes:
                old = store._segs.get(u)
                if old is not None:
                    store._ix.remove_segment(old)
                    store._retire([old], unlink=False)
            store._segs[seg.uuid] = seg
            store._ix.add_rows(rows, store.counts, loader.same_bytes)
            added += 1
        deleted, store._next_rid, store._next_seq = apply_entries(store._journal.read_new(), store._ix.recs,
                                                                store._next_rid, store._next_seq)
        for rid in deleted:
            r = store._ix.recs.get(rid)
            if r is not None:
                store._ix.remove(r)
    return {"added_segments": added, "removed_segments": removed}
