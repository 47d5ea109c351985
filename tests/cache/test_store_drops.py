"""Serving calls never fail because the SSD store dropped a chain the GPU pool still
references (issue 10, section 2): LRU eviction under store_capacity_bytes, TTL expiry
through gc(), and verify(repair=True). Each case: the pool keeps the blocks and their
record ids, the store forgets the records, then the prompt is extended (insert) and
matched again; both are served and the extension is stored as a whole prefix again."""
from __future__ import annotations

import numpy as np
import torch

from dsv41.cache import CacheConfig, PrefixCache

from .helpers import B, LAYOUT, TINY, WEIGHTS_ID, chain_payloads, rand_tokens

BB = LAYOUT.block_bytes


class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def make(tmp_path, clock=None, **kw) -> PrefixCache:
    kw.setdefault("block_tokens", B)
    kw.setdefault("gpu_capacity_bytes", 256 * BB)  # the pool keeps everything in these tests
    kw.setdefault("device", "cpu")
    kw.setdefault("swa_capacity_bytes", 0)
    kw.setdefault("store_durability", "none")
    kw.setdefault("store_dir", str(tmp_path / "store"))
    return PrefixCache(TINY, CacheConfig(**kw), weights_id=WEIGHTS_ID, clock=clock or Clock())


def pays(cache: PrefixCache, tokens) -> torch.Tensor:
    return torch.from_numpy(chain_payloads(np.asarray(tokens, "<u4"), cache.key("a")))


def extend_and_check(cache: PrefixCache, prompt: np.ndarray, rng) -> None:
    """The pool still holds `prompt` (with stale record ids): a longer prompt is matched,
    inserted and matched again; every call is served with the right bytes and the whole
    longer prefix ends up in the store."""
    longer = np.concatenate([prompt, rand_tokens(rng, 2 * B)])
    n = longer.size // B
    m = cache.match(longer, "a")
    assert m.gpu_blocks == prompt.size // B
    cache.insert(longer, pays(cache, longer), "a", match=m)
    assert m.num_blocks == n and torch.equal(cache.read_blocks(m), pays(cache, longer))
    cache.release(m)
    m = cache.match(longer, "a")
    assert m.num_blocks == n and torch.equal(cache.read_blocks(m), pays(cache, longer))
    cache.release(m)
    # The store holds the whole longer prefix again (re-persisted, not orphaned): a cold
    # pool loads every block from the SSD once the background writes are acknowledged.
    cache.flush()
    cache.pool.evict_all()
    m = cache.match(longer, "a")
    assert m.ssd_blocks == n and torch.equal(cache.read_blocks(m), pays(cache, longer))
    cache.release(m)


def test_lru_eviction_under_the_store_capacity(tmp_path):
    rng = np.random.default_rng(0)
    cache = make(tmp_path, store_capacity_bytes=1 << 30)  # set below, once a record's span is known
    prompt = rand_tokens(rng, 4 * B)
    clock = cache.clock
    cache.release(cache.insert(prompt, pays(cache, prompt), "a"))
    cache.flush()  # each prompt is committed at its own clock time: the LRU order is the test's
    m = cache.match(prompt, "a")
    rid0 = cache.pool.slot(m.block_ids[0]).record_id
    cache.release(m)
    assert rid0 in cache.store
    # Room for 40 records (packed: a record takes its span) and 16 pages of segment
    # headers, footers and trailers.
    cache.store.capacity_bytes = 40 * cache.store.record_info(rid0)["span_bytes"] + 16 * 4096
    # Newer prompts push the first one out of the store (LRU), not out of the pool.
    for _ in range(30):
        clock.t += 1
        p = rand_tokens(rng, 4 * B)
        cache.release(cache.insert(p, pays(cache, p), "a"))
        cache.flush()
    assert rid0 not in cache.store
    extend_and_check(cache, prompt, rng)
    cache.close()


def test_ttl_expiry_through_gc(tmp_path):
    rng = np.random.default_rng(1)
    clock = Clock()
    cache = make(tmp_path, clock=clock, store_ttl_s=3600.0)
    prompt = rand_tokens(rng, 3 * B)
    cache.release(cache.insert(prompt, pays(cache, prompt), "a"))
    cache.flush()
    assert len(cache.store) == 3
    clock.t += 7200
    assert cache.store.gc()["expired"] == 3 and len(cache.store) == 0
    extend_and_check(cache, prompt, rng)
    cache.close()


def test_verify_repair_removes_records_the_pool_references(tmp_path):
    rng = np.random.default_rng(2)
    cache = make(tmp_path)
    prompt = rand_tokens(rng, 3 * B)
    cache.release(cache.insert(prompt, pays(cache, prompt), "a"))
    cache.flush()
    info = cache.store.record_info(cache.store.record_ids()[1])
    with open(tmp_path / "store" / info["segment"], "r+b") as f:  # bit rot in block 1 (its token ids)
        f.seek(info["offset"] + 300)
        f.write(b"\x55\xaa")
    rep = cache.store.verify(repair=True)
    assert rep["corrupt"] == 1 and len(cache.store) == 1  # block 1 and its child are gone
    extend_and_check(cache, prompt, rng)
    cache.close()


def test_a_drop_between_match_and_insert(tmp_path):
    """The store forgets the chain after match() linked it and before insert() extends it."""
    rng = np.random.default_rng(3)
    clock = Clock()
    cache = make(tmp_path, clock=clock, store_ttl_s=3600.0)
    prompt = rand_tokens(rng, 3 * B)
    cache.release(cache.insert(prompt, pays(cache, prompt), "a"))
    cache.flush()  # stored, so that gc() below really drops it
    longer = np.concatenate([prompt, rand_tokens(rng, B)])
    m = cache.match(longer, "a")
    assert m.gpu_blocks == 3
    clock.t += 7200
    cache.store.gc()
    cache.insert(longer, pays(cache, longer), "a", match=m)
    assert torch.equal(cache.read_blocks(m), pays(cache, longer))
    cache.release(m)
    cache.flush()
    assert len(cache.store) == 4
    cache.close()
