"""The tier protocol (cache/tiers): PrefixCache asks its tiers in order; an SSD hit reaches
the pool's pages in one write from a reused staging buffer; lookup() and evict() ask every
tier; each tier's put sees an insert's payloads and an adoption's pages alike."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41.cache import CacheConfig, PrefixCache, TensorSnapshot
from dsv41.cache.tiers import BlockTier, HostRows, PoolRows, SnapshotTier
from dsv41.cache.tiers.staging import StagingRows

from .helpers import B, LAYOUT, TINY, WEIGHTS_ID, chain_payloads, rand_tokens

BB = LAYOUT.block_bytes


def make(tmp_path=None, **kw) -> PrefixCache:
    kw.setdefault("block_tokens", B)
    kw.setdefault("gpu_capacity_bytes", 64 * BB)
    kw.setdefault("device", "cpu")
    kw.setdefault("swa_capacity_bytes", 1 << 20)
    kw.setdefault("store_durability", "none")
    if tmp_path is not None:
        kw.setdefault("store_dir", str(tmp_path / "store"))
    return PrefixCache(TINY, CacheConfig(**kw), weights_id=WEIGHTS_ID)


def pays(cache: PrefixCache, tokens) -> torch.Tensor:
    return torch.from_numpy(chain_payloads(np.asarray(tokens, "<u4"), cache.key("a")))


def test_the_tiers_in_lookup_order(tmp_path):
    cache = make(tmp_path, swa_checkpoint_tokens=2 * B)
    assert [t.name for t in cache.block_tiers] == ["gpu", "ssd"]
    assert [t.name for t in cache.snapshot_tiers] == ["swa", "ssd_swa"]
    assert all(isinstance(t, BlockTier) for t in cache.block_tiers)
    assert all(isinstance(t, SnapshotTier) for t in cache.snapshot_tiers)
    assert cache.tier("ssd") is cache.ssd and cache.tier("gpu") is cache.gpu
    with pytest.raises(KeyError, match="no 'remote' tier"):
        cache.tier("remote")
    bare = make(swa_capacity_bytes=0)
    assert [t.name for t in bare.block_tiers] == ["gpu"] and bare.snapshot_tiers == ()
    cache.close()


def test_an_ssd_hit_is_one_write_into_the_pool_from_a_reused_buffer(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    cache = make(tmp_path)
    prompts = [rand_tokens(rng, n * B) for n in (6, 4, 6, 9)]
    for p in prompts:
        cache.release(cache.insert(p, pays(cache, p), "a"))
    cache.flush()
    writes = []
    real_write = cache.pool.write

    def write(bids, payloads):
        writes.append(len(bids))
        return real_write(bids, payloads)

    monkeypatch.setattr(cache.pool, "write", write)
    monkeypatch.setattr(cache.pool, "insert_many", lambda *a, **k: pytest.fail("promotion went through insert_many"))
    staging = cache.ssd.staging
    for i, p in enumerate(prompts):
        cache.pool.evict_all()
        m = cache.match(p, "a")
        assert m.ssd_blocks == p.size // B and torch.equal(cache.read_blocks(m), pays(cache, p))
        cache.release(m)
        assert writes[-1] == p.size // B and len(writes) == i + 1   # one pool write per promotion
    # Sized by the store's index (a walk), rounded up to a power of two of rows: the buffer
    # of the first 6-block promotion (8 rows) served the 4- and 6-block ones, and only the
    # 9-block one needed another (16 rows).
    assert staging.allocations == 2
    assert staging.held_bytes == (8 + 16) * BB
    cache.close()


def test_staging_rows_lend_one_buffer_per_user():
    s = StagingRows(10, keep=1)
    with s.rows(3) as a:
        with s.rows(3) as b:                     # a second user at once: its own buffer
            assert a.data_ptr() != b.data_ptr() and a.shape == b.shape == (3, 10)
    assert s.allocations == 2 and s.held_bytes == 4 * 10   # keep=1: the largest one stays
    with s.rows(4) as c:
        assert c.shape == (4, 10)
    with s.rows(5):
        pass
    assert s.allocations == 3 and s.held_bytes == 8 * 10


def test_lookup_asks_every_block_tier_and_takes_nothing(tmp_path):
    rng = np.random.default_rng(1)
    cache = make(tmp_path, gpu_capacity_bytes=4 * BB)
    p = rand_tokens(rng, 6 * B + 5)
    cache.release(cache.insert(p, pays(cache, p), "a"))   # the pool keeps 4, the SSD gets 6
    cache.flush()
    assert cache.lookup(p, "a") == {"gpu": 4 * B, "ssd": 2 * B}
    assert cache.lookup(p, "a", max_tokens=3 * B) == {"gpu": 3 * B, "ssd": 0}
    assert cache.lookup(p, "b") == {"gpu": 0, "ssd": 0}
    before = cache.metrics.to_dict()
    cache.pool.evict_all()
    assert cache.lookup(p, "a") == {"gpu": 0, "ssd": 6 * B}
    assert cache.metrics.to_dict()["dsv41_cache_lookups_total"] == before["dsv41_cache_lookups_total"]
    assert cache.pool.stats()["cached_blocks"] == 0     # nothing promoted
    cache.close()


def test_evict_asks_each_tier(tmp_path):
    clock = [1000.0]
    cache = PrefixCache(TINY, CacheConfig(block_tokens=B, gpu_capacity_bytes=16 * BB, device="cpu",
                                          swa_capacity_bytes=1 << 20, swa_ttl_s=10.0, store_dir=str(tmp_path / "s"),
                                          store_durability="none", store_ttl_s=100.0),
                        weights_id=WEIGHTS_ID, clock=lambda: clock[0])
    p = np.arange(3 * B + 2, dtype="<u4")
    cache.release(cache.insert(p, pays(cache, p), "a"))
    snap = TensorSnapshot(p.size, {"w": torch.ones(3)})
    assert cache.put_snapshot(p, snap, "a")
    cache.flush()
    assert cache.evict() == {"gpu": 3, "ssd": 0, "swa": 0}
    clock[0] += 500.0                                 # past both TTLs
    assert cache.evict(["swa", "ssd"]) == {"swa": 1, "ssd": 3}
    assert len(cache.store) == 0 and len(cache.swa) == 0
    with pytest.raises(KeyError):
        cache.evict(["remote"])
    cache.close()


def test_pool_rows_are_read_once_and_hold_their_pages_until_then():
    cache = make()
    p = np.arange(3 * B, dtype="<u4")
    want = pays(cache, p)
    m = cache.insert(p, want, "a")
    rows = PoolRows(cache.pool, m.block_ids, 0)
    rows.hold()                                       # a second user (a writer thread)
    cache.release(m)
    assert cache.pool.evict_all() == 0                # held by the rows, not evicted
    got = rows.host()
    assert torch.equal(got, want) and rows.host() is got
    assert cache.pool.evict_all() == 3                # read: the pages are no longer held
    rows.release()
    assert torch.equal(rows.host(), want)             # the other holder still reads the copy
    rows.release()
    unread = PoolRows(cache.pool, cache.insert(p, want, "a").block_ids, 0)
    unread.release()
    with pytest.raises(RuntimeError, match="released"):
        unread.host()


def test_host_rows_copy_the_callers_tensor_once():
    given = torch.arange(2 * BB, dtype=torch.int64).to(torch.uint8).reshape(2, BB)
    rows = HostRows(given, 0)
    assert rows.host(stable=False).data_ptr() == given.data_ptr()   # a synchronous write: no copy
    stable = rows.host()
    assert stable.data_ptr() != given.data_ptr() and torch.equal(stable, given)
    given.fill_(7)                                    # the caller reuses its buffer
    assert rows.host() is stable and not torch.equal(stable, given)
