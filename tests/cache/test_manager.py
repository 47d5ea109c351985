"""PrefixCache: lookups across the three tiers, promotion, snapshots, admission, namespaces,
faults, and many threads at once."""
from __future__ import annotations

import errno
import threading

import numpy as np
import pytest
import torch

from dsv41.cache import CacheConfig, PrefixCache, TensorSnapshot
from dsv41.cache.errors import PayloadError

from .helpers import B, LAYOUT, TINY, WEIGHTS_ID, chain_payloads, rand_tokens, weak_hash
from .test_metrics import check_exposition

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


def payloads(cache: PrefixCache, tokens, start=0) -> torch.Tensor:
    """The 'KV' of each full block: a function of the whole prefix and the namespace key."""
    return torch.from_numpy(chain_payloads(np.asarray(tokens, "<u4"), cache.key("a")))[start:]


def snapshot(n: int, seed: int) -> TensorSnapshot:
    g = torch.Generator().manual_seed(seed)
    return TensorSnapshot(n, {"swa": torch.randn(4, 8, generator=g)}, {"n": n})


def test_tiers_in_order_gpu_then_ssd_then_snapshot(tmp_path):
    rng = np.random.default_rng(0)
    cache = make(tmp_path)
    prompt = rand_tokens(rng, 5 * B + 9)
    m = cache.match(prompt, "a")
    assert (m.num_blocks, m.snapshot) == (0, None)
    cache.insert(prompt, payloads(cache, prompt), "a", match=m)
    assert cache.put_snapshot(prompt, snapshot(prompt.size, 1), "a")
    cache.release(m)
    # Everything hits: the GPU pool, and the exact snapshot of the whole prompt.
    m = cache.match(prompt, "a")
    assert (m.gpu_blocks, m.ssd_blocks, m.cached_tokens, m.snapshot_tokens) == (5, 0, 5 * B, prompt.size)
    assert torch.equal(cache.read_blocks(m), payloads(cache, prompt))
    assert torch.equal(m.snapshot.tensors["swa"], snapshot(prompt.size, 1).tensors["swa"])
    cache.release(m)
    cache.flush()  # SSD writes are in the background: acknowledged (and readable) now
    # Drop the GPU copies: the SSD tier serves them, verified, and promotes them back.
    cache.pool.evict_all()
    m = cache.match(prompt, "a")
    assert (m.gpu_blocks, m.ssd_blocks) == (0, 5) and torch.equal(cache.read_blocks(m), payloads(cache, prompt))
    cache.release(m)
    m = cache.match(prompt, "a")
    assert (m.gpu_blocks, m.ssd_blocks) == (5, 0)
    cache.release(m)
    # A follow-up turn: prompt + output + new text. Blocks of the old prompt hit, the rest is new.
    turn = np.concatenate([prompt, rand_tokens(rng, 3 * B)])
    m = cache.match(turn, "a")
    assert m.cached_tokens == 5 * B and m.snapshot_tokens == prompt.size
    cache.insert(turn, payloads(cache, turn), "a", match=m)  # all blocks given: only new ones used
    assert m.num_blocks == turn.size // B
    cache.release(m)
    s = cache.stats()
    assert s["hit_rate"]["gpu"] > 0 and s["hit_rate"]["ssd"] > 0 and s["hit_rate"]["swa"] > 0
    samples = check_exposition(cache.metrics.to_prometheus())
    assert samples['dsv41_cache_promoted_blocks_total'] == 5
    cache.close()


def test_a_restart_serves_from_the_ssd_and_links_without_rewriting(tmp_path):
    rng = np.random.default_rng(1)
    prompt = rand_tokens(rng, 6 * B)
    with make(tmp_path) as cache:
        cache.release(cache.insert(prompt, payloads(cache, prompt), "a"))
        cache.flush()
        assert len(cache.store) == 6
    with make(tmp_path) as cache:
        # This process computes the first two blocks itself (it does not know they are stored)...
        m = cache.insert(prompt[: 2 * B], payloads(cache, prompt)[:2], "a")
        cache.release(m)
        cache.flush()
        assert len(cache.store) == 6  # found and verified, not written again
        # ...and the rest of the prefix continues from the SSD.
        m = cache.match(prompt, "a")
        assert (m.gpu_blocks, m.ssd_blocks) == (2, 4)
        assert torch.equal(cache.read_blocks(m), payloads(cache, prompt))
        cache.release(m)


def test_snapshot_needs_the_global_kv_of_its_blocks(tmp_path):
    cache = make(tmp_path)
    prompt = np.arange(3 * B + 4, dtype="<u4")
    cache.put_snapshot(prompt, snapshot(prompt.size, 2), "a")  # no blocks cached
    m = cache.match(prompt, "a")
    assert m.snapshot is None and m.num_blocks == 0  # resuming from it would miss global KV
    cache.release(m)
    cache.release(cache.insert(prompt, payloads(cache, prompt), "a"))
    m = cache.match(prompt, "a")
    assert m.snapshot_tokens == prompt.size
    cache.release(m)
    # max_tokens: the last token must run again for its logits.
    m = cache.match(prompt, "a", max_tokens=3 * B)
    assert m.cached_tokens == 3 * B and m.snapshot is None
    cache.release(m)
    m = cache.match(prompt, "a", max_tokens=3 * B - 1)
    assert m.cached_tokens == 2 * B  # aligned down to the block
    cache.release(m)
    cache.close()


def test_namespaces_never_share_any_tier(tmp_path):
    cache = make(tmp_path)
    prompt = np.arange(4 * B, dtype="<u4")
    cache.release(cache.insert(prompt, payloads(cache, prompt), "a"))
    cache.put_snapshot(prompt, snapshot(prompt.size, 3), "a")
    m = cache.match(prompt, "b")
    assert (m.num_blocks, m.snapshot) == (0, None)
    cache.release(m)
    cache.flush()
    cache.pool.evict_all()
    m = cache.match(prompt, "b")
    assert (m.num_blocks, m.ssd_blocks) == (0, 0)
    cache.release(m)
    assert cache.match(prompt, "a").ssd_blocks == 4
    cache.close()


def test_admission_after_n_hits(tmp_path):
    cache = make(tmp_path, admit_after_hits=2)
    prompt = np.arange(3 * B, dtype="<u4")
    cache.release(cache.insert(prompt, payloads(cache, prompt), "a"))
    assert len(cache.store) == 0  # not after the first prefill
    cache.release(cache.match(prompt, "a"))
    assert len(cache.store) == 0  # one hit
    cache.release(cache.match(prompt[: 2 * B], "a"))  # blocks 0-1 reach two hits
    cache.flush()
    assert len(cache.store) == 2
    cache.release(cache.match(prompt, "a"))
    cache.flush()
    assert len(cache.store) == 3
    cache.pool.evict_all()
    m = cache.match(prompt, "a")
    assert m.ssd_blocks == 3 and torch.equal(cache.read_blocks(m), payloads(cache, prompt))
    cache.release(m)
    cache.close()


def test_weak_hash_through_every_tier_never_serves_wrong_kv(tmp_path):
    cache = make(tmp_path, hash_fn=weak_hash, hash_name="weak-1-byte", gpu_capacity_bytes=40 * BB)
    rng = np.random.default_rng(4)
    prompts = [rand_tokens(rng, 3 * B) for _ in range(60)]  # 180 blocks > 40 in the pool
    for p in prompts:
        cache.release(cache.insert(p, payloads(cache, p), "a"))
    for p in prompts:
        m = cache.match(p, "a")
        assert m.num_blocks == 3 and torch.equal(cache.read_blocks(m), payloads(cache, p))
        cache.release(m)
    for _ in range(50):
        m = cache.match(rand_tokens(rng, 3 * B), "a")
        assert m.num_blocks == 0
        cache.release(m)
    assert cache.metrics.collisions.total() > 0
    cache.close()


def test_pool_full_still_persists_and_disk_full_keeps_memory(tmp_path):
    faults = {"on": False}

    def fault(stage):
        if faults["on"] and stage == "write":
            raise OSError(errno.ENOSPC, "No space left on device")

    cache = PrefixCache(TINY, CacheConfig(block_tokens=B, gpu_capacity_bytes=3 * BB, device="cpu",
                                          swa_capacity_bytes=0, store_dir=str(tmp_path / "s"),
                                          store_durability="none"), weights_id=WEIGHTS_ID, store_fault=fault)
    prompt = np.arange(5 * B, dtype="<u4")
    m = cache.insert(prompt, payloads(cache, prompt), "a")
    cache.flush()
    assert m.num_blocks == 3 and len(cache.store) == 5  # the pool holds 3, the SSD all 5
    cache.release(m)
    faults["on"] = True
    other = np.arange(5 * B, 7 * B, dtype="<u4")
    with pytest.warns(RuntimeWarning, match="not persisted"):
        m = cache.insert(other, payloads(cache, other), "a")
        cache.flush()  # the background commit that fails has finished
    assert m.num_blocks == 2 and len(cache.store) == 5
    assert cache.metrics.persist_failures.value(cause="no_space") == 1
    cache.release(m)
    m = cache.match(other, "a")  # the memory tier kept them
    assert m.gpu_blocks == 2 and torch.equal(cache.read_blocks(m), payloads(cache, other))
    cache.release(m)
    cache.close()


def test_bad_payloads_are_refused():
    cache = make()
    prompt = np.arange(2 * B, dtype="<u4")
    with pytest.raises(PayloadError, match="uint8"):
        cache.insert(prompt, torch.zeros(2, BB, dtype=torch.float32), "a")
    with pytest.raises(PayloadError, match="expected 2"):
        cache.insert(prompt, torch.zeros(3, BB, dtype=torch.uint8), "a")
    with pytest.raises(PayloadError, match="shape"):
        cache.insert(prompt, torch.zeros(2, BB - 1, dtype=torch.uint8), "a")
    m = cache.match(prompt, "a")
    cache.release(m)
    with pytest.raises(ValueError, match="released"):
        cache.insert(prompt, torch.zeros(2, BB, dtype=torch.uint8), "a", match=m)


def test_many_threads_look_up_and_insert_at_once(tmp_path):
    cache = make(tmp_path, gpu_capacity_bytes=24 * BB)  # small: evictions and promotions happen
    rng = np.random.default_rng(5)
    stems = [rand_tokens(rng, 2 * B) for _ in range(4)]
    errors: list[BaseException] = []

    def worker(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(25):
                prompt = np.concatenate([stems[int(r.integers(4))], r.integers(0, 3, int(r.integers(0, 3 * B))).astype("<u4")])
                m = cache.match(prompt, "a")
                want = payloads(cache, prompt)
                assert torch.equal(cache.read_blocks(m), want[: m.num_blocks])
                cache.insert(prompt, want, "a", match=m)
                assert torch.equal(cache.read_blocks(m), want[: m.num_blocks])
                if r.random() < 0.3:
                    cache.put_snapshot(prompt, snapshot(prompt.size, seed), "a")
                cache.release(m)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert cache.pool.stats()["referenced_blocks"] == 0
    assert cache.metrics.checksum_failures.total() == 0
    assert cache.store.verify()["corrupt"] == 0
    cache.close()
