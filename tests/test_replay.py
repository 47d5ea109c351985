"""Replay on the model (v41-tiny, W = 16, 4 encoder + 4 decoder layers): the exact oracle,
bounded encoder replay and its SWA rule, decoder replay, and the planner's rules."""
from __future__ import annotations

import pytest
import torch

from dsv41.config import ModelConfig
from dsv41.model import Extend, Model, state_diff
from dsv41.replay import ReplayConfig, align_hit, plan_prompt

N = 200


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.preset("v41-tiny")
    model = Model.synthetic(cfg, seed=0)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (N,), generator=g).tolist()
    full = model.new_state()
    trace: dict = {}
    logits = model.prefill(ids, full, return_all_logits=True, trace=trace)
    return cfg, model, ids, full, logits, trace


def _replay_state(model, full, ids, H, s):
    st = model.new_state()
    st.import_global(0, full.export_global(0, H))
    st.seek_for_replay(ids[:s])
    return st


def _run_plan(model, full, ids, plan, n, trace=None):
    st = model.new_state()
    if plan.cached_until is not None:
        st = _replay_state(model, full, ids, plan.cached_until, plan.start)
    out = model.extend_batch([Extend(ids[plan.start:n], st, swa_start=plan.swa_start,
                                     cached_until=plan.cached_until,
                                     decoder_start=plan.decoder_start)], trace=trace)[0]
    return st, out


# ---- the planner ------------------------------------------------------------------------

def test_plan_paths_and_ranges():
    cfg = ModelConfig.preset("v41-tiny")
    W, L, Le = cfg.sliding_window, cfg.num_layers, cfg.num_encoder_layers
    p = plan_prompt(cfg, 100, replay="bounded", align=8)
    assert (p.path, p.start, p.computed_tokens, p.replayed_tokens) == ("cold", 0, 100, 0)
    p = plan_prompt(cfg, 100, global_hit=64, replay="bounded", align=8)
    assert (p.path, p.start, p.swa_start, p.cached_until) == ("encoder_replay", 64 - W, 48, 64)
    assert p.replayed_tokens == W and p.computed_tokens == 100 - 48
    assert not p.global_exact and not p.swa_exact
    p = plan_prompt(cfg, 100, global_hit=64, snapshot_tokens=70, replay="bounded", align=8)
    assert (p.path, p.start, p.import_tokens, p.swa_exact) == ("both_hit", 70, 64, True)
    p = plan_prompt(cfg, 100, global_hit=64, replay="off", align=8)
    assert (p.path, p.start, p.import_tokens, p.swa_exact) == ("recompute", 0, 0, True)
    p = plan_prompt(cfg, 300, global_hit=256, replay="exact", align=8)
    assert (p.start, p.global_exact, p.swa_exact) == (256 - L * (W - 1), True, True)
    p = plan_prompt(cfg, 300, global_hit=256, replay=ReplayConfig(mode="exact", decoder_replay=True), align=8)
    assert p.start == min(256, 300 - W) - Le * (W - 1) and p.decoder_start == 300 - W
    assert p.global_exact and not p.swa_exact
    # decoder replay: the decoder runs on the last W prompt tokens, or all of a short one
    p = plan_prompt(cfg, 100, replay=ReplayConfig(decoder_replay=True))
    assert (p.decoder_start, p.decoder_tokens, p.global_exact) == (100 - W, W, True)
    assert plan_prompt(cfg, W, replay=ReplayConfig(decoder_replay=True)).decoder_start == 0


def test_plan_short_hits_and_cuts():
    cfg = ModelConfig.preset("v41-tiny")
    # a hit shorter than the window replays [0, H): equal to full prefill
    p = plan_prompt(cfg, 100, global_hit=8, replay="bounded", align=8)
    assert (p.start, p.replayed_tokens, p.global_exact, p.swa_exact) == (0, 8, True, True)
    # unaligned hits are cut down to the block; the last token always runs
    assert align_hit(70, 100, 8) == 64 and align_hit(100, 100, 8) == 96 and align_hit(64, 64, 8) == 56
    assert plan_prompt(cfg, 100, global_hit=70, align=8).cached_until == 64
    assert plan_prompt(cfg, 5, global_hit=8, align=8).path == "cold"
    with pytest.raises(ValueError, match="compress ratio"):
        plan_prompt(cfg, 100, global_hit=64, align=3)
    with pytest.raises(ValueError, match="snapshot"):
        plan_prompt(cfg, 100, global_hit=16, snapshot_tokens=40, align=8)
    with pytest.raises(ValueError, match="replay"):
        ReplayConfig.parse("sometimes")


# ---- the exact oracle -------------------------------------------------------------------

@pytest.mark.parametrize("H", [2, 14, 18, N - 8])   # start, just before/after W, end
def test_exact_replay_equals_full_prefill(tiny, H):
    cfg, model, ids, full, logits, _ = tiny
    plan = plan_prompt(cfg, N, global_hit=H, replay="exact", align=2)
    assert plan.path == "encoder_replay" and plan.cached_until == H
    st, out = _run_plan(model, full, ids, plan, N)
    assert state_diff(st, full) == []
    assert torch.equal(out, logits[-1])


def test_exact_oracle_bound_is_needed(tiny):
    """One token less than the bound is no longer exact (the bound is tight enough to test)."""
    cfg, model, ids, full, logits, _ = tiny
    H = N - 8
    s = H - cfg.num_layers * (cfg.sliding_window - 1) + 40
    st = _replay_state(model, full, ids, H, s)
    out = model.extend_batch([Extend(ids[s:], st, swa_start=s, cached_until=H)])[0]
    assert state_diff(st, full) != [] and not torch.equal(out, logits[-1])


def test_exact_replay_with_decoder_replay_equals_cold_decoder_replay(tiny):
    cfg, model, ids, full, logits, _ = tiny
    W = cfg.sliding_window
    rc = ReplayConfig(mode="exact", decoder_replay=True)
    plan = plan_prompt(cfg, N, global_hit=N - 8, replay=rc, align=2)
    st, out = _run_plan(model, full, ids, plan, N)
    cold = model.new_state()
    ref = model.extend_batch([Extend(ids, cold, decoder_start=N - W)])[0]
    assert state_diff(st, cold) == [] and torch.equal(out, ref)


# ---- bounded encoder replay ---------------------------------------------------------------

def test_bounded_replay_reads_cached_global_kv(tiny):
    cfg, model, ids, full, logits, _ = tiny
    H = 96
    plan = plan_prompt(cfg, N, global_hit=H, replay="bounded", align=2)
    trace: dict = {}
    st, out = _run_plan(model, full, ids, plan, N, trace=trace)
    # exactly W cached tokens replayed, then the suffix
    assert plan.replayed_tokens == cfg.sliding_window == H - plan.start
    assert trace[0]["q"].shape[0] == N - H + cfg.sliding_window
    # the replayed tokens' global KV is the cached one, bit for bit (read, not recomputed)
    mine, ref = st.export_global(0, H), full.export_global(0, H)
    for kind in ("main", "index"):
        for layer in ref[kind]:
            for a, b in zip(mine[kind][layer], ref[kind][layer]):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # the compressors computed entries only past H
    for layer in st.main_kv:
        assert int(trace[layer]["entry_positions"].min()) == H
    assert st.position == N and st.tokens == ids
    assert not torch.equal(out, logits[-1])   # approximate: docs/design.md#encoder-replay


def test_bounded_replay_swa_rule_position_by_position(tiny):
    """Query i sees SWA keys [max(s, i - W + 1), i]; layer l's output (and so layer l+1's
    SWA KV) equals full prefill exactly at positions p >= s + (l + 1)(W - 1), and only the
    rule's predicted positions may differ."""
    cfg, model, ids, full, logits, full_trace = tiny
    W = cfg.sliding_window
    H, n = 32, 40
    s = H - W
    trace: dict = {}
    st = _replay_state(model, full, ids, H, s)
    model.extend_batch([Extend(ids[s:n], st, swa_start=s, cached_until=H)], trace=trace)
    for layer in range(cfg.num_layers):
        idx = trace[layer]["swa_idx"]
        for r, i in enumerate(range(s, n)):
            seen = [i - W + 1 + j for j in range(W) if idx[r, j] >= 0]
            assert seen == list(range(max(s, i - W + 1), i + 1))
    for layer in range(cfg.num_layers):
        mine = trace[layer]["hidden"]                  # rows: positions s .. n-1
        ref = full_trace[layer]["hidden"][s:n]
        exact_from = s + (layer + 1) * (W - 1)
        for r, p in enumerate(range(s, n)):
            same = torch.equal(mine[r], ref[r])
            if p >= exact_from:
                assert same, (layer, p)
        if exact_from > s:
            assert not all(torch.equal(mine[r], ref[r]) for r in range(min(n, exact_from) - s))
    # SWA rings: layer 0's SWA KV is a function of the token only, so its ring is exact
    for p in range(n - W, n):
        assert torch.equal(st.swa_values[0][p % W].view(torch.uint8),
                           _ring_after(model, ids, n)[p % W].view(torch.uint8))


_RING_CACHE: dict = {}


def _ring_after(model, ids, n):
    if n not in _RING_CACHE:
        st = model.new_state()
        model.prefill(ids[:n], st)
        _RING_CACHE[n] = st.swa_values[0].clone()
    return _RING_CACHE[n]


def test_replay_rejects_bad_inputs(tiny):
    cfg, model, ids, full, logits, _ = tiny
    st = _replay_state(model, full, ids, 32, 16)
    with pytest.raises(ValueError, match="swa_start"):
        model.extend_batch([Extend(ids[16:40], st, swa_start=20, cached_until=32)])
    with pytest.raises(ValueError, match="cached_until"):
        model.extend_batch([Extend(ids[16:40], st, swa_start=16, cached_until=30)])
    with pytest.raises(ValueError, match="decoder replay"):
        model.extend_batch([Extend(ids[16:40], st, swa_start=16, cached_until=32,
                                   decoder_start=30, all_logits=True)])
    assert st.position == 16   # nothing applied


# ---- decoder replay ---------------------------------------------------------------------

def test_decoder_replay_short_prompt_equals_full_prefill(tiny):
    cfg, model, ids, full, logits, _ = tiny
    W = cfg.sliding_window
    for n in (5, W):
        st, ref = model.new_state(), model.new_state()
        out = model.extend_batch([Extend(ids[:n], st, decoder_start=0)])[0]
        assert torch.equal(out, model.prefill(ids[:n], ref)) and state_diff(st, ref) == []


def test_decoder_replay_runs_decoder_on_window(tiny):
    cfg, model, ids, full, logits, _ = tiny
    W, Le = cfg.sliding_window, cfg.num_encoder_layers
    plan = plan_prompt(cfg, N, replay=ReplayConfig(decoder_replay=True))
    trace: dict = {}
    st, out = _run_plan(model, full, ids, plan, N, trace=trace)
    for layer in range(cfg.num_layers):
        assert trace[layer]["q"].shape[0] == (N if layer < Le else W)
    # decoder global KV still comes from the encoder for every token: all global KV and the
    # encoder rings equal full prefill; only decoder SWA rings (past the first) may differ
    diff = state_diff(st, full)
    assert all(d.startswith(("swa_values", "swa_scales")) for d in diff)
    assert all(int(d.split("[")[1].rstrip("]")) > Le for d in diff) and diff
