"""Block puts as RecordBatch (put_records): the Mooncake backend encodes the records into a
staging buffer registered with its client and sends them with batch_put_from. What the
store then holds, read with the raw client, must be encode_record's bytes; a full store is
RemoteFull; the staging buffer grows, splits a batch larger than its cap, and a put that
finds it taken (a put that outlived its deadline still sending) goes through put().
The per-key return codes are checked against a stand-in client, the rest against a real
Mooncake master and storage process on 127.0.0.1."""
from __future__ import annotations

import numpy as np
import pytest

from dsv41.cache.remote.base import RemoteBackend, RemoteError, RemoteFull
from dsv41.cache.remote.mooncake import MooncakeBackend
from dsv41.cache.remote.record import RecordBatch, chain_ids, encode_record, verify_records

from ..remote_env import local_servers

KEY = b"dsv41-test-key:" + b"m" * 40
T = 16


def batch(n: int, nbytes: int, seed: int = 0) -> tuple[RecordBatch, list[bytes], np.ndarray, list[bytes], list[int]]:
    """A RecordBatch of n chained blocks, encode_record's bytes for each, and what a reader
    checks them against (tokens, hashes, chain ids)."""
    g = np.random.default_rng(seed)
    tok = g.integers(0, 30000, size=(n, T), dtype=np.uint32)
    pay = g.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    hashes = [g.bytes(32) for _ in range(n)]
    parents = [b"r" * 32] + hashes[:-1]
    chain = chain_ids(tok, KEY)
    b = RecordBatch(key=KEY, tokens=tok, payloads=pay, block_indices=range(n), block_hashes=hashes,
                    parent_hashes=parents, chain_ids=chain, parent_chains=[0] + chain[:-1], created_ns=11)
    one = [bytes(encode_record(key=KEY, tokens=tok[i], payload=pay[i], block_index=i, block_hash=hashes[i],
                               parent_hash=parents[i], chain_id=chain[i], parent_chain=chain[i - 1] if i else 0,
                               created_ns=11)) for i in range(n)]
    return b, one, tok, hashes, chain


def test_record_batch_encodes_encode_records_bytes_whole_in_parts_and_in_slices():
    b, one, *_ = batch(5, 3000)
    assert len(b) == 5 and b.nbytes == 5 * len(one[0]) == 5 * b.record_bytes
    assert [bytes(v) for v in b.values()] == one
    assert [b"".join(bytes(p) for p in v) for v in b.values(parts=True)] == one
    out = np.empty((3, b.record_bytes), dtype=np.uint8)
    b.encode_into(out, 1, 4)
    assert [bytes(r) for r in out] == one[1:4]
    for bad in (np.empty((2, b.record_bytes), np.uint8), np.empty((3, b.record_bytes + 1), np.uint8),
                np.empty((3, 2 * b.record_bytes), np.uint8)[:, ::2]):
        with pytest.raises(ValueError):
            b.encode_into(bad, 1, 4)


class _FakeStore:
    """The calls put_records makes, answering the codes a test sets (per key)."""

    def __init__(self, codes=None):
        self.codes, self.puts, self.registered, self.sent = codes, [], {}, []

    def register_buffer(self, addr, size):
        self.registered[addr] = size
        return 0

    def unregister_buffer(self, addr):
        del self.registered[addr]
        return 0

    def _from(self, keys, addrs, sizes, how):
        assert all(any(a <= x and x + s <= a + n for a, n in self.registered.items()) for x, s in zip(addrs, sizes)), \
            "sent from memory that is not registered"
        self.sent.append((how, list(keys)))
        return list(self.codes.pop(0)) if self.codes else [0] * len(keys)

    def batch_put_from(self, keys, addrs, sizes):
        return self._from(keys, addrs, sizes, "put_from")

    def batch_upsert_from(self, keys, addrs, sizes):
        return self._from(keys, addrs, sizes, "upsert_from")

    def put_batch(self, keys, values):
        self.puts.append(("put_batch", list(keys), [bytes(v) for v in values]))
        return 0

    def upsert_batch(self, keys, values):
        self.puts.append(("upsert_batch", list(keys), [bytes(v) for v in values]))
        return 0

    def close(self):
        pass


def _fake_backend(codes=None, **opts) -> MooncakeBackend:
    q = "&".join(f"{k}={v}" for k, v in opts.items())
    be = MooncakeBackend("mooncake://127.0.0.1:1" + (f"?{q}" if q else ""))
    be._store = _FakeStore(codes)
    return be


def test_mooncake_put_records_checks_every_keys_return_code():
    b, *_ = batch(4, 1000)
    keys = [f"k{i}" for i in range(4)]
    _fake_backend().put_records(keys, b)                       # all 0: stored
    with pytest.raises(RemoteFull):                            # -200 for some: no space, not a fault
        _fake_backend([[0, -200, 0, -200]]).put_records(keys, b)
    with pytest.raises(RemoteError) as e:                      # any other code is an error
        _fake_backend([[0, 0, -900, 0]]).put_records(keys, b)
    assert not isinstance(e.value, RemoteFull)
    with pytest.raises(RemoteError) as e:                      # an error beside -200 is still an error
        _fake_backend([[-200, -900, 0, 0]]).put_records(keys, b)
    assert not isinstance(e.value, RemoteFull)
    be = _fake_backend()
    be.put_records(keys, b, overwrite=True)
    assert be._store.sent == [("upsert_from", keys)]
    with pytest.raises(ValueError):
        be.put_records(keys[:3], b)


def test_mooncake_put_records_splits_at_the_staging_cap_and_stops_at_a_failure():
    b, *_ = batch(7, 1000)
    keys = [f"k{i}" for i in range(7)]
    be = _fake_backend(staging_bytes=3 * b.record_bytes)
    be.put_records(keys, b)
    assert [k for _, k in be._store.sent] == [keys[0:3], keys[3:6], keys[6:7]]
    assert be._staging.nbytes == 3 * b.record_bytes            # capped: not grown to the batch
    be = _fake_backend([[0, 0, 0], [-200, 0, 0]], staging_bytes=3 * b.record_bytes)
    with pytest.raises(RemoteFull):
        be.put_records(keys, b)
    assert len(be._store.sent) == 2                            # the third transfer is not tried


def test_mooncake_put_records_falls_back_to_put_when_the_staging_buffer_is_taken_or_too_small():
    b, one, *_ = batch(3, 1000)
    keys = ["a", "b", "c"]
    be = _fake_backend()
    with be._staging_lock:   # as while a put whose caller gave up still sends from it
        be.put_records(keys, b)
    assert be._store.sent == [] and be._store.puts == [("put_batch", keys, one)]
    be = _fake_backend(staging_bytes=b.record_bytes - 1)      # not even one value fits
    be.put_records(keys, b, overwrite=True)
    assert be._store.sent == [] and be._store.puts == [("upsert_batch", keys, one)]


def test_default_put_records_puts_the_encoded_values():
    class Capture(RemoteBackend):
        takes_parts = False

        def exists(self, keys):
            return []

        def get(self, keys, ttl_s=None):
            return []

        def put(self, items, ttl_s=None, overwrite=False, timeout_s=None):
            self.got = ([k for k, _ in items], [b"".join(map(bytes, v)) if isinstance(v, tuple) else bytes(v)
                                                for _, v in items], overwrite, timeout_s)

        def remove(self, keys):
            pass

    b, one, *_ = batch(3, 500)
    for parts in (False, True):
        c = Capture("x://")
        c.takes_parts = parts
        c.put_records(["a", "b", "c"], b, overwrite=True, timeout_s=0.5)
        assert c.got == (["a", "b", "c"], one, True, 0.5)


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    with local_servers(tmp_path_factory.mktemp("mc-put"), redis=False, segment_bytes=16 << 20) as s:
        yield s


def _backend(s, **opts) -> MooncakeBackend:
    q = "&".join(f"{k}={v}" for k, v in opts.items())
    be = MooncakeBackend(s.blocks_url + (f"?{q}" if q else ""))
    be.connect()
    return be


def test_mooncake_put_records_stores_encode_records_bytes_and_they_verify(mooncake):
    be = _backend(mooncake)
    try:
        raw = be.client
        sizes = []
        for n, nbytes, tag in ((3, 1000, "small"), (40, 40000, "grown"), (2, 100, "shrunk")):
            b, one, tok, hashes, chain = batch(n, nbytes, seed=n)
            keys = [f"put-records:{tag}:{i}" for i in range(n)]
            be.put_records(keys, b)
            assert be._staging is not None and be._staging.nbytes >= n * b.record_bytes
            sizes.append(be._staging.nbytes)
            assert raw.get_batch(keys) == one                  # encode_record's bytes, as stored
            records = np.empty((n, b.record_bytes), dtype=np.uint8)
            assert be.get_into(keys, records) == [b.record_bytes] * n
            rows, status = verify_records([records[i] for i in range(n)], key=KEY, start=0, hashes=hashes,
                                          parent_hash=b"r" * 32, chain=chain, parent_chain=0, tokens=tok,
                                          payload_bytes=nbytes, records=records)
            assert status is None and np.array_equal(rows, b.payloads)
        # 1 MiB at first, 2 MiB for 40 values of ~40 KB, then kept for smaller batches
        assert sizes == [1 << 20, 2 << 20, 2 << 20], sizes
        # keeps the first value, like put(); overwrite replaces it
        b2, one2, *_ = batch(1, 1000, seed=99)
        be.put_records(["put-records:small:0"], b2)
        assert raw.get_batch(["put-records:small:0"]) == [batch(3, 1000, seed=3)[1][0]]
        be.put_records(["put-records:small:0"], b2, overwrite=True)
        assert raw.get_batch(["put-records:small:0"]) == one2
    finally:
        be.close()
    assert be._staging is None


def test_mooncake_put_records_in_staging_sized_transfers(mooncake):
    b, one, *_ = batch(9, 10000, seed=5)
    be = _backend(mooncake, staging_bytes=4 * b.record_bytes)
    try:
        keys = [f"put-records:split:{i}" for i in range(9)]
        be.put_records(keys, b)
        assert be._staging.nbytes == 4 * b.record_bytes
        assert be.client.get_batch(keys) == one
    finally:
        be.close()


def test_full_mooncake_put_records_is_remote_full(mooncake):
    be = _backend(mooncake)
    try:
        b, *_ = batch(24, 1 << 20, seed=7)   # 24 MiB into a 16 MiB segment
        with pytest.raises(RemoteFull):
            be.put_records([f"put-records:full:{i}" for i in range(24)], b)
    finally:
        be.client.remove_all()
        be.close()
