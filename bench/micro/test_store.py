"""Persistent store records: encode + write (put x N, commit) and read + verify (both
CRC-32Cs, token ids and key compared, payload copied out), each beside the raw file I/O of
the same bytes (os.pwrite / os.pread), so the ratio is what the record format costs on
top of the I/O. Page cache, durability "none": the CPU side, not the SSD."""
from __future__ import annotations

import os

import numpy as np
import pytest

from dsv41.cache import CacheConfig, PersistentStore, PrefixCache
from dsv41.config import ModelConfig

BLOCK = 64
RECORDS = 64


@pytest.fixture(scope="module")
def identity():
    cache = PrefixCache(ModelConfig.preset("v41-flash"),
                        CacheConfig(block_tokens=BLOCK, device="cpu", gpu_capacity_bytes=1 << 24,
                                    swa_capacity_bytes=0))
    ident = cache.identity
    key, hashes = cache.key(), cache.hasher.hash_blocks(_tokens().reshape(-1), cache.key())
    cache.close()
    return ident, key, [cache.hasher.root(key)] + hashes


def _tokens() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 129_280, (RECORDS, BLOCK)).astype("<u4")


def _payloads(block_bytes: int) -> np.ndarray:
    return np.random.default_rng(2).integers(0, 256, (RECORDS, block_bytes), dtype=np.uint8)


def _open(path, ident) -> PersistentStore:
    return PersistentStore(path, ident, durability="none", direct=False, io_threads=1)


def _write(store, key, hashes, tok, pay) -> list[int]:
    parent, rids = 0, []
    for j in range(RECORDS):
        parent = store.put(key=key, parent=parent, block_index=j, block_hash=hashes[j + 1],
                           parent_hash=hashes[j], tokens=tok[j], payload=pay[j])
        rids.append(parent)
    res = store.commit()
    assert len(res.persisted) == RECORDS
    return rids


@pytest.mark.parametrize("impl", ["store", "raw_pwrite"])
def test_record_encode_write(benchmark, tmp_path, identity, impl):
    benchmark.group = f"store-write-{RECORDS}-records"
    ident, key, hashes = identity
    tok, pay = _tokens(), _payloads(ident.block_bytes)
    rounds = iter(range(1_000_000))

    if impl == "store":
        def setup():
            return (_open(tmp_path / f"s{next(rounds)}", ident),), {}

        def run(store):
            _write(store, key, hashes, tok, pay)
            store.close()
    else:
        data = pay.tobytes()

        def setup():
            fd = os.open(tmp_path / f"raw{next(rounds)}", os.O_CREAT | os.O_WRONLY, 0o644)
            return (fd,), {}

        def run(fd):
            os.pwrite(fd, data, 0)
            os.close(fd)
    benchmark.pedantic(run, setup=setup, rounds=30, warmup_rounds=2)


@pytest.mark.parametrize("impl", ["store", "raw_pread"])
def test_record_read_verify(benchmark, tmp_path, identity, impl):
    benchmark.group = f"store-read-verify-{RECORDS}-records"
    ident, key, hashes = identity
    tok, pay = _tokens(), _payloads(ident.block_bytes)
    if impl == "store":
        store = _open(tmp_path / "s", ident)
        rids = _write(store, key, hashes, tok, pay)
        out = np.empty_like(pay)
        status = benchmark(store.read, rids, tok, key, out)
        assert status == ["ok"] * RECORDS and np.array_equal(out, pay)
        store.close()
    else:
        path = tmp_path / "raw"
        path.write_bytes(pay.tobytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            assert len(benchmark(os.pread, fd, pay.nbytes, 0)) == pay.nbytes
        finally:
            os.close(fd)
