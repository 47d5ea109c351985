"""Round trip through the model (docs/design.md#tiers): a sequence's state goes into the cache,
leaves GPU memory, comes back from the SSD tier (and its SWA snapshot from the host pool),
and the resumed state is bit-identical to the live one: same global KV, same SWA rings,
same compressor state, and identical logits for the next tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("dsv41.model", reason="needs the model (dsv41.model)")

from dsv41.cache import CacheConfig, PrefixCache  # noqa: E402
from dsv41.config import ModelConfig  # noqa: E402
from dsv41.engine.cache_adapter import (export_blocks, import_blocks, snapshot_boundary,  # noqa: E402
                                        snapshot_from_cache, snapshot_to_cache)
from dsv41.model import Model, state_bytes_equal, state_diff  # noqa: E402

TINY = ModelConfig.preset("v41-tiny")


@pytest.fixture(scope="module")
def model():
    return Model.synthetic(TINY, seed=3)


def assert_same_global_kv(resumed, live, tokens: int) -> None:
    """The imported entries equal the live session's first entries, bit for bit."""
    for name in ("main_kv", "index_keys"):
        for layer, store in getattr(live, name).items():
            n = tokens // TINY.compress_ratios[layer]
            mine = getattr(resumed, name)[layer]
            assert mine.n == n, (name, layer)
            for a, b in zip(mine.committed(), store.committed()):
                assert torch.equal(a.view(torch.uint8), b[:n].view(torch.uint8)), (name, layer)


def _cache(model, tmp_path, **kw):
    cc = CacheConfig(block_tokens=16, gpu_capacity_bytes=64 << 20, device="cpu", swa_capacity_bytes=64 << 20,
                     store_dir=str(tmp_path / "store"), store_durability="none", **kw)
    return PrefixCache.for_model(model, cc)


@pytest.mark.parametrize("prompt_len", [16 * 5 + 7, 16 * 4])  # with and without an unaligned tail
def test_state_through_the_ssd_tier_resumes_bit_identical(model, tmp_path, prompt_len):
    rng = np.random.default_rng(prompt_len)
    prompt = rng.integers(0, TINY.vocab_size, prompt_len).tolist()
    follow = rng.integers(0, TINY.vocab_size, 6).tolist()
    cache = _cache(model, tmp_path)
    layout = cache.layout
    B = layout.block_tokens

    live = model.new_state()
    model.prefill(prompt, live)
    m = cache.match(prompt, "t")
    assert m.num_blocks == 0
    cache.insert(prompt, export_blocks(layout, live, 0, prompt_len // B), "t", match=m)
    cache.put_snapshot(prompt, snapshot_to_cache(live.snapshot_swa(snapshot_boundary(layout, live.position))), "t")
    cache.release(m)
    cache.flush()  # the background SSD writes are acknowledged
    cache.pool.evict_all()  # the global KV leaves (GPU) memory: only the SSD has it now

    hit = cache.match(prompt, "t")
    assert (hit.gpu_blocks, hit.ssd_blocks) == (0, prompt_len // B)
    assert hit.snapshot_tokens == prompt_len
    resumed = model.new_state()
    import_blocks(layout, resumed, cache.read_blocks(hit))
    # The global KV of the hit is bit-identical to what the live session computed.
    assert_same_global_kv(resumed, live, hit.cached_tokens)
    resumed.restore_swa(snapshot_from_cache(hit.snapshot))
    cache.release(hit)
    assert state_bytes_equal(resumed, live), state_diff(resumed, live)
    for tok in follow:  # identical logits, token after token
        assert torch.equal(model.decode_step(tok, resumed), model.decode_step(tok, live))
    assert state_bytes_equal(resumed, live), state_diff(resumed, live)
    cache.close()


def test_global_kv_survives_a_restart_bit_identical(model, tmp_path):
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, TINY.vocab_size, 16 * 6).tolist()
    live = model.new_state()
    model.prefill(prompt, live)
    with _cache(model, tmp_path) as cache:
        cache.release(cache.insert(prompt, export_blocks(cache.layout, live, 0, 6), "t"))
    with _cache(model, tmp_path) as cache:  # a new process: only the SSD tier remains
        hit = cache.match(prompt, "t")
        assert hit.ssd_blocks == 6 and hit.snapshot is None
        resumed = model.new_state()
        import_blocks(cache.layout, resumed, cache.read_blocks(hit))
        assert_same_global_kv(resumed, live, 96)
        cache.release(hit)
    # Another model (other weights) never sees these blocks.
    other = Model.synthetic(TINY, seed=4)
    with PrefixCache.for_model(other, CacheConfig(block_tokens=16, device="cpu", swa_capacity_bytes=0,
                                                  store_dir=str(tmp_path / "store2"))) as c2:
        assert c2.match(prompt, "t").num_blocks == 0
