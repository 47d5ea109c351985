"""Admission, planning and cancellation: a request holds cache references only from the
step that admits it to its end (finish or abort)."""
from __future__ import annotations

from dsv41.engine import Engine, SamplingParams

from .conftest import BLOCK, tokens


def referenced(cache) -> int:
    return cache.pool.stats()["referenced_blocks"]


def private(cache) -> int:
    """Pages running sequences write in place (the paged runtime's; they are in the cache's
    pool too, referenced by their sequence until the cache adopts them)."""
    return cache.pool.stats()["private_blocks"]


def test_refused_prompt_is_not_planned_and_pins_nothing(tiny_model, make_cache):
    cache, _ = make_cache()
    eng = Engine(tiny_model, cache=cache, max_prefill_tokens=40)
    shared = tokens(30, 4 * BLOCK)
    eng.generate([shared], SamplingParams(max_new_tokens=1))     # 4 cached blocks
    assert referenced(cache) == 0
    a = eng.add_request(tokens(31, 40), SamplingParams(max_new_tokens=3))   # fills the budget
    b = eng.add_request(shared + tokens(32, 8), SamplingParams(max_new_tokens=3))
    lookups = cache.metrics.lookups.value()
    eng.step()
    # b was refused: still waiting, never looked up, holding nothing; a runs and holds the
    # blocks it wrote back after its prefill
    assert [s.request_id for s in eng.scheduler.waiting] == [b]
    waiting = eng.scheduler.waiting[0]
    assert waiting.plan is None and waiting.match is None and waiting.state is None and waiting.kv is None
    assert cache.metrics.lookups.value() == lookups + 1
    assert referenced(cache) - private(cache) == 40 // BLOCK
    assert private(cache) == (1 if eng.runtime.name == "paged" else 0)   # a's partial page
    (running,) = eng.scheduler.running
    assert running.request_id == a
    # b is admitted next step and finds the prefix cached then
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step())
    assert outs[b].stats.global_hit_tokens == 4 * BLOCK and outs[b].stats.path == "both_hit"
    assert referenced(cache) == 0


def test_abort_waiting_and_running_releases_everything(tiny_model, make_cache):
    cache, _ = make_cache()
    eng = Engine(tiny_model, cache=cache, max_batch=1)
    shared = tokens(40, 3 * BLOCK)
    eng.generate([shared], SamplingParams(max_new_tokens=1))
    a = eng.add_request(shared + [1, 2, 3], SamplingParams(max_new_tokens=50))
    b = eng.add_request(shared + [4, 5, 6], SamplingParams(max_new_tokens=50))
    eng.step()
    eng.step()
    assert referenced(cache) >= 3          # a's match
    out_b = eng.abort(b)                    # waiting: never planned
    assert out_b.finish_reason == "abort" and out_b.output_tokens == [] and out_b.stats.path == ""
    out_a = eng.abort(a)                    # running: state and references dropped
    assert out_a.finish_reason == "abort" and len(out_a.output_tokens) == 2
    assert out_a.stats.path == "both_hit" and out_a.stats.output_tokens == 2
    assert referenced(cache) == 0 and not eng.has_unfinished()
    assert eng.abort(a) is None and eng.abort("nope") is None
    assert eng.metrics()["counters"]["aborted"] == 2
    # the engine goes on serving; ids of finished requests can be reused
    (o,) = eng.generate([shared + [1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert o.finish_reason == "length" and referenced(cache) == 0


def test_logprobs_and_first_event_stats(tiny_model):
    import torch

    eng = Engine(tiny_model)
    p = tokens(50, 20)
    sp = SamplingParams(max_new_tokens=3, logprobs=2, return_logits=True)
    events = list(eng.stream(p, sp))
    assert events[0].stats is not None and events[0].stats.path == "cold"
    assert all(e.stats is None for e in events[1:])
    out = events[-1].output
    for ev, lp, lg in zip(events, out.logprobs, out.logits):
        ref = torch.log_softmax(lg.double(), -1)
        assert ev.logprobs is lp and lp.token == ev.token
        assert lp.logprob == float(ref[ev.token])
        assert [t for t, _ in lp.top] == torch.topk(ref, 2).indices.tolist()
        assert lp.top[0][0] == ev.token      # greedy: the sampled token is the most likely


def test_peek_takes_no_reference_and_counts_nothing(tiny_model, make_cache):
    cache, _ = make_cache()
    p = tokens(60, 3 * BLOCK + 5)
    Engine(tiny_model, cache=cache).generate([p], SamplingParams(max_new_tokens=1))
    lookups = cache.metrics.lookups.value()
    assert cache.peek(p) == 3 * BLOCK and cache.peek(p, max_tokens=2 * BLOCK + 3) == 2 * BLOCK
    assert cache.peek(p, namespace="other") == 0 and cache.peek(p[:5]) == 0
    assert referenced(cache) == 0 and cache.metrics.lookups.value() == lookups
    m = cache.match(p)
    assert m.cached_tokens == 3 * BLOCK
    cache.release(m)
