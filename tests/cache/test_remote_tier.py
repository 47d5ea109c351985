"""The remote tier against real servers on 127.0.0.1 (a Mooncake master with one storage
process, a redis-server), started and stopped here: round trips through PrefixCache with
promotion, isolation of namespaces and models, corrupt values written through each
backend's own client, and faults (dead master, dead storage process, Redis restart, a
full Mooncake that evicts): each lookup stays within its deadline, serves only verified
bytes, and is counted."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dsv41.cache import CacheConfig, PrefixCache, TensorSnapshot
from dsv41.cache.hashing import as_token_array
from dsv41.config import ModelConfig

from ..remote_env import local_servers

B = 16
CONFIG = ModelConfig.preset("v41-tiny")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with local_servers(tmp_path_factory.mktemp("remote")) as s:
        yield s


def make_cache(s, *, timeout_s=1.0, weights_id="remote-test-weights", blocks=True, snapshots=True, block_tokens=B,
               **kw) -> PrefixCache:
    cc = CacheConfig(block_tokens=block_tokens, device="cpu", gpu_capacity_bytes=1 << 24, swa_capacity_bytes=1 << 24,
                     remote_blocks=s.blocks_url if blocks else None,
                     remote_snapshots=s.snapshots_url if snapshots else None,
                     remote_lookup_timeout_s=timeout_s, remote_write_timeout_s=2.0, **kw)
    c = PrefixCache(CONFIG, cc, weights_id=weights_id)
    assert c.remote.wait_connected(20.0)
    return c


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, size=n, dtype=np.uint32)


def payloads(c: PrefixCache, n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, size=(n, c.layout.block_bytes),
                                                                 dtype=np.uint8))


def snapshot(n: int, seed: int) -> TensorSnapshot:
    g = torch.Generator().manual_seed(seed)
    return TensorSnapshot(n, {"w": torch.randn(4, 33, generator=g).to(torch.bfloat16),
                           "i": torch.randint(0, 1 << 30, (5,), generator=g)}, {"format": 1, "n": n})


def write(c: PrefixCache, tok, ns: str, seed: int, snap_tokens: int | None = None):
    """Inserts every full block of tok (and a snapshot after snap_tokens), then waits for
    the background writer."""
    nb = len(tok) // c.block_tokens
    pay = payloads(c, nb, seed)
    m = c.insert(tok, pay, namespace=ns)
    c.release(m)
    snap = None
    if snap_tokens is not None:
        snap = snapshot(snap_tokens, seed)
        c.put_snapshot(tok[:snap_tokens], snap, namespace=ns)
    assert c.remote.flush(20.0)
    return pay, snap


def remote_counts(c: PrefixCache) -> dict:
    return c.metrics.to_dict()


def timed_match(c: PrefixCache, tok, ns: str, bound_s: float):
    t0 = time.perf_counter()
    m = c.match(tok, namespace=ns)
    took = time.perf_counter() - t0
    assert took < bound_s, f"lookup took {took:.2f} s"
    return m


def test_round_trip_with_promotion_and_metrics(servers):
    a, b = make_cache(servers), make_cache(servers)
    try:
        tok = tokens(1, 4 * B + 5)
        pay, snap = write(a, tok, "t1", seed=1, snap_tokens=3 * B + 2)
        m = b.match(np.concatenate([tok, tokens(2, 7)]), namespace="t1")
        assert (m.gpu_blocks, m.ssd_blocks, m.remote_blocks) == (0, 0, 4)
        assert torch.equal(b.read_blocks(m), pay)
        assert m.remote_snapshot and m.snapshot.num_tokens == 3 * B + 2 and m.snapshot.meta == snap.meta
        assert all(torch.equal(m.snapshot.tensors[k], snap.tensors[k]) for k in snap.tensors)
        b.release(m)
        m2 = b.match(tok, namespace="t1")   # promoted: now from B's own GPU pool and SWA pool
        assert (m2.gpu_blocks, m2.remote_blocks, m2.remote_snapshot) == (4, 0, False) and m2.snapshot is not None
        b.release(m2)
        d = b.metrics.to_dict()
        assert d["dsv41_cache_remote_hits_total"] == {"role=blocks": 4, "role=snapshots": 1}
        assert d["dsv41_cache_remote_bytes_read_total"]["role=blocks"] == 4 * b.layout.block_bytes
        assert d["dsv41_cache_hit_tokens_total"]["tier=remote"] == 4 * B
        assert a.metrics.to_dict()["dsv41_cache_remote_writes_total"] == {"role=blocks": 4, "role=snapshots": 1}
        text = b.metrics.to_prometheus()
        assert 'dsv41_cache_remote_hits_total{role="blocks"} 4' in text
        assert 'dsv41_cache_remote_breaker_state{backend="mooncake"} 0' in text
        assert "dsv41_cache_remote_seconds_bucket" in text
        # a second writer of the same blocks skips them (exists first)
        write(b, tok, "t1", seed=1)
        assert b.metrics.to_dict()["dsv41_cache_remote_writes_total"].get("role=blocks", 0) == 0
    finally:
        a.close()
        b.close()


def test_namespaces_and_models_never_cross(servers):
    a = make_cache(servers)
    other_model = make_cache(servers, weights_id="other-weights")
    b = make_cache(servers)
    try:
        tok = tokens(3, 3 * B + 1)
        write(a, tok, "tenant-a", seed=3, snap_tokens=2 * B + 1)
        for c, ns in ((b, "tenant-b"), (b, ""), (other_model, "tenant-a")):
            m = c.match(tok, namespace=ns)
            assert m.num_blocks == 0 and m.snapshot is None
            c.release(m)
        # Copy tenant-a's values under tenant-b's (and the other model's) keys with the
        # backends' own clients: they are recognised as foreign and never served.
        key_a = a.key("tenant-a")
        ha = a.hasher.hash_blocks(tok[: 3 * B], key_a)
        mc, rd = a.remote.blocks.backend.client, a.remote.snapshots.backend.client
        values = mc.get_batch([a.remote.block_key("tenant-a", h) for h in ha])
        sval = rd.get(a.remote.snapshot_key("tenant-a", ha[1]))
        assert all(values) and sval
        for c, ns in ((b, "tenant-b"), (other_model, "tenant-a")):
            hb = c.hasher.hash_blocks(tok[: 3 * B], c.key(ns))
            assert mc.put_batch([c.remote.block_key(ns, h) for h in hb], values) == 0
            m = c.match(tok, namespace=ns)
            assert m.num_blocks == 0 and m.snapshot is None
            c.release(m)
            vf = c.metrics.to_dict()["dsv41_cache_remote_verify_failures_total"]
            assert vf["role=blocks,kind=foreign"] >= 1
            # the snapshot: a cache that holds the blocks itself, so the snapshot is asked for
            snaps_only = make_cache(servers, blocks=False, weights_id=c.weights_id)
            try:
                snaps_only.release(snaps_only.insert(tok, payloads(snaps_only, 3, 3), namespace=ns))
                rd.set(snaps_only.remote.snapshot_key(ns, hb[1]), sval)
                m = snaps_only.match(tok, namespace=ns)
                assert m.num_blocks == 3 and m.snapshot is None
                snaps_only.release(m)
                vf = snaps_only.metrics.to_dict()["dsv41_cache_remote_verify_failures_total"]
                assert vf == {"role=snapshots,kind=foreign": 1}
            finally:
                snaps_only.close()
    finally:
        for c in (a, b, other_model):
            c.close()


def _foreign_sized_blocks_are_misses(a, tok, seed: int, long_ns: str, short_ns: str, write_raw) -> None:
    """Blocks encoded under one namespace and written, through the backend's own client
    (write_raw(keys, values) is true on success), under the other namespace's keys: one
    namespace is 63 bytes longer, so the values are longer, then shorter, than the records
    of the namespace that reads them. Each lookup is a miss counted as foreign."""
    for src, dst in ((long_ns, short_ns), (short_ns, long_ns)):
        key = a.key(src)
        hs = a.hasher.hash_blocks(tok, key)
        items = a.remote.block_values(key, src, hs, as_token_array(tok).reshape(2, B), range(2),
                                      payloads(a, 2, seed), 0, a.hasher.root(key))
        hd = a.hasher.hash_blocks(tok, a.key(dst))
        assert len(items[0][1]) != len(a.remote.block_values(a.key(dst), dst, hd, as_token_array(tok).reshape(
            2, B), range(1), payloads(a, 1, seed), 0, a.hasher.root(a.key(dst)))[0][1])
        assert write_raw([a.remote.block_key(dst, h) for h in hd], [bytes(v) for _, v in items])
        before = a.metrics.to_dict()["dsv41_cache_remote_verify_failures_total"].get("role=blocks,kind=foreign", 0)
        m = a.match(tok, namespace=dst)
        assert m.num_blocks == 0
        a.release(m)
        vf = a.metrics.to_dict()["dsv41_cache_remote_verify_failures_total"]
        assert vf["role=blocks,kind=foreign"] == before + 1, dst


def test_values_of_another_size_read_in_place_are_classified(servers):
    """Mooncake reads values straight into a record-sized array: another namespace's values
    (a key 63 bytes longer or shorter, so records longer or shorter than this namespace's)
    under this namespace's keys are still read whole, classified as foreign, never served."""
    a = make_cache(servers)
    try:
        mc = a.remote.blocks.backend.client
        _foreign_sized_blocks_are_misses(a, tokens(6, 2 * B), 6, "x" * 64, "m",
                                         lambda keys, values: mc.put_batch(keys, values) == 0)
    finally:
        a.close()


def test_redis_blocks_of_another_size_read_in_place_are_classified(servers):
    """Redis block reads land in a record-sized array too (get_into: the MGET reply read
    into its rows): a longer value under this namespace's key (read and dropped, then
    fetched alone) and a shorter one are classified as foreign, never served, and the
    connection keeps serving this namespace's own blocks."""
    import redis

    cc = CacheConfig(block_tokens=B, device="cpu", gpu_capacity_bytes=1 << 24, swa_capacity_bytes=1 << 24,
                     remote_blocks=servers.snapshots_url, remote_lookup_timeout_s=1.0, remote_write_timeout_s=2.0)
    a = PrefixCache(CONFIG, cc, weights_id="redis-size-weights")
    assert a.remote.wait_connected(20.0)
    raw = redis.Redis.from_url(servers.snapshots_url)
    try:
        _foreign_sized_blocks_are_misses(a, tokens(7, 2 * B), 7, "y" * 64, "r",
                                         lambda keys, values: raw.mset(dict(zip(keys, values))))
        tok2 = tokens(8, 3 * B)
        pay, _ = write(a, tok2, "own", seed=8)
        c = PrefixCache(CONFIG, cc, weights_id="redis-size-weights")
        assert c.remote.wait_connected(20.0)
        try:
            m = c.match(tok2, namespace="own")
            assert m.remote_blocks == 3 and torch.equal(c.read_blocks(m), pay)
            c.release(m)
        finally:
            c.close()
    finally:
        raw.close()
        a.close()


def test_corrupt_values_written_with_the_backends_clients_are_misses(servers):
    a, b = make_cache(servers), make_cache(servers)
    try:
        tok = tokens(4, 4 * B + 3)
        key = a.key("c")
        hashes = a.hasher.hash_blocks(tok[: 4 * B], key)
        tk = as_token_array(tok)[: 4 * B].reshape(4, B)
        pay = payloads(a, 4, 4)
        items = a.remote.block_values(key, "c", hashes, tk, range(4), pay, 0, a.hasher.root(key))
        bad = bytearray(items[2][1])
        bad[len(bad) // 2] ^= 0x10          # one flipped bit in block 2's payload
        items[2] = (items[2][0], bytes(bad))
        assert a.remote.blocks.backend.client.put_batch([k for k, _ in items], [v for _, v in items]) == 0
        snap = snapshot(2 * B + 1, 5)   # its global KV (blocks 0, 1) is intact
        sk, sv = a.remote.snapshot_value(key, "c", as_token_array(tok), hashes, a.hasher.root(key), snap)
        a.remote.snapshots.backend.client.set(sk, sv[:300] + bytes([sv[300] ^ 1]) + sv[301:])
        m = b.match(tok, namespace="c")
        assert m.remote_blocks == 2 and torch.equal(b.read_blocks(m), pay[:2]) and m.snapshot is None
        b.release(m)
        vf = b.metrics.to_dict()["dsv41_cache_remote_verify_failures_total"]
        assert vf["role=blocks,kind=corrupt"] == 1 and vf["role=snapshots,kind=corrupt"] == 1
    finally:
        a.close()
        b.close()


def test_redis_restart_is_a_miss_then_recovers(servers):
    a, b = make_cache(servers, timeout_s=0.2), make_cache(servers, timeout_s=0.2)
    try:
        tok = tokens(6, 2 * B + 3)
        write(a, tok, "r", seed=6, snap_tokens=2 * B + 3)
        servers.restart_redis()             # no persistence: every snapshot is gone
        m = timed_match(b, tok, "r", 2.0)
        assert m.remote_blocks == 2 and m.snapshot is None
        b.release(m)
        tok2 = tokens(7, 2 * B + 3)          # the client reconnects: writes and reads work again
        write(a, tok2, "r", seed=7, snap_tokens=2 * B + 3)
        deadline = time.monotonic() + 15
        while True:
            m = timed_match(b, tok2, "r", 2.0)
            got = m.snapshot is not None
            b.release(m)
            if got or time.monotonic() > deadline:
                break
            write(a, tok2, "r", seed=7, snap_tokens=2 * B + 3)   # the first write may have met the dead socket
        assert got
    finally:
        a.close()
        b.close()


def test_full_mooncake_evicts_and_lookups_stay_correct(tmp_path):
    with local_servers(tmp_path, redis=False, segment_bytes=16 << 20) as s:
        # 256-token blocks (~20 KB with v41-tiny): fewer, larger values, like a real model's
        a, b = (make_cache(s, snapshots=False, block_tokens=256) for _ in range(2))
        try:
            per = max(1, (1 << 20) // a.layout.block_bytes)    # ~1 MiB per chain
            chains = [(tokens(100 + i, per * 256), i) for i in range(28)]   # ~28 MiB into 16 MiB
            written = {}
            for tok, i in chains:
                written[i] = write(a, tok, "e", seed=100 + i)[0]
            hit = miss = 0
            for tok, i in chains:
                m = timed_match(b, tok, "e", 5.0)
                assert torch.equal(b.read_blocks(m), written[i][: m.num_blocks])   # only verified bytes
                hit += m.num_blocks == per
                miss += m.num_blocks < per
                b.release(m)
            assert hit >= 1 and miss >= 1, (hit, miss)   # it evicted, and still serves what it holds
            d = a.metrics.to_dict()
            assert d["dsv41_cache_remote_writes_total"]["role=blocks"] \
                + sum(d.get("dsv41_cache_remote_dropped_writes_total", {}).values()) == 28 * per
        finally:
            a.close()
            b.close()


def test_dead_storage_process_and_dead_master_are_bounded_misses(tmp_path):
    with local_servers(tmp_path / "s", redis=False, segment_bytes=16 << 20) as s:
        a = make_cache(s, snapshots=False, timeout_s=0.1, remote_breaker_failures=3)
        b = make_cache(s, snapshots=False, timeout_s=0.1, remote_breaker_failures=3)
        try:
            tok = tokens(8, 3 * B)
            write(a, tok, "k", seed=8)
            s.kill("mooncake_storage")
            for _ in range(3):                      # keys may stay listed; they return nothing
                m = timed_match(b, tok, "k", 2.0)
                assert m.num_blocks == 0
                b.release(m)
            s.kill("mooncake_master")
            t0 = time.perf_counter()
            for i in range(6):
                m = timed_match(b, tokens(9 + i, 3 * B), "k", 1.5)
                assert m.num_blocks == 0
                b.release(m)
                b.insert(tokens(9 + i, 3 * B), payloads(b, 3, i), namespace="k")   # writes: dropped, counted
            assert time.perf_counter() - t0 < 6.0        # never the ~4.3 s hang per call
            d = b.metrics.to_dict()
            errs = d["dsv41_cache_remote_errors_total"]
            assert errs.get("backend=mooncake,cause=breaker_open", 0) >= 1
            assert d["dsv41_cache_remote_misses_total"]["role=blocks"] >= 9 * 3
            assert d["dsv41_cache_remote_breaker_state"]["backend=mooncake"] in (1, 2)
            b.remote.flush(10.0)
            assert sum(b.metrics.to_dict()["dsv41_cache_remote_dropped_writes_total"].values()) >= 1
        finally:
            a.close()
            b.close()


def test_per_tenant_redis_acl_user_as_documented(servers):
    """The ACL line of docs/remote.md: tenant-a's user reads and writes its own snapshots
    through the tier and cannot touch another tenant's keys."""
    import redis
    admin = redis.Redis.from_url(servers.snapshots_url)
    admin.execute_command("ACL", "SETUSER", "dsv41-tenant-a", "on", ">pw-a", "resetkeys", "~dsv41:tenant-a:*",
                          "-@all", "+get", "+getex", "+mget", "+set", "+mset", "+exists", "+del", "+ping")
    url = f"redis://dsv41-tenant-a:pw-a@127.0.0.1:{servers.ports['redis']}/0"
    a = PrefixCache(CONFIG, CacheConfig(block_tokens=B, device="cpu", gpu_capacity_bytes=1 << 24,
                                        swa_capacity_bytes=1 << 24, remote_snapshots=url,
                                        remote_lookup_timeout_s=1.0), weights_id="remote-test-weights")
    try:
        assert a.remote.wait_connected(20.0)
        tok = tokens(20, 2 * B + 1)
        for ns in ("tenant-a", "tenant-b"):
            a.release(a.insert(tok, payloads(a, 2, 20), namespace=ns))
            a.put_snapshot(tok, snapshot(2 * B + 1, 20), namespace=ns)
        assert a.remote.flush(20.0)
        d = a.metrics.to_dict()
        assert d["dsv41_cache_remote_writes_total"] == {"role=snapshots": 1}               # tenant-a's only
        assert d["dsv41_cache_remote_dropped_writes_total"] == {"role=snapshots,cause=error": 1}
        assert admin.exists(a.remote.snapshot_key("tenant-a", a.hasher.hash_blocks(tok[: 2 * B], a.key("tenant-a"))[1]))
        user = redis.Redis.from_url(url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.get("dsv41:tenant-b:x")
    finally:
        a.close()
        admin.execute_command("ACL", "DELUSER", "dsv41-tenant-a")


def test_blocks_on_redis_round_trip_corruption_and_a_stopped_server(servers):
    """Global KV blocks in Redis (MSET / MGET in the caller's thread, values sent as header
    and payload parts): a round trip is bit-identical, a flipped byte written with redis's
    own client is a counted corrupt miss, and a server that stops answering (SIGSTOP) costs
    a lookup its deadline, not the 2 s socket timeout, then works again after SIGCONT."""
    import os
    import signal

    import redis

    def cache(timeout_s=1.0):
        cc = CacheConfig(block_tokens=B, device="cpu", gpu_capacity_bytes=1 << 24, swa_capacity_bytes=1 << 24,
                         remote_blocks=servers.snapshots_url, remote_lookup_timeout_s=timeout_s,
                         remote_write_timeout_s=2.0, remote_breaker_failures=100)
        c = PrefixCache(CONFIG, cc, weights_id="redis-blocks-weights")
        assert c.remote.wait_connected(20.0)
        return c

    a, b = cache(), cache(timeout_s=0.1)
    raw = redis.Redis.from_url(servers.snapshots_url)
    try:
        tok = tokens(40, 5 * B)
        pay, _ = write(a, tok, "rb", seed=40)
        m = b.match(tok, namespace="rb")
        assert m.remote_blocks == 5 and torch.equal(b.read_blocks(m), pay)
        b.release(m)
        # a flipped payload byte in block 2: blocks 0-1 are served, the rest is a miss
        tok2 = tokens(41, 5 * B)
        write(a, tok2, "rb", seed=41)
        key = a.key("rb")
        k2 = a.remote.block_key("rb", a.hasher.hash_blocks(tok2, key)[2])
        v = bytearray(raw.get(k2))
        v[-5] ^= 0x10
        raw.set(k2, bytes(v))
        c = cache()
        m = c.match(tok2, namespace="rb")
        assert m.remote_blocks == 2
        c.release(m)
        assert c.metrics.to_dict()["dsv41_cache_remote_verify_failures_total"] == {"role=blocks,kind=corrupt": 1}
        c.close()
        # a stopped server: the lookup returns within its deadline as a counted miss
        tok3 = tokens(42, 3 * B)
        write(a, tok3, "rb", seed=42)
        pid = servers.pids()["redis"]
        os.kill(pid, signal.SIGSTOP)
        try:
            m = timed_match(b, tok3, "rb", 1.0)
            assert m.remote_blocks == 0
            b.release(m)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert b.metrics.to_dict()["dsv41_cache_remote_errors_total"].get("backend=redis,cause=timeout", 0) >= 1
        m = b.match(tok3, namespace="rb")   # answering again: a new connection, a hit
        assert m.remote_blocks == 3
        b.release(m)
    finally:
        raw.close()
        a.close()
        b.close()


def test_snapshot_at_a_block_boundary_round_trips(servers):
    """A snapshot whose tail past its anchor block is empty (the prompt ends on a block
    boundary): its record holds no token ids and still round-trips."""
    a, b = make_cache(servers), make_cache(servers)
    try:
        tok = tokens(50, 2 * B)
        _, snap = write(a, tok, "edge", seed=50, snap_tokens=2 * B)
        assert a.metrics.to_dict()["dsv41_cache_remote_writes_total"] == {"role=blocks": 2, "role=snapshots": 1}
        m = b.match(np.concatenate([tok, tokens(51, 3)]), namespace="edge")
        assert m.remote_blocks == 2 and m.remote_snapshot and m.snapshot.num_tokens == 2 * B
        assert all(torch.equal(m.snapshot.tensors[k], snap.tensors[k]) for k in snap.tensors)
        b.release(m)
    finally:
        a.close()
        b.close()
