"""The paged runtime (the engine's default) against the reference runtime, the oracle.

In reference precision both runtimes compute the same values, so every request must give
the same tokens and the same logits whatever the path (cold, both hit, bounded and exact
replay, recompute, decoder replay), the chunking of its prompt, the requests beside it,
the cache's state, and preemption. And the paged runtime must hold each cached prefix's
global KV once, whatever the number of sequences on it."""
from __future__ import annotations

import pytest

from dsv41.engine import Engine, ReplayConfig, SamplingParams

from .conftest import BLOCK, tokens

SP = SamplingParams(max_new_tokens=5, return_logits=True)


def _same(a, b) -> None:
    assert a.output_tokens == b.output_tokens, (a.output_tokens, b.output_tokens)
    assert len(a.logits) == len(b.logits)
    for x, y in zip(a.logits, b.logits):
        assert (x - y).abs().max().item() == 0.0


def _workload(eng: Engine, turns: list[tuple[list[int], object]]) -> list:
    return [eng.generate([p], SP, replay=rc)[0] for p, rc in turns]


@pytest.mark.parametrize("chunk", [8192, 24])
def test_every_path_gives_the_reference_tokens_and_logits(tiny_model, make_cache, chunk):
    shared = tokens(50, 3 * BLOCK + 5)
    base = tokens(51, 6 * BLOCK + 9)                          # cached, no snapshot at 6 blocks
    turns = [(shared, None),                                  # cold
             (shared + tokens(52, 9), None),                  # both hit (the snapshot at 53)
             (base, None),                                    # cold
             (base[:6 * BLOCK + 1] + tokens(53, 20), None),   # global hit, bounded replay
             (base[:6 * BLOCK + 1] + tokens(54, 20), "exact"),   # exact replay
             (base[:6 * BLOCK + 1] + tokens(56, 11), "off"),  # recompute
             (tokens(55, 90), ReplayConfig(decoder_replay=True))]
    outs = {}
    for runtime in ("reference", "paged"):
        cache, _ = make_cache()
        eng = Engine(tiny_model, cache=cache, runtime=runtime, max_prefill_tokens=chunk)
        assert eng.runtime.name == runtime
        outs[runtime] = _workload(eng, turns)
    for a, b in zip(outs["reference"], outs["paged"]):
        assert a.stats.path == b.stats.path
        _same(a, b)
    assert [o.stats.path for o in outs["paged"]] == [
        "cold", "both_hit", "cold", "encoder_replay", "encoder_replay", "recompute", "cold"]


def test_a_mixed_batch_with_chunked_prefills_equals_the_reference(tiny_model, make_cache):
    """Prompts of every size, some hitting a cached prefix, run together in chunks of a
    small budget over many steps: the same tokens and logits as the reference runtime on
    the same workload (whole prompts, one per step)."""
    prefix = tokens(60, 4 * BLOCK)
    prompts = [prefix + tokens(62, 40), tokens(63, 100), prefix[:BLOCK] + tokens(64, 7),
               tokens(65, 1), prefix + tokens(66, 2)]
    outs = {}
    for runtime in ("reference", "paged"):
        cache, _ = make_cache()
        Engine(tiny_model, cache=cache, runtime=runtime).generate(
            [prefix + tokens(61, 3)], SamplingParams(max_new_tokens=1))
        eng = Engine(tiny_model, cache=cache, runtime=runtime, max_batch=8,
                     max_prefill_tokens=37)
        outs[runtime] = eng.generate(prompts, SP)
        if runtime == "paged":
            assert eng.counters["steps"] > 6      # the prompts ran in chunks over many steps
            assert eng.request_counts() == {"waiting": 0, "running": 0}
            assert eng.memory_stats()["sequence_slots"]["used"] == 0
    assert {o.stats.path for o in outs["paged"]} >= {"cold", "encoder_replay"}
    for a, b in zip(outs["reference"], outs["paged"]):
        assert a.stats.path == b.stats.path
        _same(a, b)


def test_sequences_on_one_prefix_hold_its_global_kv_once(tiny_model, make_cache):
    """N sequences sharing a P-token prefix: the pool holds the prefix's pages once; each
    sequence adds only the pages of its own tokens."""
    cache, _ = make_cache()
    eng = Engine(tiny_model, cache=cache, max_batch=8)
    P, N = 6 * BLOCK, 6
    prefix = tokens(70, P)
    eng.generate([prefix + [1]], SamplingParams(max_new_tokens=1))    # the prefix is cached
    pool = cache.pool
    cached = pool.num_cached()
    assert cached == P // BLOCK
    rids = [eng.add_request(prefix + tokens(71 + i, 5), SamplingParams(max_new_tokens=8))
            for i in range(N)]
    eng.step()                                # all N prefilled in one step (one page each)
    stats = pool.stats()
    assert stats["private_blocks"] == N       # each sequence's own partial page
    assert pool.num_cached() == cached + N    # the prefix's pages are not copied
    for r in rids:
        seq = eng.sequence(r)
        assert seq.kv.pages[:P // BLOCK] == list(seq.match.block_ids[:P // BLOCK])
    assert pool.slot(eng.sequence(rids[0]).kv.pages[0]).refs == N        # shared by reference
    while eng.has_unfinished():
        eng.step()
    assert pool.stats()["referenced_blocks"] == 0


def test_preemption_under_a_small_pool_changes_no_token(tiny_model):
    """A pool too small for every sequence at once: the newest are preempted and recomputed
    from their tokens so far, and every request still gets the tokens it gets alone."""
    prompts = [tokens(80 + i, 50) for i in range(4)]     # each needs a 2nd page at 64
    sp = SamplingParams(max_new_tokens=30)
    from dsv41.cache.layout import BlockLayout
    page = BlockLayout(tiny_model.config, 64).block_bytes
    eng = Engine(tiny_model, kv_memory_bytes=5 * page, max_batch=4)
    outs = eng.generate(prompts, sp)
    assert eng.counters["preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.output_tokens == Engine(tiny_model, runtime="reference").generate([p], sp)[0].output_tokens
    assert eng.memory_stats()["global_kv"]["used"] == 0


def test_a_request_the_pool_can_never_hold_is_refused(tiny_model):
    from dsv41.cache.layout import BlockLayout
    page = BlockLayout(tiny_model.config, 64).block_bytes
    eng = Engine(tiny_model, kv_memory_bytes=2 * page)
    with pytest.raises(ValueError, match="KV pages"):
        eng.add_request(tokens(90, 200), SamplingParams(max_new_tokens=4))


def test_slots_go_back_and_are_reused(tiny_model):
    eng = Engine(tiny_model, max_batch=2)
    outs = eng.generate([tokens(100 + i, 20 + i) for i in range(7)],
                        SamplingParams(max_new_tokens=3))
    assert len(outs) == 7 and all(len(o.output_tokens) == 3 for o in outs)
    s = eng.memory_stats()["sequence_slots"]
    assert s["used"] == 0 and s["free"] == s["total"] == 2


def test_abort_mid_prefill_releases_pages_and_slot(tiny_model, make_cache):
    cache, _ = make_cache()
    eng = Engine(tiny_model, cache=cache, max_prefill_tokens=16)
    rid = eng.add_request(tokens(110, 70), SamplingParams(max_new_tokens=3))
    eng.step()
    eng.step()
    assert eng.request_counts()["running"] == 1
    assert cache.pool.stats()["private_blocks"] > 0
    out = eng.abort(rid)
    assert out.finish_reason == "abort" and out.output_tokens == []
    assert cache.pool.stats()["referenced_blocks"] == 0
    assert eng.memory_stats()["sequence_slots"]["used"] == 0


def test_runtime_choice(tiny_model):
    from dsv41 import Model, ModelConfig
    assert Engine(tiny_model).runtime.name == "paged"
    v4 = Model.synthetic(ModelConfig.preset("v4-tiny"), seed=0)
    assert Engine(v4).runtime.name == "reference"            # auto: V4's FP8 KV
    with pytest.raises(ValueError, match="cannot run this model"):
        Engine(v4, runtime="paged")
    with pytest.raises(ValueError, match="runtime must be one of"):
        Engine(tiny_model, runtime="fast")


def test_eviction_under_load_keeps_pages_in_use_and_changes_no_token(tiny_model):
    """A pool barely larger than one step's working set: finished prefixes sit cached and
    unreferenced, and new sequences' private pages evict them (oldest first) while a
    sequence reading another cached prefix keeps its pages. Every request still gets the
    tokens the reference runtime gives it."""
    from dsv41.cache import CacheConfig, PrefixCache
    from dsv41.cache.layout import BlockLayout
    page = BlockLayout(tiny_model.config, BLOCK).block_bytes
    cc = CacheConfig(block_tokens=BLOCK, device="cpu", gpu_capacity_bytes=16 * page,
                     swa_capacity_bytes=1 << 26, store_durability="none")
    sp = SamplingParams(max_new_tokens=6)
    with PrefixCache.for_model(tiny_model, cc) as cache:
        eng = Engine(tiny_model, cache=cache, max_batch=4)
        warm = [tokens(120 + i, 4 * BLOCK + 3) for i in range(3)]
        eng.generate(warm, sp)                                # 12 cached pages, unreferenced
        assert cache.pool.stats()["cached_blocks"] >= 12
        hit = warm[0][:4 * BLOCK] + tokens(130, 9)            # maps 4 of the cached pages
        new = [tokens(131 + i, 3 * BLOCK + 5) for i in range(3)]
        outs = eng.generate([hit] + new, sp)
        evicted = cache.metrics.evictions.total()
        assert evicted > 0
        assert outs[0].stats.path in ("encoder_replay", "both_hit")
        assert outs[0].stats.global_hit_tokens == 4 * BLOCK   # its pages were not evicted
    ref = Engine(tiny_model, runtime="reference")
    for p, o in zip([hit] + new, outs):
        assert o.output_tokens == ref.generate([p], sp)[0].output_tokens


def test_a_step_budget_too_large_to_preallocate_is_refused(tiny_model):
    """The paged runtime preallocates a step's scratch rows: a budget meant as "no limit"
    is an error naming the budget, not an allocator failure."""
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Engine(tiny_model, max_prefill_tokens=1 << 30)
