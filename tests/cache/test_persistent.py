"""PersistentStore: round trips, publication, the single-writer lock, readers, identity
checks, TTL and LRU, GC, disk full, and corruption (flipped bytes, truncation, deleted
files), which must be detected, counted, removed and never served."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

from dsv41.cache import io
from dsv41.cache.store import format as sf
from dsv41.cache.errors import PayloadError, StoreError, StoreLockedError, StoreMismatchError, StoreReadOnlyError
from dsv41.cache.hashing import BlockHasher
from dsv41.cache.layout import BlockLayout

from .helpers import (B, LAYOUT, TINY, chain_payloads, identity, key, load_all, open_store, rand_tokens,
                      token_rows, weak_hash, write_chain)


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def segments(path):
    return sorted(n for n in os.listdir(path) if sf.parse_segment_name(n))


def test_round_trip_and_restart(tmp_path):
    rng = np.random.default_rng(0)
    t = rand_tokens(rng, 6 * B + 5)
    with open_store(tmp_path, durability="fsync") as st:
        hashes, rids, pays = write_chain(st, t, key())
        got, out = load_all(st, t, key())
        assert got == rids and np.array_equal(out, pays)
        assert st.stats()["o_direct"] in (True, False)
    with open_store(tmp_path) as st:  # a restart rebuilds the index from the footers
        assert st.counts["recovered_records"] == 6 and st.counts["damaged_segments"] == 0
        got, out = load_all(st, t, key())
        assert got == rids and np.array_equal(out, pays)
        # A prefix that diverges in block 3 loads blocks 0-2 only.
        u = t.copy()
        u[3 * B + 1] ^= 1
        assert load_all(st, u, key())[0] == rids[:3]
        assert load_all(st, t, key("other"))[0] == []


@pytest.mark.parametrize("chunk_pages", [2, 3, 5, 64])
def test_segments_written_in_chunks_reopen_whole(tmp_path, monkeypatch, chunk_pages):
    """A segment goes out as chunk writes, the header with the first and footer and trailer
    with the last (or on their own when they do not fit): with chunks of a few pages the
    records, the header page and the tail split every way; the store reopens from the
    footer (no damaged segment) and every record and a compaction's copy verify."""
    from dsv41.cache.store import writer
    monkeypatch.setattr(writer, "WRITE_CHUNK", chunk_pages * io.ALIGN)
    rng = np.random.default_rng(chunk_pages)
    chains = [rand_tokens(rng, n * B) for n in (1, 4, 7)]
    with open_store(tmp_path, durability="fsync") as st:
        written = [write_chain(st, t, key(f"c{i}"), commit=False) for i, t in enumerate(chains)]
        st.commit()
        st._delete(written[1][1][0], "explicit")  # dead bytes, then compaction copies the rest
        st.gc(compact_dead_fraction=0.01)
    with open_store(tmp_path) as st:
        assert st.counts["damaged_segments"] == 0 and len(st) == 8
        assert st.verify()["corrupt"] == 0
        for i in (0, 2):
            got, out = load_all(st, chains[i], key(f"c{i}"))
            assert got == written[i][1] and np.array_equal(out, written[i][2])


def test_pending_records_are_invisible_until_commit(tmp_path):
    rng = np.random.default_rng(1)
    t = rand_tokens(rng, 3 * B)
    writer = open_store(tmp_path)
    reader = open_store(tmp_path, mode="r")
    hashes, rids, pays = write_chain(writer, t, key(), commit=False)
    assert load_all(writer, t, key())[0] == [] and segments(tmp_path) == []
    writer.commit()
    assert load_all(reader, t, key())[0] == []  # not refreshed yet
    assert reader.refresh()["added_segments"] == 1
    got, out = load_all(reader, t, key())
    assert got == rids and np.array_equal(out, pays)
    with pytest.raises(StoreReadOnlyError):
        reader.put(key=key(), parent=0, block_index=0, block_hash=b"x", parent_hash=b"y", tokens=t[:B],
                   payload=pays[0])
    writer.close()
    reader.close()


def test_single_writer_lock_names_the_owner(tmp_path):
    w = open_store(tmp_path)
    with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
        open_store(tmp_path)
    r = open_store(tmp_path, mode="r")  # readers need no lock
    r.close()
    # Another process is refused too, and takes over once the first writer is gone.
    code = ("import sys; sys.path.insert(0, 'python'); from dsv41.cache.store import PersistentStore\n"
            "from dsv41.cache.errors import StoreLockedError\n"
            f"try:\n    PersistentStore({str(tmp_path)!r}, None)\nexcept StoreLockedError as e:\n"
            "    print('LOCKED', e, flush=True)\n"
            "sys.stdin.readline()\n"
            f"PersistentStore({str(tmp_path)!r}, None).close(); print('OPENED', flush=True)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert first.startswith("LOCKED") and f"pid {os.getpid()}" in first, first + proc.stderr.read()
    w.close()
    out, err = proc.communicate("go\n", timeout=120)
    assert proc.returncode == 0 and "OPENED" in out, out + err


def test_identity_mismatches_are_refused_or_opened_empty(tmp_path):
    t = np.arange(2 * B, dtype="<u4")
    with open_store(tmp_path) as st:
        write_chain(st, t, key())
    other_model = identity(fp="0" * 64)
    with pytest.raises(StoreMismatchError, match="model_fingerprint"):
        open_store(tmp_path, identity=other_model)
    with pytest.raises(StoreMismatchError, match="block_tokens"):
        open_store(tmp_path, identity=identity(BlockLayout(TINY, 2 * B)))
    with pytest.raises(StoreMismatchError, match="hash_name"):
        open_store(tmp_path, identity=identity(hasher=BlockHasher(B, weak_hash, "weak")))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        st = open_store(tmp_path, identity=other_model, on_mismatch="empty")
    assert any("empty" in str(x.message) for x in w)
    assert len(st) == 0 and not st.writable and st.mismatch
    with pytest.raises(StoreReadOnlyError, match="mismatch"):
        st.put(key=key(), parent=0, block_index=0, block_hash=b"h", parent_hash=b"p", tokens=t[:B],
               payload=np.zeros(LAYOUT.block_bytes, np.uint8))
    st.close()
    # A newer on-disk format version is refused with the versions named.
    m = json.loads((tmp_path / sf.MANIFEST_NAME).read_text())
    m["store_format_version"] = 99
    m["checksum"] = sf.manifest_checksum(m)
    (tmp_path / sf.MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(StoreMismatchError, match="format version 99"):
        open_store(tmp_path)
    (tmp_path / sf.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(StoreError, match="damaged"):
        open_store(tmp_path)
    (tmp_path / sf.MANIFEST_NAME).unlink()
    with pytest.raises(StoreError, match="no MANIFEST"):
        open_store(tmp_path)


def test_put_checks(tmp_path):
    with open_store(tmp_path) as st:
        t = np.arange(B, dtype="<u4")
        with pytest.raises(PayloadError, match="bytes"):
            st.put(key=key(), parent=0, block_index=0, block_hash=b"h", parent_hash=b"p", tokens=t,
                   payload=np.zeros(5, np.uint8))
        with pytest.raises(PayloadError, match="token ids"):
            st.put(key=key(), parent=0, block_index=0, block_hash=b"h", parent_hash=b"p", tokens=t[:3],
                   payload=np.zeros(LAYOUT.block_bytes, np.uint8))
        with pytest.raises(KeyError, match="parent"):
            st.put(key=key(), parent=12345, block_index=1, block_hash=b"h", parent_hash=b"p", tokens=t,
                   payload=np.zeros(LAYOUT.block_bytes, np.uint8))


def test_put_chain_stores_what_block_by_block_puts_store(tmp_path):
    """put_chain of a whole prefix (one array), or of two runs (the second's payloads a list
    of tensors, its parent the first run's last record), stores the records put() would:
    the same parents, block indices, keys and hashes, the same verified payloads."""
    import torch

    rng = np.random.default_rng(3)
    t = rand_tokens(rng, 7 * B)
    hasher = BlockHasher(B)
    hashes = hasher.hash_blocks(t, key())
    with open_store(tmp_path / "puts") as ref:
        _, ref_rids, pays = write_chain(ref, t, key())
        want = [{k: v for k, v in ref.record_info(r).items() if k in ("block_index", "key", "hash")}
                for r in ref_rids]
        ref_parents = [ref.record_info(r)["parent_id"] for r in ref_rids]
    for how in ("one_call", "two_runs"):
        with open_store(tmp_path / how) as st:
            if how == "one_call":
                rids = st.put_chain(key=key(), parent=0, first_index=0, block_hashes=hashes,
                                    parent_hash=hasher.root(key()), tokens=t, payloads=pays)
            else:
                rids = st.put_chain(key=key(), parent=0, first_index=0, block_hashes=hashes[:3],
                                    parent_hash=hasher.root(key()), tokens=t[: 3 * B], payloads=pays[:3])
                rids += st.put_chain(key=key(), parent=rids[-1], first_index=3, block_hashes=hashes[3:],
                                     parent_hash=hashes[2], tokens=token_rows(t, 7)[3:],
                                     payloads=[torch.from_numpy(p.copy()) for p in pays[3:]])
            assert st.pending_bytes == 7 * LAYOUT.block_bytes
            st.commit()
            got, out = load_all(st, t, key())
            assert got == rids and np.array_equal(out, pays)
            infos = [st.record_info(r) for r in rids]
            assert [{k: v for k, v in i.items() if k in ("block_index", "key", "hash")} for i in infos] == want
            # The same shape of chain: each record's parent is the record of the block before.
            assert [rids.index(i["parent_id"]) if i["parent_id"] else None for i in infos] == \
                [ref_rids.index(p) if p else None for p in ref_parents]


def test_put_chain_checks_every_block_before_queueing_any(tmp_path):
    with open_store(tmp_path) as st:
        t = np.arange(3 * B, dtype="<u4")
        h = [b"a", b"b", b"c"]
        good = np.zeros((3, LAYOUT.block_bytes), np.uint8)
        args = dict(key=key(), parent=0, first_index=0, block_hashes=h, parent_hash=b"p")
        with pytest.raises(PayloadError, match="token ids"):
            st.put_chain(**args, tokens=t[:-1], payloads=good)
        with pytest.raises(PayloadError, match="bytes"):
            st.put_chain(**args, tokens=t, payloads=good[:, :-1])
        with pytest.raises(PayloadError, match="2 payloads for 3 blocks"):
            st.put_chain(**args, tokens=t, payloads=list(good[:2]))
        with pytest.raises(PayloadError, match="payload has"):
            st.put_chain(**args, tokens=t, payloads=[good[0], good[1], good[2, :5]])
        with pytest.raises(ValueError, match="32 bytes"):
            st.put_chain(**{**args, "block_hashes": [b"a", b"b" * 33, b"c"]}, tokens=t, payloads=good)
        with pytest.raises(KeyError, match="parent record 999"):
            st.put_chain(**{**args, "parent": 999, "first_index": 4}, tokens=t, payloads=good)
        assert st.pending_bytes == 0 and st.commit().persisted == []
        rids = st.put_chain(**args, tokens=t, payloads=good)
        assert rids == list(range(rids[0], rids[0] + 3)) and st.pending_bytes == 3 * LAYOUT.block_bytes
        assert st.commit().persisted == rids


def test_weak_hash_collisions_are_misses_never_wrong_payloads(tmp_path):
    hasher = BlockHasher(B, weak_hash, "weak")
    st = open_store(tmp_path, identity=identity(hasher=hasher))
    rng = np.random.default_rng(2)
    seqs = [rand_tokens(rng, 3 * B) for _ in range(120)]  # 360 blocks, 256 possible hashes
    written = [write_chain(st, s, key(), hasher) for s in seqs]
    for s, (hashes, rids, pays) in zip(seqs, written):
        got, out = load_all(st, s, key(), hasher)
        assert got == rids and np.array_equal(out, pays)
    # Requests never stored share 1-byte hashes with stored chains: only misses come back.
    for _ in range(100):
        probe = rand_tokens(rng, 3 * B)
        got, _ = load_all(st, probe, key(), hasher)
        assert got == []
    assert st.metrics.collisions.value(tier="ssd") > 0
    assert st.metrics.checksum_failures.total() == 0
    st.close()


def test_ttl_and_lru_capacity(tmp_path):
    clock = Clock()
    rng = np.random.default_rng(3)
    seqs = [rand_tokens(rng, 2 * B) for _ in range(6)]
    st = open_store(tmp_path, clock=clock, ttl_s=3600)
    for s in seqs:
        write_chain(st, s, key())
        clock.t += 10
    clock.t += 3600 - 35  # the first three chains are now older than the TTL
    assert [len(load_all(st, s, key())[0]) for s in seqs] == [0, 0, 0, 2, 2, 2]
    assert st.metrics.evictions.value(tier="ssd", cause="ttl") == 3  # their first blocks (+ orphans)
    st.close()
    # LRU under a byte cap: the least recently used chains go first, tails before heads.
    st = open_store(tmp_path, clock=clock, ttl_s=None)
    assert len(st) == 6  # three chains of two, the expired ones' deletions were journaled
    per = st.live_bytes() // 6
    clock.t += 1
    load_all(st, seqs[3], key())  # used again: the most recent now
    # The cap is one chain's segment file (its 2 records plus the header, footer and
    # trailer pages, which outweigh packed records this small); low_water keeps at most
    # 2.5 records' live bytes: two chains must go, and the third's segment then fits.
    seg_bytes = os.path.getsize(tmp_path / segments(tmp_path)[-1])
    st.capacity_bytes = seg_bytes
    rep = st.gc(low_water=2.5 * per / seg_bytes)
    assert rep["evicted"] == 4 and len(st) == 2
    assert len(load_all(st, seqs[3], key())[0]) == 2
    assert st.file_bytes() <= st.capacity_bytes
    st.close()


def test_journal_keeps_deletions_and_access_times_across_restarts(tmp_path):
    clock = Clock()
    t1, t2 = np.arange(2 * B, dtype="<u4"), np.arange(2 * B, 4 * B, dtype="<u4")
    with open_store(tmp_path, clock=clock) as st:
        _, r1, _ = write_chain(st, t1, key())
        write_chain(st, t2, key())
        clock.t += 100
        load_all(st, t1, key())
        st._delete(st.walk(key(), BlockHasher(B).hash_blocks(t2, key()))[0], "explicit")
    with open_store(tmp_path, clock=clock) as st:
        assert st.record_ids() == r1
        assert all(st.record_info(r)["atime_ns"] == int(clock.t * 1e9) for r in r1)
        # New record ids never reuse old ones.
        _, r3, _ = write_chain(st, np.arange(4 * B, 5 * B, dtype="<u4"), key())
        assert r3[0] > max(r1) + 2


def test_gc_compacts_mostly_dead_segments_and_keeps_live_records(tmp_path):
    rng = np.random.default_rng(4)
    # The fourth chain is long enough that its segment is mostly live: with packed records
    # of this tiny layout a 4-record segment is mostly header, footer and trailer pages.
    seqs = [rand_tokens(rng, 4 * B) for _ in range(3)] + [rand_tokens(rng, 12 * B)]
    st = open_store(tmp_path)
    hasher = BlockHasher(B)
    for s in seqs[:3]:  # three chains in one segment
        write_chain(st, s, key(), commit=False)
    st.commit()
    _, r4, p4 = write_chain(st, seqs[3], key())
    assert len(segments(tmp_path)) == 2
    before = st.file_bytes()
    for s in seqs[:2]:  # two of the three chains in segment 1 die
        st._delete(st.walk(key(), hasher.hash_blocks(s, key()))[0], "explicit")
    rep = st.gc()
    assert rep["segments_compacted"] == 1 and st.file_bytes() < before
    assert len(segments(tmp_path)) == 2 and len(st) == 4 + 12
    st.close()
    with open_store(tmp_path) as st:
        for s in seqs[2:]:
            got, out = load_all(st, s, key())
            assert len(got) == len(s) // B and np.array_equal(out, chain_payloads(s, key()))
        assert st.counts["superseded_segments"] == 0 and st.verify()["corrupt"] == 0


def test_disk_full_degrades_without_losing_what_is_stored(tmp_path):
    rng = np.random.default_rng(5)
    t1, t2 = rand_tokens(rng, 3 * B), rand_tokens(rng, 3 * B)
    eng = io.IOEngine(2)
    clock = Clock()
    st = open_store(tmp_path, engine=eng, clock=clock)
    _, r1, p1 = write_chain(st, t1, key())
    eng.set_faults(io.FAULT_NO_SPACE, nospace_after=io.ALIGN)  # room for one more page
    with pytest.warns(RuntimeWarning, match="not persisted"):
        _, r2, _ = write_chain(st, t2, key())
    assert st.degraded and "no_space" in st.degraded_reason
    assert st.metrics.persist_failures.value(cause="no_space") == 1
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert load_all(st, t2, key())[0] == [] and load_all(st, t1, key())[0] == r1
    eng.set_faults(0)
    clock.t += 31  # the retry delay passes: writes resume
    _, r2, p2 = write_chain(st, t2, key())
    assert load_all(st, t2, key())[0] == r2
    st.close()


def test_rlimit_fsize_in_a_subprocess_degrades(tmp_path):
    """A real EFBIG from the kernel (RLIMIT_FSIZE), not an injected one."""
    code = f"""
import resource, signal, sys, warnings
sys.path.insert(0, 'python'); sys.path.insert(0, '.')
import numpy as np
from tests.cache.helpers import open_store, write_chain, key, load_all, B
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
st = open_store({str(tmp_path)!r})
t1 = np.arange(2 * B, dtype='<u4')
write_chain(st, t1, key())
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter('always')
    write_chain(st, np.arange(2 * B, 12 * B, dtype='<u4'), key())
print('WARN' if any('not persisted' in str(x.message) for x in w) else 'NOWARN', st.degraded_reason)
print('OLD', len(load_all(st, t1, key())[0]))
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "WARN no_space" in r.stdout and "OLD 2" in r.stdout, r.stdout


@pytest.mark.parametrize("direct", [True, False])
def test_buffered_and_refused_direct_paths_store_the_same_bytes(tmp_path, direct):
    eng = io.IOEngine(2)
    if direct:
        eng.set_faults(io.FAULT_REFUSE_DIRECT_OPEN)  # the filesystem refuses O_DIRECT
    t = np.arange(3 * B, dtype="<u4")
    with open_store(tmp_path, engine=eng, direct=direct) as st:
        _, rids, pays = write_chain(st, t, key())
        got, out = load_all(st, t, key())
        assert got == rids and np.array_equal(out, pays)
        assert st.stats()["o_direct"] is False
    assert eng.counters()["direct_fallbacks"] >= (1 if direct else 0)


# ---- corruption ----------------------------------------------------------------------------

def _store_with_chains(path, n_chains=6, blocks=3, seed=0):
    rng = np.random.default_rng(seed)
    seqs = [rand_tokens(rng, blocks * B) for _ in range(n_chains)]
    with open_store(path) as st:
        for i, s in enumerate(seqs):
            write_chain(st, s, key(), commit=False)
            if i % 2:
                st.commit()  # several segments
    return seqs


def _check_served(st, seqs):
    """Every block served equals what was written; returns blocks served per chain."""
    served = []
    for s in seqs:
        got, out = load_all(st, s, key())
        want = chain_payloads(s, key())[: len(got)]
        assert np.array_equal(out, want)
        served.append(len(got))
    return served


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_a_row_whose_record_fails_holds_no_unverified_bytes(tmp_path):
    """The host read copies a payload into its row in the pass that checksums it; a record
    that then fails its CRC leaves its row zeroed, never holding the damaged bytes."""
    rng = np.random.default_rng(5)
    t = rand_tokens(rng, 3 * B)
    with open_store(tmp_path) as st:
        hashes, rids, pays = write_chain(st, t, key())
        info = st.record_info(rids[1])
        po = sf.record_geometry(B, len(key()), LAYOUT.block_bytes)[0]
        _flip(tmp_path / info["segment"], info["offset"] + po + 100)
        out = np.full((3, LAYOUT.block_bytes), 0xAB, np.uint8)
        got = st.load(key(), hashes, token_rows(t, 3), out)
        assert got == rids[:1] and np.array_equal(out[0], pays[0])
        assert not out[1].any()  # the flipped payload was copied, then cleared
        assert st.metrics.checksum_failures.value(kind="checksum") == 1


def test_random_byte_flips_are_detected_counted_and_never_served(tmp_path):
    seqs = _store_with_chains(tmp_path, n_chains=8)
    rng = np.random.default_rng(7)
    st = open_store(tmp_path)
    infos = [st.record_info(r) for r in st.record_ids()]
    st.close()
    # One damaged record in each of six chains (records of chain c are 3c .. 3c + 2).
    victims = [3 * c + int(rng.integers(0, 3)) for c in rng.choice(8, 6, replace=False)]
    regions = ["header", "tokens", "key", "payload", "payload", "padding-free"]
    po, rb, _ = sf.record_geometry(B, len(key()), LAYOUT.block_bytes)
    for v, region in zip(victims, regions):
        info = infos[v]
        lo, hi = {"header": (0, 256), "tokens": (256, 256 + 4 * B), "key": (256 + 4 * B, 256 + 4 * B + len(key())),
                  "payload": (po, rb), "padding-free": (po, rb)}[region]
        _flip(tmp_path / info["segment"], info["offset"] + int(rng.integers(lo, hi)))
    st = open_store(tmp_path)
    served = _check_served(st, seqs)
    failures = st.metrics.checksum_failures.total()
    assert failures == 6
    assert st.metrics.evictions.value(tier="ssd", cause="corruption") == 6
    assert sum(served) <= 8 * 3 - 6
    # They are gone for good: a second pass finds no new failure, and verify agrees.
    _check_served(st, seqs)
    assert st.metrics.checksum_failures.total() == 6 and st.verify()["corrupt"] == 0
    st.close()


def test_verify_finds_corruption_without_serving(tmp_path):
    _store_with_chains(tmp_path, n_chains=2)
    st = open_store(tmp_path)
    info = st.record_info(st.record_ids()[1])
    st.close()
    po = sf.record_geometry(B, len(key()), LAYOUT.block_bytes)[0]
    _flip(tmp_path / info["segment"], info["offset"] + po + 3)
    with open_store(tmp_path, mode="r") as st:
        seen = []
        rep = st.verify(progress=lambda d, t: seen.append((d, t)))
        assert rep["corrupt"] == 1 and rep["failed"] == {"checksum": 1}
        assert seen[-1][0] == seen[-1][1] == rep["bytes"]
    with open_store(tmp_path) as st:
        assert st.verify(repair=True)["corrupt"] == 1
        assert st.verify()["corrupt"] == 0 and len(st) == 6 - 2  # the record and its child


def test_truncated_and_deleted_segments(tmp_path):
    seqs = _store_with_chains(tmp_path, n_chains=6)
    names = segments(tmp_path)
    assert len(names) == 3
    st = open_store(tmp_path)
    # While open: one file loses its tail, another disappears.
    p0 = tmp_path / names[0]
    os.truncate(p0, os.path.getsize(p0) - 3 * sf.PAGE - 100)
    os.unlink(tmp_path / names[1])
    served = _check_served(st, seqs)
    assert st.metrics.checksum_failures.value(kind="truncated") >= 1
    assert st.metrics.checksum_failures.value(kind="missing") == 2  # first blocks of its two chains
    assert served[2:4] == [0, 0] and sum(served) < 18
    st.close()
    # After a restart: the damaged file is scanned (no trailer), the missing one is gone.
    st = open_store(tmp_path)
    assert st.counts["damaged_segments"] == 1
    served = _check_served(st, seqs)
    assert served[2:4] == [0, 0] and served[4:] == [3, 3]
    assert st.verify()["corrupt"] == 0
    st.close()


def test_damaged_footer_falls_back_to_scanning(tmp_path):
    seqs = _store_with_chains(tmp_path, n_chains=2)
    name = segments(tmp_path)[0]
    size = os.path.getsize(tmp_path / name)
    with open(tmp_path / name, "rb") as f:
        f.seek(size - sf.PAGE)
        trailer = sf.decode_trailer(f.read(sf.PAGE))
    _flip(tmp_path / name, trailer.footer_offset + 20)  # inside the footer
    with open_store(tmp_path) as st:
        assert st.counts["damaged_segments"] == 1
        assert _check_served(st, seqs) == [3, 3] and st.metrics.checksum_failures.total() == 0
    _flip(tmp_path / name, 10)  # segment header too
    with open_store(tmp_path, mode="r") as st:
        assert _check_served(st, seqs) == [3, 3]
        rep = st.verify()
        assert rep["corrupt"] == 0 and rep["damaged_segments"] == 1


def test_concurrent_readers_and_writer_threads(tmp_path):
    rng = np.random.default_rng(9)
    seqs = [rand_tokens(rng, 3 * B) for _ in range(24)]
    st = open_store(tmp_path)
    errors = []
    written = threading.Event()

    def writer():
        try:
            for s in seqs:
                write_chain(st, s, key())
            written.set()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
            written.set()

    def reader():
        try:
            while not written.is_set():
                for s in seqs:
                    got, out = load_all(st, s, key())
                    assert np.array_equal(out, chain_payloads(s, key())[: len(got)])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert _check_served(st, seqs) == [3] * 24
    st.close()


def test_the_device_read_path_runs_on_the_cpu_too(tmp_path):
    """read_into is the GPUDirect Storage path (SSD -> device memory, CRC on the device,
    heads checked on the host). On a CPU tensor it runs the same steps with pread and the
    host CRC, so its logic is tested here even though no GPU is."""
    import torch

    hasher = BlockHasher(B, weak_hash, "weak")
    rng = np.random.default_rng(11)
    seqs = [rand_tokens(rng, 4 * B) for _ in range(40)]
    st = open_store(tmp_path, identity=identity(hasher=hasher))
    written = [write_chain(st, s, key(), hasher) for s in seqs]
    for s, (hashes, rids, pays) in zip(seqs, written):
        dst = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8)
        got = st.load(key(), hashes, token_rows(s, 4), dst)
        assert got == rids and np.array_equal(dst.numpy(), pays)
    for _ in range(30):  # weak-hash look-alikes: misses, never wrong payloads
        probe = rand_tokens(rng, 4 * B)
        dst = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8)
        assert st.load(key(), hasher.hash_blocks(probe, key()), token_rows(probe, 4), dst) == []
    assert st.metrics.collisions.value(tier="ssd") > 0
    # A flipped payload byte is caught by the data CRC (computed "on the device").
    info = st.record_info(written[0][1][2])
    po = sf.record_geometry(B, len(key()), LAYOUT.block_bytes)[0]
    _flip(tmp_path / info["segment"], info["offset"] + po + 17)
    dst = torch.zeros(4, LAYOUT.block_bytes, dtype=torch.uint8)
    got = st.load(key(), written[0][0], token_rows(seqs[0], 4), dst)
    assert got == written[0][1][:2] and np.array_equal(dst[:2].numpy(), written[0][2][:2])
    assert st.metrics.checksum_failures.value(kind="checksum") == 1
    st.close()
