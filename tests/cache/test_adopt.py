"""PrefixCache.adopt: a prefill's private pool pages become cached blocks without a copy,
and the tiers below see exactly what insert() would have given them: the same cached
blocks, the same SSD records (read from the pool by the write-behind thread), identical
blocks deduplicated, a GPU hit in the middle of a chain extended, a store that dropped the
parent rewritten from the root, and every error leaving the caller's pages untouched."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41.cache import CacheConfig, PrefixCache

from .helpers import B, LAYOUT, TINY, WEIGHTS_ID, chain_payloads, load_all, rand_tokens

BB = LAYOUT.block_bytes


def make(path=None, **kw) -> PrefixCache:
    kw.setdefault("block_tokens", B)
    kw.setdefault("gpu_capacity_bytes", 64 * BB)
    kw.setdefault("device", "cpu")
    kw.setdefault("swa_capacity_bytes", 0)
    kw.setdefault("store_durability", "none")
    if path is not None:
        kw.setdefault("store_dir", str(path))
    return PrefixCache(TINY, CacheConfig(**kw), weights_id=WEIGHTS_ID)


def pays(cache: PrefixCache, tokens, ns: str = "a") -> torch.Tensor:
    return torch.from_numpy(chain_payloads(np.asarray(tokens, "<u4"), cache.key(ns)))


def prefill_pages(cache: PrefixCache, payloads: torch.Tensor) -> list[int]:
    """What the paged runtime does: private pages, written in place."""
    pages = cache.pool.allocate(payloads.shape[0])
    cache.pool.write(pages, payloads)
    return pages


def records(cache: PrefixCache, tokens) -> list[tuple]:
    """(block index, hash, key, parent's hash, payload) of every record, in chain order,
    read back and verified from the store."""
    store = cache.store
    key = cache.key("a")
    rids, rows = load_all(store, np.asarray(tokens, "<u4"), key, cache.hasher)
    assert len(rids) == len(store), "every record is on the one chain"
    out = []
    for rid, row in zip(rids, rows):
        info = store.record_info(rid)
        parent = store.record_info(info["parent_id"])["hash"] if info["parent_id"] else None
        out.append((info["block_index"], info["hash"], info["key"], parent, bytes(row)))
    return out


@pytest.mark.parametrize("write_behind", [0, 1 << 20])
def test_adopt_gives_what_insert_gives(tmp_path, write_behind):
    rng = np.random.default_rng(0)
    toks = rand_tokens(rng, 5 * B + 7)
    by_insert = make(tmp_path / "ins", store_write_behind_bytes=write_behind)
    by_adopt = make(tmp_path / "adopt", store_write_behind_bytes=write_behind)
    want = pays(by_insert, toks)
    mi = by_insert.insert(toks, want, "a")
    pages = prefill_pages(by_adopt, want)
    ma = by_adopt.adopt(toks, pages, "a")
    assert ma.block_ids == pages                      # published in place: no payload moved
    assert (ma.hashes, ma.num_blocks) == (mi.hashes, mi.num_blocks) == (mi.hashes, 5)
    assert by_adopt.pool.stats()["private_blocks"] == 0
    for c, m in ((by_insert, mi), (by_adopt, ma)):
        c.release(m)
        c.flush()
    # The same cached blocks: found by a lookup, same payloads.
    for c in (by_insert, by_adopt):
        m = c.match(toks, "a")
        assert m.gpu_blocks == 5 and torch.equal(c.read_blocks(m), want)
        c.release(m)
        assert c.pool.stats()["referenced_blocks"] == 0
    # The same SSD records, and the adopted chain is served from the SSD alone.
    assert records(by_adopt, toks) == records(by_insert, toks)
    by_adopt.pool.evict_all()
    m = by_adopt.match(toks, "a")
    assert m.ssd_blocks == 5 and torch.equal(by_adopt.read_blocks(m), want)
    by_adopt.release(m)
    by_insert.close()
    by_adopt.close()


def test_identical_blocks_are_deduplicated(tmp_path):
    rng = np.random.default_rng(1)
    cache = make(tmp_path / "s")
    toks = rand_tokens(rng, 4 * B)
    want = pays(cache, toks)
    first = cache.adopt(toks, prefill_pages(cache, want), "a")
    cache.flush()
    free = cache.pool.stats()["free_blocks"]
    # A second sequence computed the same prefix privately (no match: it started before
    # the first was cached): its pages are freed, the match maps the cached ones.
    mine = prefill_pages(cache, want)
    second = cache.adopt(toks, mine, "a")
    assert second.block_ids == first.block_ids and not set(mine) & set(second.block_ids)
    assert cache.pool.stats()["free_blocks"] == free and cache.pool.stats()["private_blocks"] == 0
    cache.flush()
    assert len(cache.store) == 4                      # nothing written twice
    cache.release(first)
    cache.release(second)
    assert cache.pool.stats()["referenced_blocks"] == 0
    cache.close()


def test_adopt_after_a_gpu_hit_in_the_middle_of_a_chain(tmp_path):
    rng = np.random.default_rng(2)
    cache = make(tmp_path / "s")
    stem = rand_tokens(rng, 3 * B)
    old = np.concatenate([stem, rand_tokens(rng, 3 * B)])
    cache.release(cache.insert(old, pays(cache, old), "a"))
    # Diverging after 3 blocks: the match stops mid-chain, the new blocks hang below block 2.
    new = np.concatenate([stem, rand_tokens(rng, 3 * B)])
    m = cache.match(new, "a")
    assert m.gpu_blocks == 3
    want = pays(cache, new)
    pages = prefill_pages(cache, want[3:])
    cache.adopt(new, pages, "a", match=m)
    assert m.block_ids[3:] == pages and torch.equal(cache.read_blocks(m), want)
    # The same prefix again, capped mid-chain (max_tokens): the blocks past the cap that
    # this request computes again are the cached ones, deduplicated.
    capped = cache.match(new, "a", max_tokens=4 * B)
    assert capped.num_blocks == 4
    again = prefill_pages(cache, want[4:])
    cache.adopt(new, again, "a", match=capped)
    assert capped.block_ids == m.block_ids
    cache.release(m)
    cache.release(capped)
    cache.flush()
    assert len(cache.store) == 9                      # 6 + the 3 new blocks, linked to block 2
    for toks in (old, new):
        cache.pool.evict_all()
        got = cache.match(toks, "a")
        assert got.ssd_blocks == 6 and torch.equal(cache.read_blocks(got), pays(cache, toks))
        cache.release(got)
    cache.close()


def test_a_parent_the_store_dropped_is_written_again_from_the_root(tmp_path):
    """The pool cannot lose the parent of an adoption (the match references every page of
    its chain); the store can drop its record (TTL, capacity, repair, a failed read)
    between the match and the adoption. Then the chain is written again from the first
    block whose record is gone: the store never holds adopted blocks below a missing
    parent."""
    rng = np.random.default_rng(3)
    cache = make(tmp_path / "s")
    toks = rand_tokens(rng, 5 * B)
    want = pays(cache, toks)
    cache.release(cache.insert(toks[: 2 * B], want[:2], "a"))
    cache.flush()
    m = cache.match(toks, "a")
    assert m.gpu_blocks == 2 and len(cache.store) == 2
    cache.store.capacity_bytes = 1
    cache.store.gc()                                  # the store drops both records
    cache.store.capacity_bytes = None
    assert len(cache.store) == 0
    cache.adopt(toks, prefill_pages(cache, want[2:]), "a", match=m)
    cache.release(m)
    cache.flush()
    assert [r[0] for r in records(cache, toks)] == [0, 1, 2, 3, 4]
    cache.pool.evict_all()
    m = cache.match(toks, "a")
    assert m.ssd_blocks == 5 and torch.equal(cache.read_blocks(m), want)
    cache.release(m)
    cache.close()


def test_queued_adoptions_hold_their_pages_and_are_written_once(tmp_path):
    """With write-behind an adoption's SSD write is a job of the commit thread (stopped
    here, so the jobs wait for flush): the job holds its pages after the sequence released
    them, a lookup in the meantime leaves them to it, and an insert that extends them runs
    it first, so no block is written twice."""
    rng = np.random.default_rng(4)
    cache = make(tmp_path / "s")
    cache.ssd.committer.stop()
    toks = rand_tokens(rng, 3 * B)
    want = pays(cache, toks)
    m = cache.adopt(toks, prefill_pages(cache, want), "a")
    cache.release(m)
    assert cache.pool.stats()["referenced_blocks"] == 3   # the queued job's hold
    assert cache.pool.evict_all() == 0 and len(cache.store) == 0
    hit = cache.match(toks, "a")                          # admission of served blocks: left to the job
    assert hit.gpu_blocks == 3 and cache.store.pending_bytes == 0
    longer = np.concatenate([toks, rand_tokens(rng, B)])
    cache.insert(longer, pays(cache, longer), "a", match=hit)   # runs the job, then links block 3
    cache.release(hit)
    cache.flush()
    assert len(cache.store) == 4 and cache.pool.stats()["referenced_blocks"] == 0
    cache.pool.evict_all()
    m = cache.match(longer, "a")
    assert m.ssd_blocks == 4 and torch.equal(cache.read_blocks(m), pays(cache, longer))
    cache.release(m)
    # close() runs what is still queued.
    other = rand_tokens(rng, 2 * B)
    cache.release(cache.adopt(other, prefill_pages(cache, pays(cache, other)), "a"))
    cache.close()
    with make(tmp_path / "s") as again:
        m = again.match(other, "a")
        assert m.ssd_blocks == 2 and torch.equal(again.read_blocks(m), pays(again, other))
        again.release(m)


def test_errors_leave_the_callers_pages_alone(tmp_path):
    rng = np.random.default_rng(5)
    cache = make(tmp_path / "s")
    toks = rand_tokens(rng, 3 * B)
    want = pays(cache, toks)
    cached = cache.insert(toks[:B], want[:1], "a")
    pages = prefill_pages(cache, want)
    bad = [
        (pages[:2], "expected 3"),                                   # a wrong count
        ([pages[0], pages[0], pages[1]], "repeat"),                  # repeated ids
        ([pages[0], cached.block_ids[0], pages[2]], "not a private page"),   # a cached page
        ([pages[0], pages[1], 10 ** 6], "not an allocated page"),    # not a page
    ]
    for ids, msg in bad:
        with pytest.raises(ValueError, match=msg):
            cache.adopt(toks, ids, "a")
    with pytest.raises(ValueError, match="extend"):
        cache.adopt(toks[B:], pages[:2], "a", match=cached)
    with pytest.raises(ValueError, match="another namespace"):
        cache.adopt(toks, pages[1:], "b", match=cached)
    assert cache.pool.stats()["private_blocks"] == 3 and cached.num_blocks == 1
    assert cache.peek(toks, "a") == B                  # nothing was published
    m = cache.adopt(toks, pages[1:], "a", match=cached)   # the pages still work
    assert m is cached and m.num_blocks == 3 and torch.equal(cache.read_blocks(m), want)
    cache.pool.release(pages[:1])                      # block 0 was cached already: the caller's own
    cache.release(m)
    with pytest.raises(ValueError, match="released"):
        cache.adopt(toks, [], "a", match=m)
    cache.flush()                                      # the SSD job's own hold ends
    assert cache.pool.stats()["referenced_blocks"] == 0
    cache.close()


def test_adopt_without_lower_tiers_and_without_new_blocks():
    cache = make()                                      # the pool alone
    toks = np.arange(2 * B + 3, dtype="<u4")
    want = pays(cache, toks)
    m = cache.adopt(toks, prefill_pages(cache, want), "a")
    assert cache.adopt(toks, [], "a", match=m) is m and m.num_blocks == 2
    assert torch.equal(cache.read_blocks(m), want)
    cache.release(m)
    assert cache.pool.stats()["referenced_blocks"] == 0 and cache.peek(toks, "a") == 2 * B
