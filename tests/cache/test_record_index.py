"""RecordIndex: how records are found under their parent, and what the index costs the
garbage collector (one tracked object per record: its StoredRecord)."""
from __future__ import annotations

import gc

from dsv41.cache.store.index import RecordIndex, SegmentFile, StoredRecord

SEG = SegmentFile(b"u" * 16, 1, "seg", 0)


def rec(rid: int, parent: int, h: bytes) -> StoredRecord:
    return StoredRecord(rid, parent, SEG, 4096 + 64 * rid, 64, 0, 1, 0, h)


def test_candidates_children_and_removal_with_one_and_several_ids():
    ix = RecordIndex()
    ix.add_many([rec(1, 0, b"a"), rec(2, 1, b"b"), rec(3, 1, b"b"), rec(4, 1, b"c"), rec(5, 2, b"d")])
    # Two records under one (parent, hash) (a weak-hash collision): both, oldest first.
    assert list(ix.candidates(1, b"b")) == [2, 3]
    assert list(ix.candidates(1, b"c")) == [4] and list(ix.candidates(9, b"x")) == []
    assert sorted(ix.child_ids(1)) == [2, 3, 4] and list(ix.child_ids(5)) == []
    # One id is kept as a bare int, never a container the collector tracks.
    assert ix.children[(1, b"c")] == 4 and ix.kids[2] == 5
    ix.remove(ix.recs[2])
    assert list(ix.candidates(1, b"b")) == [3] and ix.children[(1, b"b")] == 3
    assert sorted(ix.child_ids(1)) == [3, 4]
    ix.remove(ix.recs[3])
    ix.remove(ix.recs[4])
    assert (1, b"b") not in ix.children and 1 not in ix.kids
    # remove_subtree takes every record below, and only those.
    ix2 = RecordIndex()
    ix2.add_many([rec(1, 0, b"a"), rec(2, 1, b"b"), rec(3, 2, b"c"), rec(4, 1, b"d"), rec(6, 0, b"z")])
    assert sorted(r.rid for r in ix2.remove_subtree(ix2.recs[1])) == [1, 2, 3, 4]
    assert list(ix2.recs) == [6] and ix2.kids == {} and list(ix2.children) == [(0, b"z")]
    assert ix2.live_total == 64 and 6 in SEG.rids


def test_walk_follows_the_oldest_candidate_and_skips_excluded_ones():
    ix = RecordIndex()
    kid = ix.key_id(b"key")
    rows = [rec(1, 0, b"a"), rec(2, 1, b"b"), rec(3, 1, b"b"), rec(4, 3, b"c")]
    for r in rows:
        r.key_id = kid
    ix.add_many(rows)
    def ids(walked):
        chain, expired = walked
        return [r.rid for r in chain], expired

    assert ids(ix.walk(b"key", [b"a", b"b", b"c"], 0, None, None)) == ([1, 2], [])
    assert ids(ix.walk(b"key", [b"a", b"b", b"c"], 0, {2}, None)) == ([1, 3, 4], [])
    assert ids(ix.walk(b"key", [b"a", b"x"], 0, None, None)) == ([1], [])  # no record under (1, x)
    assert ids(ix.walk(b"other key", [b"a"], 0, None, None)) == ([], [])
    rows[0].atime_ns = 5
    assert ids(ix.walk(b"key", [b"a", b"b"], 0, None, 10)) == ([], [1])  # last used before the TTL bound


def test_an_index_adds_one_tracked_object_per_record():
    gc.collect()
    before = len(gc.get_objects())
    ix = RecordIndex()
    n = 20_000
    ix.add_many([rec(i + 1, i, i.to_bytes(32, "little")) for i in range(n)])
    gc.collect()  # untracks the (parent, hash) key tuples, whose items are all atomic
    grown = len(gc.get_objects()) - before
    # Other tests' garbage freed meanwhile can only lower `grown`: the upper bound holds
    # in any process, and the index's own objects are counted exactly.
    assert grown < 1.05 * n, grown
    assert sum(map(gc.is_tracked, ix.recs.values())) == n
    assert not any(map(gc.is_tracked, [*ix.children, *ix.children.values(), *ix.kids.values()]))
