"""A hostile or damaged store directory (issue 10, section 3): links are never followed,
only regular files are opened, header fields are bounded before they size a read, a
mismatching store opened as "empty" is left untouched, and records of two stores merged
into one directory are never chained into each other."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from dsv41.cache.store import format as sf
from dsv41.cache.errors import StoreError
from dsv41.cache.hashing import BlockHasher
from dsv41.cache.store import PersistentStore

from .helpers import B, FP, LAYOUT, chain_payloads, identity, key, load_all, open_store, rand_tokens, token_rows, \
    write_chain

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
OUTSIDE = b"precious bytes outside the store\n" * 10


def outside_file(tmp_path) -> os.PathLike:
    p = tmp_path / "outside.txt"
    p.write_bytes(OUTSIDE)
    return p


def make_store(path, n_chains=2, seed=0):
    rng = np.random.default_rng(seed)
    with open_store(path) as st:
        chains = [write_chain(st, t, key()) + (t,) for t in (rand_tokens(rng, 3 * B) for _ in range(n_chains))]
    return chains


def segments(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if sf.parse_segment_name(n))


# ---- links ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [sf.JOURNAL_NAME, sf.LOCK_NAME])
def test_a_linked_journal_or_lock_is_refused_and_its_target_untouched(tmp_path, name):
    store = tmp_path / "store"
    make_store(store)
    target = outside_file(tmp_path)
    os.unlink(store / name)
    os.symlink(target, store / name)
    with pytest.raises(StoreError, match="symbolic link"):
        open_store(store)
    assert target.read_bytes() == OUTSIDE
    if name == sf.LOCK_NAME:
        with open_store(store, mode="r") as st:  # readers take no lock: still served
            assert len(st) == 6


def test_a_linked_manifest_is_refused_by_writer_reader_and_cli(tmp_path, capsys):
    from dsv41.cli import main
    store = tmp_path / "store"
    make_store(store)
    shutil.move(store / sf.MANIFEST_NAME, tmp_path / "manifest-elsewhere.json")
    os.symlink(tmp_path / "manifest-elsewhere.json", store / sf.MANIFEST_NAME)
    for mode in ("w", "r"):
        with pytest.raises(StoreError, match="symbolic link"):
            open_store(store, mode=mode)
    assert main(["cache", "stats", str(store)]) == 2
    assert "symbolic link" in capsys.readouterr().err


def test_a_linked_manifest_temp_file_is_replaced_not_followed(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    target = outside_file(tmp_path)
    os.symlink(target, store / (sf.MANIFEST_NAME + ".tmp"))
    with open_store(store) as st:
        write_chain(st, np.arange(2 * B, dtype="<u4"), key())
    assert target.read_bytes() == OUTSIDE
    with open_store(store, mode="r") as st:
        assert len(st) == 2


def test_a_linked_segment_is_skipped(tmp_path):
    store = tmp_path / "store"
    make_store(store)
    seg = segments(store)[0]
    shutil.move(store / seg, tmp_path / seg)
    os.symlink(tmp_path / seg, store / seg)
    with open_store(store, mode="r") as st:
        assert len(st) == 3 and st.counts["unusable_files"] == 1 and "symbolic link" in st.unusable[0]
    with open_store(store) as st:  # the writer too, and it leaves the link's target alone
        assert len(st) == 3
        st.gc(compact_dead_fraction=0.0)
    assert (tmp_path / seg).stat().st_size > 0 and os.path.islink(store / seg)


# ---- FIFOs and directories -------------------------------------------------------------------

def test_a_fifo_named_like_a_segment_hangs_nothing(tmp_path):
    """Run in a child process with a deadline: opening a FIFO blocks forever when it hangs."""
    store = tmp_path / "store"
    make_store(store)
    os.mkfifo(store / sf.segment_name(99, b"\x01" * 16))
    code = textwrap.dedent(f"""
        import sys, warnings
        sys.path.insert(0, {str(REPO)!r})
        from tests.cache.helpers import open_store
        from dsv41.cli import main
        with open_store({str(store)!r}, mode="r") as st:
            print("reader", len(st), st.counts["unusable_files"])
        with open_store({str(store)!r}) as st:
            print("writer", len(st), st.counts["unusable_files"])
        print("stats", main(["cache", "stats", {str(store)!r}]))
        print("verify", main(["cache", "verify", {str(store)!r}, "--no-progress"]))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "reader 6 1" in r.stdout and "writer 6 1" in r.stdout and "stats 0" in r.stdout
    assert "verify 1" in r.stdout and "FIFO" in r.stdout and "Traceback" not in r.stderr


def test_a_directory_named_like_a_segment_is_skipped_with_a_message(tmp_path):
    store = tmp_path / "store"
    make_store(store)
    (store / sf.segment_name(99, b"\x02" * 16)).mkdir()
    (store / ".tmp-seg-000000000123-x.dsv41").mkdir()  # and like a torn temp file
    with open_store(store, mode="r") as st:
        assert len(st) == 6 and st.counts["unusable_files"] == 1 and "a directory" in st.unusable[0]
    with open_store(store) as st:
        assert len(st) == 6 and st.counts["unusable_files"] == 2
        write_chain(st, np.arange(2 * B, dtype="<u4"), key())
    with open_store(store, mode="r") as st:
        assert len(st) == 8


# ---- bounded header fields ------------------------------------------------------------------

def _forge_record_in_damaged_segment(store, **fields) -> None:
    """Rewrites the first record header of the first segment with `fields` (valid CRC)
    and breaks the segment's trailer, so recovery scans record headers."""
    seg = store / segments(store)[0]
    with open(seg, "r+b") as f:
        f.seek(sf.PAGE)
        h = np.frombuffer(f.read(sf.REC_HEADER_BYTES), dtype=sf.REC_DTYPE).copy()
        for k, v in fields.items():
            h[0][k] = v
        raw = bytearray(h.tobytes())
        from dsv41.cache import io as _io
        raw[252:256] = _io.crc32c(bytes(raw[:252])).to_bytes(4, "little")
        f.seek(sf.PAGE)
        f.write(raw)
        f.seek(os.path.getsize(seg) - 100)
        f.write(b"\xde\xad")  # the trailer's checksum fails: scan


@pytest.mark.parametrize("fields", [{"key_bytes": (1 << 32) - 1}, {"token_count": (1 << 32) - 1},
                                    {"record_bytes": (1 << 32) - 1}, {"record_id": (1 << 64) - 1}])
def test_crafted_header_fields_never_size_a_read(tmp_path, monkeypatch, fields):
    store = tmp_path / "store"
    make_store(store)
    _forge_record_in_damaged_segment(store, **fields)
    biggest = [0]
    real = os.pread

    def pread(fd, n, off):
        biggest[0] = max(biggest[0], n)
        if n > 1 << 30:  # do not actually ask for gigabytes on a shared machine
            raise MemoryError(f"pread of {n} bytes")
        return real(fd, n, off)

    monkeypatch.setattr(os, "pread", pread)
    with open_store(store, mode="r") as st:
        assert st.counts["damaged_segments"] == 1
        assert len(st) == 3  # the forged record and its children are not indexed; the other chain is
    assert biggest[0] <= 1 << 20


def test_a_journal_record_id_of_2_64_minus_1_is_corruption(tmp_path):
    store = tmp_path / "store"
    make_store(store)
    with open(store / sf.JOURNAL_NAME, "ab") as f:
        f.write(sf.encode_journal(sf.J_ACCESS, (1 << 64) - 1, 1))
        f.write(sf.encode_journal(sf.J_WATERMARK, (1 << 64) - 1, 1, 5))
    with open_store(store) as st:
        assert st.counts["journal_torn_bytes"] == 64
        hashes, rids, _ = write_chain(st, np.arange(3 * B, dtype="<u4"), key())
        assert max(rids) < 100
    with open_store(store, mode="r") as st:
        assert len(st) == 9


# ---- on_mismatch="empty" --------------------------------------------------------------------

def test_empty_on_mismatch_touches_nothing_and_takes_no_lock(tmp_path):
    store = tmp_path / "store"
    make_store(store)
    before = {n: (store / n).read_bytes() for n in os.listdir(store)}
    other = identity(fp="another-model")
    with open_store(store) as rightful:  # the store's own writer holds the lock
        with pytest.warns(UserWarning, match="another model"):
            st = PersistentStore(store, other, mode="w", on_mismatch="empty", durability="none")
        assert len(st) == 0 and not st.writable
        st.close()
        write_chain(rightful, np.arange(2 * B, dtype="<u4"), key())  # still the writer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PersistentStore(store, other, mode="w", on_mismatch="empty").close()
    after = {n: (store / n).read_bytes() for n in before}
    assert after[sf.MANIFEST_NAME] == before[sf.MANIFEST_NAME]


# ---- a manifest rewritten for another model -------------------------------------------------

def test_verify_reports_segments_of_another_store(tmp_path, capsys):
    from dsv41.cli import main
    store = tmp_path / "store"
    make_store(store)
    m = json.loads((store / sf.MANIFEST_NAME).read_text())
    m["model_fingerprint"] = "0" * len(FP)
    m["checksum"] = sf.manifest_checksum(m)
    (store / sf.MANIFEST_NAME).write_text(json.dumps(m))
    assert main(["cache", "verify", str(store), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "2 segment(s) belong to another store" in out


# ---- two stores merged into one directory ---------------------------------------------------

def test_colliding_record_ids_trust_neither_copy(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    chains_a = make_store(a, n_chains=1, seed=1)
    chains_b = make_store(b, n_chains=1, seed=2)  # record ids 1..3 in both
    for n in segments(b):
        shutil.copy(b / n, a / n)
    with open_store(a) as st:
        assert st.counts["colliding_records"] == 6 and len(st) == 0
        for (_, _, _, tokens) in chains_a + chains_b:
            assert load_all(st, tokens, key())[0] == []
        write_chain(st, chains_a[0][3], key())  # new records get fresh ids
        assert len(load_all(st, chains_a[0][3], key())[0]) == 3
    from dsv41.cli import main
    assert main(["cache", "verify", str(a), "--no-progress"]) == 1
    assert "share an id" in capsys.readouterr().out


@pytest.mark.parametrize("out_kind", ["host", "tensor"])
def test_a_record_of_another_store_never_continues_a_chain(tmp_path, out_kind):
    """Store b holds a record whose id (3) and parent id (2) are free in store a, and
    whose block hash collides with the one a's chain would have there (a weak hash does
    this by chance; here it is forged). Copied into a, its parent id points at a's block 2:
    only its parent_hash shows it belongs to another chain."""
    a, b = tmp_path / "a", tmp_path / "b"
    rng = np.random.default_rng(3)
    hasher = BlockHasher(B)
    ta, tb, tail = rand_tokens(rng, 2 * B), rand_tokens(rng, 2 * B), rand_tokens(rng, B)
    with open_store(a) as st:
        write_chain(st, ta, key())
    with open_store(b) as st:
        hb, rids_b, _ = write_chain(st, tb, key())
        forged_hash = hasher.hash_blocks(np.concatenate([ta, tail]), key())[2]
        wrong = chain_payloads(np.concatenate([tb, tail]), key())[2]
        rid = st.put(key=key(), parent=rids_b[1], block_index=2, block_hash=forged_hash, parent_hash=hb[1],
                     tokens=tail, payload=wrong)
        st.commit()
        seg = st.record_info(rid)["segment"]
    shutil.copy(b / seg, a / seg)
    prompt = np.concatenate([ta, tail])
    with open_store(a) as st:
        assert rid in st
        hashes = hasher.hash_blocks(prompt, key())
        rows = token_rows(prompt, 3)
        if out_kind == "host":
            out = np.zeros((3, LAYOUT.block_bytes), np.uint8)
        else:
            out = torch.zeros((3, LAYOUT.block_bytes), dtype=torch.uint8)
        got = st.load(key(), hashes, rows, out)
        assert len(got) == 2 and rid not in st  # served a's two blocks, dropped the impostor
        assert not bool(out[2].any())  # the impostor's payload never stays in its row
        assert st.metrics.checksum_failures.value(kind="chain") == 1
