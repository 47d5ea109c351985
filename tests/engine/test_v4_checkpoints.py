"""V4's SWA checkpoints on the SSD (cache/swa_checkpoints.py) through the engine: a V4-tiny
session resumed after the host SWA pool's TTL, from a persisted checkpoint (same cache, and
a restarted one), gives the logits of the live session bit for bit; checkpoints are written
every N tokens and at the end of prompt and output; a corrupted checkpoint is a miss, never
served; a V4.1 model writes none."""
from __future__ import annotations

import os

import pytest
import torch

from dsv41.cache import CacheConfig, PrefixCache
from dsv41.config import ModelConfig
from dsv41.engine import Engine, SamplingParams
from dsv41.model import Model

from .conftest import Clock, tokens

SP = SamplingParams(max_new_tokens=2, return_logits=True)
EVERY = 256


@pytest.fixture(scope="module")
def v4():
    return Model.synthetic(ModelConfig.preset("v4-tiny"), seed=0)


def _cc(path, **kw) -> CacheConfig:
    base = dict(block_tokens=128, device="cpu", gpu_capacity_bytes=1 << 24, swa_capacity_bytes=1 << 26,
                swa_ttl_s=10.0, store_dir=str(path), store_durability="none", store_ttl_s=None,
                swa_checkpoint_tokens=EVERY)
    base.update(kw)
    return CacheConfig(**base)


def _checkpoints(cache) -> list[int]:
    d = cache.checkpoints.dir
    return sorted(int(n.split("-")[1]) for n in os.listdir(d) if n.endswith(".swa"))


def test_v4_resume_from_checkpoint_equals_live(v4, tmp_path):
    clock = Clock()
    cache = PrefixCache.for_model(v4, _cc(tmp_path / "s"), clock=clock)
    try:
        eng = Engine(v4, cache=cache, replay="off")
        p1 = tokens(1, 300)
        o1 = eng.generate([p1], SP)[0]
        p2 = p1 + o1.output_tokens + tokens(2, 5)
        o2 = eng.generate([p2], SP)[0]          # resumes from the host pool's snapshot
        assert o2.stats.path == "both_hit"
        live = v4.new_state()                   # the live session, in the prefill's chunks
        v4.prefill(p1[:EVERY], live)
        assert torch.equal(v4.prefill(p1[EVERY:], live), o1.logits[0])
        v4.decode_step(o1.output_tokens[0], live)
        assert torch.equal(v4.prefill(p2[live.position:], live), o2.logits[0])
        clock.t = 100.0                         # the host snapshots expire
        o3 = eng.generate([p2], SP)[0]
        assert o3.stats.path == "both_hit" and o3.stats.swa_hit_tokens == 301
        assert cache.stats()["swa_checkpoints"]["hits"] == 1
        assert torch.equal(o3.logits[0], o2.logits[0]) and torch.equal(o3.logits[1], o2.logits[1])
        cache.flush()
    finally:
        cache.close()
    # a restarted process: blocks from the SSD store, SWA state from the checkpoint
    cache = PrefixCache.for_model(v4, _cc(tmp_path / "s"), clock=clock)
    try:
        o4 = Engine(v4, cache=cache, replay="off").generate([p2], SP)[0]
        assert o4.stats.path == "both_hit" and o4.stats.ssd_hit_tokens == 256 and o4.stats.swa_hit_tokens == 301
        assert torch.equal(o4.logits[0], o2.logits[0]) and torch.equal(o4.logits[1], o2.logits[1])
    finally:
        cache.close()


def test_v4_checkpoint_cadence(v4, tmp_path):
    cache = PrefixCache.for_model(v4, _cc(tmp_path / "s"), clock=Clock())
    try:
        assert cache.checkpoint_tokens == EVERY
        o = Engine(v4, cache=cache, replay="off").generate(
            [tokens(3, 700)], SamplingParams(max_new_tokens=70))[0]
        # every 256 in the prefill, end of prompt (700), 768 while decoding, end of output
        # (700 + 69: the last sampled token is not in the state yet)
        assert _checkpoints(cache) == [256, 512, 700, 768, 769]
        st = cache.stats()["swa_checkpoints"]
        assert st["written"] == 5 and st["bytes_on_disk"] == st["bytes_written"] > 0
        assert o.stats.bytes["swa_checkpoint_written"] == st["bytes_written"]
    finally:
        cache.close()


def test_corrupted_checkpoint_is_a_miss(v4, tmp_path):
    clock = Clock()
    cache = PrefixCache.for_model(v4, _cc(tmp_path / "s"), clock=clock)
    try:
        eng = Engine(v4, cache=cache, replay="off")
        p1 = tokens(4, 300)
        o1 = eng.generate([p1], SP)[0]
        p2 = p1 + o1.output_tokens + tokens(5, 5)
        o2 = eng.generate([p2], SP)[0]
        d = cache.checkpoints.dir
        for name in os.listdir(d):              # one flipped byte in each checkpoint's payload
            path = os.path.join(d, name)
            data = bytearray(open(path, "rb").read())
            data[-100] ^= 0x01
            open(path, "wb").write(bytes(data))
        clock.t = 100.0
        o3 = eng.generate([p2], SP)[0]
        assert o3.stats.path == "recompute" and o3.stats.swa_hit_tokens == 0
        st = cache.stats()["swa_checkpoints"]
        assert st["corrupt"] >= 1 and st["hits"] == 0
        assert torch.equal(o3.logits[0], o2.logits[0])
    finally:
        cache.close()


def test_v41_writes_no_checkpoints(tiny_model, tmp_path):
    cache = PrefixCache.for_model(tiny_model, _cc(tmp_path / "s", block_tokens=16, swa_checkpoint_tokens="auto"),
                                  clock=Clock())
    try:
        assert cache.checkpoint_tokens is None and cache.checkpoints is None
        Engine(tiny_model, cache=cache).generate([tokens(6, 300)], SamplingParams(max_new_tokens=4))
        assert not os.path.exists(tmp_path / "s" / "swa_checkpoints")
        assert cache.stats()["swa_checkpoints"] is None
    finally:
        cache.close()


def test_v4_default_cadence(v4, tmp_path):
    cache = PrefixCache.for_model(v4, _cc(tmp_path / "s", swa_checkpoint_tokens="auto"), clock=Clock())
    try:
        assert cache.checkpoint_tokens == 1024
    finally:
        cache.close()
    with pytest.raises(ValueError, match="multiple of block_tokens"):
        PrefixCache.for_model(v4, _cc(tmp_path / "t", swa_checkpoint_tokens=100))


def test_v4_checkpoint_once_per_position(v4, tmp_path):
    """The end of the output on a cadence point (700 + 68 = 768) writes one checkpoint."""
    cache = PrefixCache.for_model(v4, _cc(tmp_path / "s"), clock=Clock())
    try:
        Engine(v4, cache=cache, replay="off").generate([tokens(3, 700)], SamplingParams(max_new_tokens=69))
        assert _checkpoints(cache) == [256, 512, 700, 768]
        assert cache.stats()["swa_checkpoints"]["written"] == 4
    finally:
        cache.close()


def test_sessions_sharing_blocks_keep_their_checkpoints(v4, tmp_path):
    """Two sessions after the same full blocks: each resumes from its own checkpoint, and
    looking at the other's (same block hash, other tail) neither serves nor removes it."""
    clock = Clock()
    cache = PrefixCache.for_model(v4, _cc(tmp_path / "s"), clock=clock)
    try:
        eng = Engine(v4, cache=cache, replay="off")
        shared = tokens(7, 256)
        firsts = [shared + tokens(8 + i, 20) for i in range(2)]
        outs = [eng.generate([p], SP)[0] for p in firsts]
        seconds = [p + o.output_tokens + tokens(10 + i, 5) for i, (p, o) in enumerate(zip(firsts, outs))]
        live = [eng.generate([p], SP)[0] for p in seconds]
        clock.t = 100.0
        for p, want in zip(seconds, live):
            o = eng.generate([p], SP)[0]
            assert o.stats.path == "both_hit" and o.stats.swa_hit_tokens == 277
            assert torch.equal(o.logits[0], want.logits[0])
        st = cache.stats()["swa_checkpoints"]
        # 3 hits: the two resumes, and the second session's first turn, which found the
        # first session's cadence checkpoint of the shared blocks (256) and resumed there
        # 9 files: per session 276/277/283/284, plus 256; the resumed turns rewrote their
        # own 283/284 (same prefix, same name) instead of overwriting the other session's
        assert st["hits"] == 3 and st["corrupt"] == 0 and st["files"] == 9 and st["written"] == 13
    finally:
        cache.close()
