"""Opening a store's files (recovery) and a reader's later look (refresh), both through
the one SegmentLoader. Recovery deletes what a crash left (writer), drops superseded
segments, indexes the rest (ids claimed twice: see RecordIndex.add_rows), replays the
journal and drops orphans; refresh picks up segments published and removed since.
"""
from __future__ import annotations

import os
from . import files as _files
from . import format as sf
from .fds import SegmentFds
from .journal import apply_entries
from .state import StoreState

__all__ = ["recover", "refresh"]


def recover(state: StoreState) -> None:
    """Indexes what the directory holds (the state's journal is open for the writer)."""
    names = sorted(os.listdir(state.path))
    if state.mode == "w":
        for n in names:
            if n.startswith(".tmp-"):  # a commit or compaction cut short by a crash
                try:
                    _files.unlink_if_present(state.path / n)
                    state.counts["torn_temp_files"] += 1
                except _files.NotRegularFileError as e:
                    state.note_unusable(n, e)
    loaded, loader = [], state.loader()
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
        state.next_seq = max(state.next_seq, seg.seq + 1)
        if seg.uuid in superseded:
            # A compaction published its replacement but died before unlinking this one.
            state.counts["superseded_segments"] += 1
            if state.mode == "w":
                _files.unlink_if_present(state.path / seg.name)
            continue
        state.segments[seg.uuid] = seg
        rec_rows.append((seg, hdr, rows))
    max_rid = 0
    for seg, hdr, rows in rec_rows:
        max_rid = max([max_rid] + [r.rid for r in rows])
        state.index.add_rows(rows, state.counts, loader.same_bytes)
    entries = state.journal.open()
    state.counts["journal_torn_bytes"] = state.journal.torn_bytes
    deleted, state.next_rid, state.next_seq = apply_entries(entries, state.index.recs, state.next_rid,
                                                            state.next_seq)
    for rid in deleted:
        r = state.index.recs.get(rid)
        if r is not None:
            state.index.remove(r)
    orphans = state.index.drop_orphans()
    state.counts["orphans_dropped"] = len(orphans)
    if state.mode == "w":
        now = state.now_ns()
        for rid in orphans:
            state.journal.append(sf.J_DELETE, rid, now)
        state.journal.flush()
    state.next_rid = max(state.next_rid, max_rid + 1)
    state.counts["recovered_records"] = len(state.index.recs)
    state.counts["recovered_segments"] = len(state.segments)


def refresh(state: StoreState, fds: SegmentFds) -> dict:
    """Reader: index segments published since the last look, forget removed ones, and
    apply new journal entries. Returns what changed."""
    if state.mode != "r" or state.mismatch is not None:
        return {"added_segments": 0, "removed_segments": 0}
    names = set(os.listdir(state.path))
    added = removed = 0
    with state.lock:
        known = {s.name for s in state.segments.values()}
        for s in list(state.segments.values()):
            if s.name not in names:
                state.index.remove_segment(s)
                fds.retire([s], unlink=False)
                removed += 1
        loader = state.loader()
        for n in sorted(names - known):
            parsed = sf.parse_segment_name(n)
            if parsed is None or any(n in u for u in state.unusable):
                continue
            info = loader.load(n, *parsed)
            if info is None:
                continue
            seg, hdr, rows = info
            for u in hdr.supersedes:
                old = state.segments.get(u)
                if old is not None:
                    state.index.remove_segment(old)
                    fds.retire([old], unlink=False)
            state.segments[seg.uuid] = seg
            state.index.add_rows(rows, state.counts, loader.same_bytes)
            added += 1
        deleted, state.next_rid, state.next_seq = apply_entries(state.journal.read_new(), state.index.recs,
                                                                state.next_rid, state.next_seq)
        for rid in deleted:
            r = state.index.recs.get(rid)
            if r is not None:
                state.index.remove(r)
    return {"added_segments": added, "removed_segments": removed}
