"""GlobalKVPool: sharing, reference counts, LRU eviction, capacity, and exact matching."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41.cache.errors import PayloadError, PoolFullError
from dsv41.cache.global_pool import GlobalKVPool
from dsv41.cache.hashing import BlockHasher

from .helpers import B, LAYOUT, chain_payloads, key, rand_tokens, token_rows, weak_hash


def make_pool(blocks: int) -> GlobalKVPool:
    return GlobalKVPool(LAYOUT, blocks * LAYOUT.block_bytes, device="cpu")


def insert_seq(pool, tokens, k=None, hasher=None, parent=None, start=0):
    k = k or key()
    hasher = hasher or BlockHasher(B)
    hashes = hasher.hash_blocks(tokens, k)
    pays = torch.from_numpy(chain_payloads(tokens, k))
    bids = pool.insert_many(k, parent, hashes[start:], token_rows(tokens, len(hashes))[start:], start, pays[start:])
    return hashes, bids, pays


def test_shared_prefix_is_stored_once_and_matches_exactly():
    pool = make_pool(16)
    rng = np.random.default_rng(0)
    a = rand_tokens(rng, 4 * B)
    b = np.concatenate([a[: 2 * B], rand_tokens(rng, 2 * B)])
    ha, ba, pa = insert_seq(pool, a)
    hb, bb, pb = insert_seq(pool, b)
    assert bb[:2] == ba[:2] and set(bb[2:]).isdisjoint(ba)  # shared head, own tail
    assert pool.num_cached() == 6
    assert pool.slot(ba[0]).refs == 2 and pool.slot(ba[3]).refs == 1
    m = pool.match(key(), hb, token_rows(b, 4))
    assert m == bb and torch.equal(pool.read(m), pb)
    # A request diverging inside block 2 matches blocks 0-1 only.
    c = b.copy()
    c[2 * B + 5] += 1
    hc = BlockHasher(B).hash_blocks(c, key())
    assert pool.match(key(), hc, token_rows(c, 4)) == bb[:2]


def test_lru_evicts_unreferenced_tails_first_and_never_referenced_blocks():
    pool = make_pool(6)
    rng = np.random.default_rng(1)
    a, b = rand_tokens(rng, 3 * B), rand_tokens(rng, 3 * B)
    ha, ba, _ = insert_seq(pool, a)
    hb, bb, _ = insert_seq(pool, b)
    pool.release(ba)  # a's blocks enter the LRU, deepest first
    c = rand_tokens(rng, B)
    with pool.lock:
        hc, bc, _ = insert_seq(pool, c)  # needs one block: a's tail goes
    assert pool.match(key(), ha, token_rows(a, 3)) == ba[:2]
    assert pool.metrics.evictions.value(tier="gpu", cause="capacity") == 1
    pool.release(bb)
    pool.touch(bb)  # b used again recently: a's remaining blocks are the oldest
    insert_seq(pool, rand_tokens(rng, 2 * B))
    assert pool.match(key(), ha, token_rows(a, 3)) == [] and pool.match(key(), hb, token_rows(b, 3)) == bb
    # Everything referenced: nothing can be evicted.
    full = make_pool(2)
    insert_seq(full, rand_tokens(rng, 2 * B))
    with pytest.raises(PoolFullError):
        full.insert(key(), None, b"x", rand_tokens(rng, B), 0, torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8))
    assert insert_seq(full, rand_tokens(rng, B))[1] == []  # insert_many stops, does not raise


def test_evicting_a_block_frees_its_unreferenced_descendants():
    pool = make_pool(3)
    rng = np.random.default_rng(2)
    a = rand_tokens(rng, 3 * B)
    ha, ba, _ = insert_seq(pool, a)
    pool.release(ba)
    for b in ba[1:]:  # make the head the least recently used
        pool._lru.move_to_end(b)
    insert_seq(pool, rand_tokens(rng, B))  # evicts block 0: blocks 1-2 are unreachable, freed too
    assert pool.num_cached() == 1 and pool.match(key(), ha, token_rows(a, 3)) == []
    assert pool.metrics.evictions.value(tier="gpu", cause="orphan") == 2


def test_weak_hash_collisions_never_serve_the_wrong_block():
    hasher = BlockHasher(B, weak_hash, "weak")
    pool = make_pool(200)
    rng = np.random.default_rng(3)
    seqs = [rand_tokens(rng, 3 * B) for _ in range(40)]  # 120 blocks in 256 buckets
    stored = [insert_seq(pool, s, hasher=hasher) for s in seqs]
    assert pool.metrics.collisions.value(tier="gpu") > 0 or len({h for x in stored for h in x[0]}) < 120
    for s, (hashes, bids, pays) in zip(seqs, stored):
        m = pool.match(key(), hashes, token_rows(s, 3))
        assert m == bids and torch.equal(pool.read(m), pays)
    # A request that was never inserted, with the same 1-byte hashes as a stored one,
    # matches nothing.
    probe = rand_tokens(rng, 3 * B)
    assert pool.match(key(), stored[0][0], token_rows(probe, 3)) == []


def test_namespaces_do_not_share_blocks():
    pool = make_pool(8)
    t = np.arange(2 * B, dtype="<u4")
    h1, b1, _ = insert_seq(pool, t, k=key("a"))
    h2 = BlockHasher(B).hash_blocks(t, key("b"))
    assert pool.match(key("b"), h2, token_rows(t, 2)) == []
    # Even with the other namespace's hashes, a different key does not match the first block.
    assert pool.match(key("b"), h1, token_rows(t, 2)) == []
    h2, b2, _ = insert_seq(pool, t, k=key("b"))
    assert set(b1).isdisjoint(b2)


def test_reference_errors_and_payload_checks():
    pool = make_pool(2)
    hashes, bids, _ = insert_seq(pool, np.arange(B))
    pool.release(bids)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(bids)
    with pytest.raises(PayloadError):
        pool.write(bids, torch.zeros(1, 7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="holds no block"):
        GlobalKVPool(LAYOUT, 10, device="cpu")


def test_private_pages_are_written_in_place_then_published_without_a_copy():
    pool = make_pool(6)
    rng = np.random.default_rng(5)
    toks = rand_tokens(rng, 3 * B)
    hashes = BlockHasher(B).hash_blocks(toks, key())
    pays = torch.from_numpy(chain_payloads(toks, key()))
    mine = pool.allocate(3)
    assert len(set(mine)) == 3 and pool.stats()["private_blocks"] == 3
    assert pool.match(key(), hashes, token_rows(toks, 3)) == []   # private pages are not found
    pool.write(mine, pays)                                         # the sequence's own writes
    parent = None
    for i, bid in enumerate(mine):
        got = pool.publish(bid, key(), parent, hashes[i], token_rows(toks, 3)[i], i)
        assert got == bid                                          # adopted in place
        parent = bid
    assert pool.stats()["private_blocks"] == 0
    assert pool.match(key(), hashes, token_rows(toks, 3)) == mine
    assert torch.equal(pool.read(mine), pays)
    # A second sequence computed the same prefix privately: publishing keeps the cached
    # page and hands it a reference; its own page goes back to the free list on release.
    twin = pool.allocate(1)
    pool.write(twin, pays[:1])
    got = pool.publish(twin[0], key(), None, hashes[0], token_rows(toks, 3)[0], 0)
    assert got == mine[0] and pool.slot(mine[0]).refs == 2
    free_before = len(pool._free)
    pool.release(twin)
    assert len(pool._free) == free_before + 1                      # freed, not cached
    assert pool.metrics.evictions.value(tier="gpu", cause="capacity") == 0


def test_allocate_evicts_lru_pages_all_or_nothing_and_publish_checks():
    pool = make_pool(4)
    rng = np.random.default_rng(6)
    toks = rand_tokens(rng, 2 * B)
    hashes, bids, _ = insert_seq(pool, toks)
    pool.release(bids)                                             # cached, evictable
    held = pool.allocate(2)                                        # the free pages
    with pytest.raises(PoolFullError, match="3 pages asked"):
        pool.allocate(3)
    assert pool.num_cached() == 4                                  # nothing was taken
    more = pool.allocate(2)                                        # evicts both cached pages
    assert set(more) == set(bids) and pool.match(key(), hashes, token_rows(toks, 2)) == []
    with pytest.raises(PoolFullError):
        pool.allocate(1)
    with pytest.raises(ValueError, match="not an indexed block"):   # a private parent
        pool.publish(more[1], key(), held[0], hashes[1], token_rows(toks, 2)[1], 1)
    assert pool.publish(more[0], key(), None, hashes[0], token_rows(toks, 2)[0], 0) == more[0]
    with pytest.raises(ValueError, match="not a private page"):
        pool.publish(more[0], key(), None, hashes[0], token_rows(toks, 2)[0], 0)
    pool.release(held + more)
    assert pool.num_cached() == 1 and pool.num_free() == 4          # only the published page stays
