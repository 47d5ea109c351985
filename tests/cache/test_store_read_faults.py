"""A failed read never removes a record (issue 28, item 3).

An I/O error, a short read, a segment that would not open (EMFILE, EACCES) or a failed
device read is a miss: counted in read_errors, and the next read serves the record. Only
bytes proven damaged (header, data CRC, the link to the parent, a file shorter than the
record) remove a record. The faults are injected into the C++ read engine
(IOEngine.inject_fault), at every position of a load, on the host path (a numpy row
buffer) and on the device path (a tensor: read_into, which the CPU runs with pread).

The store of these tests is the one the losses were reproduced on: 32 records, 8 chains
of 4 blocks, in 4 segments.
"""
from __future__ import annotations

import errno

import numpy as np
import pytest
import torch

from dsv41.cache.hashing import BlockHasher
from dsv41.cache.store import format as sf

from .helpers import B, LAYOUT, chain_payloads, key, open_store, rand_tokens, token_rows, write_chain

N_CHAINS, BLOCKS = 8, 4


@pytest.fixture(scope="module")
def seqs():
    rng = np.random.default_rng(28)
    return [rand_tokens(rng, BLOCKS * B) for _ in range(N_CHAINS)]


def _build(path, seqs) -> None:
    with open_store(path) as st:
        for i, s in enumerate(seqs):
            write_chain(st, s, key(), commit=False)
            if i % 2:
                st.commit()  # two chains a segment
        assert len(st) == N_CHAINS * BLOCKS


def _load(st, s, device_path: bool) -> tuple[list[int], np.ndarray]:
    hashes = BlockHasher(B).hash_blocks(s, key())
    if device_path:
        out = torch.zeros((BLOCKS, LAYOUT.block_bytes), dtype=torch.uint8)
        got = st.load(key(), hashes, token_rows(s, BLOCKS), out)
        return got, out.numpy()[: len(got)]
    out = np.zeros((BLOCKS, LAYOUT.block_bytes), np.uint8)
    got = st.load(key(), hashes, token_rows(s, BLOCKS), out)
    return got, out[: len(got)]


def _load_all(st, seqs, device_path: bool) -> list[int]:
    """Loads every chain; whatever is served is the right bytes. Returns blocks served."""
    served = []
    for s in seqs:
        got, rows = _load(st, s, device_path)
        assert np.array_equal(rows, chain_payloads(s, key())[: len(got)])
        served.append(len(got))
    return served


def _assert_all_there(path, seqs, device_path: bool = False) -> None:
    """Nothing was removed, in memory or in the journal: every record is served, now and
    after a restart."""
    with open_store(path) as st:
        assert len(st) == N_CHAINS * BLOCKS
        assert _load_all(st, seqs, device_path) == [BLOCKS] * N_CHAINS
        assert st.metrics.checksum_failures.total() == 0


def _read_chunks_of_a_full_load(path, seqs, device_path: bool) -> int:
    with open_store(path) as st:
        before = st.stats()["io"]["read_ops"]
        _load_all(st, seqs, device_path)
        return st.stats()["io"]["read_ops"] - before


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("err", [errno.EIO, 0], ids=["eio", "short"])
def test_a_failed_read_at_any_position_removes_nothing(tmp_path, seqs, device_path, err):
    _build(tmp_path, seqs)
    positions = _read_chunks_of_a_full_load(tmp_path, seqs, device_path)
    assert positions >= N_CHAINS
    for k in range(positions):
        with open_store(tmp_path) as st:
            st.engine.inject_fault("read", err, skip=k)
            served = _load_all(st, seqs, device_path)
            assert len(st) == N_CHAINS * BLOCKS, f"position {k}: records removed"
            assert st.metrics.checksum_failures.total() == 0
            assert st.metrics.evictions.total() == 0
            assert st.metrics.read_errors.total() >= 1, f"position {k}: the failed read was not counted"
            if device_path:
                # The host path served what the device read missed, in the same call.
                assert served == [BLOCKS] * N_CHAINS
            else:
                assert sum(served) < N_CHAINS * BLOCKS
                # The next read serves the record.
                assert _load_all(st, seqs, device_path) == [BLOCKS] * N_CHAINS
        _assert_all_there(tmp_path, seqs, device_path)


def test_one_eio_from_the_host_read_removes_nothing(tmp_path, seqs):
    """Reproduced before the fix: one EIO removed the 4 records of the chain read."""
    _build(tmp_path, seqs)
    with open_store(tmp_path) as st:
        st.engine.inject_fault("read", errno.EIO)
        got, _ = _load(st, seqs[0], device_path=False)
        assert got == [] and len(st) == N_CHAINS * BLOCKS
        assert st.metrics.read_errors.value(tier="ssd", kind="read") == BLOCKS
        assert _load(st, seqs[0], device_path=False)[0] != []
    _assert_all_there(tmp_path, seqs)


def test_one_eio_from_the_device_read_step_is_served_by_the_host_path(tmp_path, seqs):
    """Reproduced before the fix: one EIO from the device path's read step removed 4
    records. Now the host path serves them in the same call and the device path steps
    aside for this store, naming why."""
    _build(tmp_path, seqs)
    with open_store(tmp_path) as st:
        st.engine.inject_fault("read", errno.EIO)
        got, rows = _load(st, seqs[0], device_path=True)
        assert len(got) == BLOCKS and np.array_equal(rows, chain_payloads(seqs[0], key()))
        assert st.metrics.read_errors.value(tier="ssd", kind="device") == BLOCKS
        assert st.device_path_reason is not None and "Input/output error" in st.device_path_reason
        assert st.stats()["device_path"].startswith("stepped aside: ")
        assert not st.gds_available
        # Later reads into tensors take the host path and are served.
        assert _load_all(st, seqs, device_path=True) == [BLOCKS] * N_CHAINS
    _assert_all_there(tmp_path, seqs)


@pytest.mark.parametrize("err", [errno.EMFILE, errno.EACCES], ids=["emfile", "eacces"])
@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device"])
def test_segments_that_will_not_open_remove_nothing(tmp_path, seqs, err, device_path):
    """Reproduced before the fix: the fd limit reached while opening segments (EMFILE),
    or one unreadable segment (EACCES), removed all 32 records, for good (journaled)."""
    _build(tmp_path, seqs)
    with open_store(tmp_path) as st:
        st.engine.inject_fault("open", err, count=1_000_000)  # every open fails
        assert _load_all(st, seqs, device_path) == [0] * N_CHAINS
        assert len(st) == N_CHAINS * BLOCKS
        assert st.metrics.read_errors.value(tier="ssd", kind="open") >= N_CHAINS
        st.engine.inject_fault("open", err, count=0)
        assert _load_all(st, seqs, device_path) == [BLOCKS] * N_CHAINS
    with open_store(tmp_path) as st:
        st.engine.inject_fault("open", err, count=1)  # one segment, once
        _load_all(st, seqs, device_path)
        assert len(st) == N_CHAINS * BLOCKS
    _assert_all_there(tmp_path, seqs)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device"])
def test_damaged_bytes_still_remove_the_record(tmp_path, seqs, device_path):
    """The rule has one exception, and it still holds: a payload byte flipped on disk fails
    the data CRC on both paths, and the record goes with its subtree. The device path
    does not step aside: the host read confirmed the damage."""
    _build(tmp_path, seqs)
    with open_store(tmp_path) as st:
        hashes = BlockHasher(B).hash_blocks(seqs[3], key())
        rid = st.walk(key(), hashes)[1]
        info = st.record_info(rid)
    po = sf.record_geometry(B, len(key()), LAYOUT.block_bytes)[0]
    _flip(tmp_path / info["segment"], info["offset"] + po + 7)
    with open_store(tmp_path) as st:
        got, _ = _load(st, seqs[3], device_path)
        assert len(got) == 1
        assert st.metrics.checksum_failures.value(kind="checksum") == 1
        assert len(st) == N_CHAINS * BLOCKS - (BLOCKS - 1)
        assert st.device_path_reason is None
    with open_store(tmp_path) as st:  # for good
        assert len(st) == N_CHAINS * BLOCKS - (BLOCKS - 1)


def test_gc_compaction_with_a_failed_read_removes_nothing(tmp_path, seqs):
    _build(tmp_path, seqs)
    with open_store(tmp_path) as st:
        # Half of every segment dead: GC rewrites the live halves, reading them first.
        for s in seqs[::2]:
            st.delete(st.walk(key(), BlockHasher(B).hash_blocks(s, key()))[0], "explicit")
        st.engine.inject_fault("read", errno.EIO)
        rep = st.gc()
        assert rep["corrupt_dropped"] == 0
        assert len(st) == N_CHAINS // 2 * BLOCKS
        assert _load_all(st, seqs[1::2], False) == [BLOCKS] * (N_CHAINS // 2)
        assert st.gc()["segments_compacted"] >= 1  # the next GC does the work
        assert _load_all(st, seqs[1::2], False) == [BLOCKS] * (N_CHAINS // 2)


def test_verify_repair_reports_a_failed_read_and_removes_nothing(tmp_path, seqs):
    _build(tmp_path, seqs)
    with open_store(tmp_path) as st:
        st.engine.inject_fault("read", errno.EIO)
        rep = st.verify(repair=True)
        assert rep["failed"].get("io", 0) >= 1 and rep["corrupt"] == 0
        assert len(st) == N_CHAINS * BLOCKS
    _assert_all_there(tmp_path, seqs)
