"""DeepSeek-V4 (v4-tiny) through the engine and the tiered cache: a turn resumed from the
SWA snapshot (whose compressor state includes V4's carried overlap window) and a recompute
after the snapshot expired both give the logits of a live session / a cold run. V4 runs
with replay off: encoder replay over cached global KV is refused for overlapping windows."""
from __future__ import annotations

import pytest
import torch

from dsv41.cache import CacheConfig, PrefixCache
from dsv41.config import ModelConfig
from dsv41.engine import Engine, SamplingParams
from dsv41.model import Model

from .conftest import Clock, tokens

SP = SamplingParams(max_new_tokens=2, return_logits=True)


@pytest.fixture(scope="module")
def v4():
    return Model.synthetic(ModelConfig.preset("v4-tiny"), seed=0)


def test_v4_resume_and_recompute_equal_live(v4, tmp_path):
    clock = Clock()
    cc = CacheConfig(block_tokens=128, device="cpu", gpu_capacity_bytes=1 << 24,
                     swa_capacity_bytes=1 << 26, swa_ttl_s=10.0, store_dir=str(tmp_path / "s"),
                     store_durability="none", swa_checkpoint_tokens=None)  # no SSD checkpoints:
    cache = PrefixCache.for_model(v4, cc, clock=clock)  # their resume is tests/engine/test_v4_checkpoints.py
    try:
        eng = Engine(v4, cache=cache, replay="off")
        p1 = tokens(1, 133)
        o1 = eng.generate([p1], SP)[0]
        assert o1.stats.path == "cold"
        p2 = p1 + o1.output_tokens + tokens(2, 5)
        o2 = eng.generate([p2], SP)[0]
        assert o2.stats.path == "both_hit" and o2.stats.swa_hit_tokens > 128
        live = v4.new_state()
        assert torch.equal(v4.prefill(p1, live), o1.logits[0])
        for t in o1.output_tokens[:-1]:
            v4.decode_step(t, live)
        assert torch.equal(v4.prefill(p2[live.position:], live), o2.logits[0])
        clock.t = 100.0  # the snapshots expire: the global hit alone is recomputed
        o3 = eng.generate([p2], SP)[0]
        assert o3.stats.path == "recompute"
        assert torch.equal(o3.logits[0], o2.logits[0])
        # asked for bounded replay, V4 recomputes (its carried window is not in the cache)
        o4 = Engine(v4, cache=cache, replay="bounded").generate([p2], SP)[0]
        assert o4.stats.path == "recompute" and torch.equal(o4.logits[0], o2.logits[0])
    finally:
        cache.close()
