"""The four cache paths through the engine: resume, replay (exact and bounded), decoder
replay, and a batch mixing them."""
from __future__ import annotations

import pytest
import torch

from dsv41.engine import Engine, ReplayConfig, SamplingParams
from dsv41.model import state_diff

from .conftest import tokens

SP = SamplingParams(max_new_tokens=3, return_logits=True)


def test_both_hit_resume_equals_live_session(tiny_model, make_cache):
    m = tiny_model
    cache, clock = make_cache()
    eng = Engine(m, cache=cache)
    p1 = tokens(1, 45)
    o1 = eng.generate([p1], SP)[0]
    assert o1.stats.path == "cold" and o1.stats.global_exact and o1.stats.swa_exact
    p2 = p1 + o1.output_tokens + tokens(2, 7)
    o2 = eng.generate([p2], SP)[0]
    assert o2.stats.path == "both_hit"
    assert o2.stats.swa_hit_tokens == len(p1) + len(o1.output_tokens) - 1
    assert o2.stats.prefill_tokens == len(p2) - o2.stats.swa_hit_tokens
    # the live session: prompt, the sampled tokens fed back, then the new turn
    live = m.new_state()
    lg = m.prefill(p1, live)
    assert torch.equal(lg, o1.logits[0])
    for t in o1.output_tokens[:-1]:
        m.decode_step(t, live)
    lg = m.prefill(p2[live.position:], live)
    assert torch.equal(lg, o2.logits[0])
    for i, t in enumerate(o2.output_tokens[:-1]):
        assert torch.equal(m.decode_step(t, live), o2.logits[i + 1])


def test_exact_replay_through_engine_equals_cold(tiny_model, make_cache):
    m = tiny_model
    cache, clock = make_cache(ttl=10.0)
    p = tokens(3, 150)
    Engine(m, cache=cache).generate([p[:140]], SamplingParams(max_new_tokens=1))
    clock.t = 100.0                                     # the SWA snapshot expires
    o = Engine(m, cache=cache, replay="exact").generate([p], SP)[0]
    assert o.stats.path == "encoder_replay" and o.stats.global_hit_tokens == 128
    assert o.stats.replay_start == max(0, 128 - m.config.num_layers * 15)
    ref = Engine(m, cache=None).generate([p], SP)[0]
    assert ref.stats.path == "cold"
    assert o.output_tokens == ref.output_tokens
    assert all(torch.equal(a, b) for a, b in zip(o.logits, ref.logits))
    # bounded: exactly W replayed tokens; strict mode writes nothing approximate back
    q = p[:130] + [1, 2, 3, 4]
    strict = Engine(m, cache=cache, replay="bounded", write_approximate=False)
    o = strict.generate([q], SP)[0]
    assert o.stats.path == "encoder_replay" and o.stats.replayed_tokens == m.config.sliding_window
    assert o.stats.prefill_tokens == 134 - 112 and not o.stats.global_exact
    assert o.stats.bytes.get("global_written", 0) == 0 and "swa_written" not in o.stats.bytes
    assert strict.generate([q + o.output_tokens + [5]], SP)[0].stats.path == "encoder_replay"
    # the default caches the replayed session's own state: its next turn resumes from it
    prod = Engine(m, cache=cache, replay="bounded")
    o = prod.generate([q], SP)[0]
    assert o.stats.path == "encoder_replay" and o.stats.bytes["swa_written"] > 0
    nxt = prod.generate([q + o.output_tokens + [5]], SP)[0]
    assert nxt.stats.path == "both_hit" and nxt.stats.prefill_tokens == 2   # last output token + 1


def test_replay_off_recomputes(tiny_model, make_cache):
    m = tiny_model
    cache, clock = make_cache(ttl=10.0)
    p = tokens(4, 60)
    Engine(m, cache=cache).generate([p[:50]], SamplingParams(max_new_tokens=1))
    clock.t = 100.0
    o = Engine(m, cache=cache, replay="off").generate([p], SP)[0]
    ref = Engine(m).generate([p], SP)[0]
    assert o.stats.path == "recompute" and o.stats.prefill_tokens == 60
    assert o.stats.global_hit_tokens == 48 and o.output_tokens == ref.output_tokens


def test_decoder_replay_and_input_logprobs(tiny_model):
    m = tiny_model
    W = m.config.sliding_window
    eng = Engine(m, replay=ReplayConfig(decoder_replay=True))
    with pytest.raises(ValueError, match="decoder replay"):
        eng.add_request(tokens(5, 30), SamplingParams(input_logprobs=True))
    short = tokens(5, W)
    a = eng.generate([short, tokens(6, 50)], SP)
    b = Engine(m).generate([short], SP)[0]
    assert a[0].output_tokens == b.output_tokens and torch.equal(a[0].logits[0], b.logits[0])
    assert a[1].stats.decoder_prefill_tokens == W and a[1].stats.prefill_tokens == 50
    assert not a[1].stats.swa_exact and a[1].stats.global_exact
    # input logprobs (decoder replay off) are the full prefill's
    p = tokens(7, 30)
    o = Engine(m).generate([p], SamplingParams(max_new_tokens=1, input_logprobs=True))[0]
    full = torch.log_softmax(m.prefill(p, m.new_state(), return_all_logits=True).double(), -1)
    assert o.input_logprobs[0] is None
    assert all(o.input_logprobs[i] == float(full[i - 1, p[i]]) for i in range(1, 30))


def _setup(m, make_cache):
    """A cache holding: a finished conversation turn (blocks + end-of-output snapshot) and
    the blocks of a shared prefix whose snapshot is for another continuation."""
    cache, clock = make_cache()
    eng = Engine(m, cache=cache)
    base = tokens(10, 64)
    o = eng.generate([base + [5, 6, 7]], SamplingParams(max_new_tokens=2))[0]
    return cache, base, base + [5, 6, 7] + o.output_tokens


def test_batch_mixing_all_paths_equals_alone(tiny_model, make_cache):
    m = tiny_model
    dec = ReplayConfig(decoder_replay=True)
    cache, base, turn = _setup(m, make_cache)
    reqs = [(tokens(11, 40), None, "cold"),                 # nothing cached
            (turn + [9, 9, 9], None, "both_hit"),           # end-of-output snapshot
            (base + [1, 2, 3, 4, 5], None, "encoder_replay"),  # blocks, no snapshot
            (base + [8, 8], dec, "encoder_replay")]         # ... with decoder replay too
    sp = SamplingParams(max_new_tokens=3, temperature=0.8, top_p=0.9, seed=3, return_logits=True)
    eng = Engine(m, cache=cache)
    rids = [eng.add_request(p, sp, replay=rc) for p, rc, _ in reqs]
    outs = {}
    first = True
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
        if first:   # all four prefills ran in the first step, in one model call
            assert len(eng.scheduler.running) + len(outs) == 4
            first = False
    for rid, (p, rc, path) in zip(rids, reqs):
        alone_cache, _, _ = _setup(m, make_cache)
        ref = Engine(m, cache=alone_cache).generate([p], sp, replay=rc)[0]
        got = outs[rid]
        assert got.stats.path == ref.stats.path == path
        assert got.output_tokens == ref.output_tokens
        assert all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))
    assert outs[rids[3]].stats.decoder_replay and outs[rids[3]].stats.decoder_prefill_tokens == 16
