"""What each layer may see and whose state it reads (docs/design.md#layer-modes)."""
from __future__ import annotations

import math

import pytest
import torch

from dsv41 import Model, formats
from dsv41.formats import reference as fref
from dsv41.model import swa_index
from dsv41.model.synthetic import init_synthetic

from .conftest import token_ids


def test_swa_index_lists_exactly_the_last_window_positions():
    W = 5
    for start, count, swa_start in ((0, 9, 0), (7, 4, 0), (12, 6, 9), (3, 1, 0), (20, 3, 22)):
        idx = swa_index(start, count, W, swa_start)
        assert idx.shape == (count, W) and idx.dtype == torch.int32
        for t in range(count):
            i = start + t
            want = []
            for j in range(W):
                p = i - W + 1 + j
                if p < max(swa_start, 0) or p > i:
                    want.append(-1)
                else:  # ring slot for old positions, then the new tokens after the ring
                    want.append(W + p - start if p >= start else p % W)
            assert idx[t].tolist() == want


def _mutate_ring_slot(state, layer, position):
    W = state.config.sliding_window
    state.swa_values[layer][position % W] = torch.full(
        (state.config.head_dim,), 3.0).to(torch.float8_e4m3fn)


def test_swa_branch_sees_exactly_the_last_window_tokens(tiny):
    W = tiny.config.sliding_window
    ids = token_ids(40, seed=11)
    state = tiny.new_state()
    tiny.prefill(ids, state)
    ref = tiny.decode_step(7, state.clone())
    # The query at position 40 sees positions [40 - W + 1, 40]; the ring also holds 40 - W.
    outside = state.clone()
    _mutate_ring_slot(outside, 0, 40 - W)
    assert torch.equal(tiny.decode_step(7, outside), ref)
    inside = state.clone()
    _mutate_ring_slot(inside, 0, 40 - W + 1)
    assert not torch.equal(tiny.decode_step(7, inside), ref)


def test_topk_selects_only_complete_visible_entries(tiny):
    c = tiny.config
    ids = token_ids(70, seed=12)
    state = tiny.new_state()
    tiny.prefill(ids[:13], state)
    trace = {}
    tiny.prefill(ids[13:], state, trace=trace)
    positions = torch.arange(13, 70)
    for p in c.layer_plan():
        rec = trace[p.layer]
        if p.compress_ratio == 0:
            assert "kv_idx" not in rec or rec["kv_idx"].shape[1] == 0
            continue
        kidx = rec["kv_idx"]
        visible = (positions + 1) // p.compress_ratio
        assert kidx.shape == (57, c.index_topk)
        for t in range(57):
            row = [j for j in kidx[t].tolist() if j >= 0]
            assert row == sorted(set(row)), "entries ascending and unique"
            assert all(0 <= j < visible[t] for j in row), "never a not-yet-complete entry"
            if p.mode == "full":
                assert len(row) == min(c.index_topk, int(visible[t]))
            assert kidx[t, len(row):].eq(-1).all(), "padding after the entries"


def test_sparse_path_equals_dense_attention_when_topk_covers_everything(tiny_config):
    # With top-k (and the candidate pool) at least the visible entries, every compressing
    # layer attends to all of them: the same as the dense baseline.
    cfg = tiny_config.replace(index_topk=128, candidate_topk_blocks=16)
    model = Model.synthetic(cfg, seed=0)
    ids = token_ids(60, seed=13)
    sparse = model.prefill(ids, model.new_state(), return_all_logits=True)
    model.dense_attention = True
    dense = model.prefill(ids, model.new_state(), return_all_logits=True)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
    # ... while the real top-k (8) changes the result once more than 8 entries are visible.
    model.dense_attention = False
    small = Model.synthetic(tiny_config, seed=0)
    topk8 = small.prefill(ids, small.new_state(), return_all_logits=True)
    assert torch.equal(topk8[:8], sparse[:8])  # at most 8 entries visible anywhere
    assert not torch.allclose(topk8[30:], sparse[30:], atol=1e-3)


def test_reuse_layers_own_no_kv_and_read_their_sources(tiny):
    c = tiny.config
    plan = c.layer_plan()
    names = [n for n, _ in tiny.named_parameters()]
    state = tiny.new_state()
    assert set(state.main_kv) == {p.layer for p in plan if p.mode == "full"}
    assert set(state.index_keys) == {p.layer for p in plan if p.owns_indexer_keys}
    for p in plan:
        if p.mode == "reuse":
            assert not any(n.startswith(f"layers.{p.layer}.attn.compressor") or
                           n.startswith(f"layers.{p.layer}.attn.indexer") for n in names)
            assert state.kv_source_store(p.layer) is state.main_kv[p.kv_source]
    # Layer 3 (encoder Reuse) reads layer 2's entries: mutate them, hold layer 2's own
    # output fixed with a hook so that layer 3 gets the same input, and layer 3 changes.
    ids = token_ids(30, seed=14)
    state = tiny.new_state()
    tiny.prefill(ids, state)
    mutated = state.clone()
    codes = mutated.main_kv[2].codes
    codes[:mutated.main_kv[2].n] ^= 0x11
    ref_trace, new_trace = {}, {}
    recorded = {}

    def record(module, args, out):
        recorded["out"] = out

    def replay(module, args, out):
        return recorded["out"]

    handle = tiny.layers[2].attn.register_forward_hook(record)
    try:
        tiny.prefill([5], state, trace=ref_trace)
    finally:
        handle.remove()
    handle = tiny.layers[2].attn.register_forward_hook(replay)
    try:
        tiny.prefill([5], mutated, trace=new_trace)
    finally:
        handle.remove()
    assert torch.equal(ref_trace[3]["q"], new_trace[3]["q"])           # same input
    assert torch.equal(ref_trace[3]["kv_idx"], new_trace[3]["kv_idx"])  # same selection
    assert not torch.equal(ref_trace[3]["attn"], new_trace[3]["attn"])  # other KV values
    # The decoder Reuse layer 5 reads the decoder source (layer 4), not layer 2.
    assert torch.equal(ref_trace[5]["kv_idx"], ref_trace[4]["kv_idx"])


def _dequant_keys(state, layer):
    codes, scales = state.index_keys[layer].committed()
    return fref.dequantize_mxfp4(codes, scales).double()


def test_reindex_layer_selects_its_own_topk_from_the_candidate_pool(tiny):
    c = tiny.config
    ids = token_ids(64, seed=15)
    state, trace = tiny.new_state(), {}
    tiny.prefill(ids, state, trace=trace)
    src, reindex = c.candidate_source_layer_id, 6
    assert c.layer_plan()[reindex].mode == "reindex"
    cands = trace[src]["candidates"]
    assert cands.shape == (64, c.candidate_topk_blocks * c.candidate_block_size)
    keys = _dequant_keys(state, src)
    qc, qs = trace[reindex]["index_q"]
    q = fref.dequantize_mxfp4(qc, qs).double()
    w = trace[reindex]["index_w"].double()
    kidx = trace[reindex]["kv_idx"]
    differs = 0
    for t in range(64):
        pool = [j for j in cands[t].tolist() if j >= 0]
        visible, block = t + 1, c.candidate_block_size
        blocks = -(-visible // block)
        newest = visible - (blocks - 1) * block  # positions in the newest (maybe partial) block
        want = visible if blocks <= c.candidate_topk_blocks else \
            (c.candidate_topk_blocks - 1) * block + newest
        assert len(pool) == want
        newest_block = t // c.candidate_block_size
        assert t in pool and newest_block * c.candidate_block_size in pool
        chosen = [j for j in kidx[t].tolist() if j >= 0]
        assert set(chosen) <= set(pool) and len(chosen) == min(c.index_topk, len(pool))
        score = {j: float(sum(w[t, h] * torch.relu(q[t, h] @ keys[j]) for h in range(q.shape[1])))
                 for j in pool}
        rest = [score[j] for j in pool if j not in chosen]
        if rest:
            assert min(score[j] for j in chosen) >= max(rest) - 1e-6
        differs += chosen != [j for j in trace[src]["kv_idx"][t].tolist() if j >= 0]
    assert differs > 0, "the Reindex layer's own query should pick differently somewhere"
    # Its Reuse follower (7) uses that selection.
    assert torch.equal(trace[7]["kv_idx"], kidx)


def test_candidate_source_scores_every_visible_entry(tiny):
    c = tiny.config
    ids = token_ids(50, seed=16)
    state, trace = tiny.new_state(), {}
    tiny.prefill(ids, state, trace=trace)
    src = c.candidate_source_layer_id
    keys = _dequant_keys(state, src)
    qc, qs = trace[src]["index_q"]
    q = fref.dequantize_mxfp4(qc, qs).double()
    w = trace[src]["index_w"].double()
    for t in (9, 30, 49):
        s = [float(sum(w[t, h] * torch.relu(q[t, h] @ keys[j]) for h in range(q.shape[1])))
             for j in range(t + 1)]
        chosen = [j for j in trace[src]["kv_idx"][t].tolist() if j >= 0]
        rest = [s[j] for j in range(t + 1) if j not in chosen]
        assert len(chosen) == c.index_topk
        assert min(s[j] for j in chosen) >= max(rest) - 1e-6


def test_decoder_global_kv_is_a_function_of_the_encoder_output_only(tiny_config):
    c = tiny_config
    dec_full = c.num_encoder_layers
    model = Model.synthetic(c, seed=0)
    ids = token_ids(37, seed=17)
    state, trace = model.new_state(), {}
    logits = model.prefill(ids, state, trace=trace)
    # The stored entries are exactly layer 20-equivalent's compressor applied to
    # attn_norm(H_enc), RoPE'd at their positions (ratio 1).
    block = model.layers[dec_full]
    h_enc = trace[dec_full]["h_enc"]
    assert torch.equal(h_enc, trace[dec_full - 1]["hidden"])
    comp = block.attn.compressor
    latent = comp.pool(comp.wkv(block.attn_norm(h_enc)), None)
    entries = block.attn.rope.rotate(latent, torch.arange(37))
    codes, scales = formats.quantize_nvfp4(entries)
    got_codes, got_scales = state.main_kv[dec_full].committed()
    assert torch.equal(codes, got_codes)
    assert torch.equal(scales.view(torch.uint8), got_scales.view(torch.uint8))
    # Re-randomize every decoder weight that is not on that path: same decoder KV bytes,
    # different logits. Re-randomize an encoder weight: different decoder KV.
    other = Model.synthetic(c, seed=0)
    fresh = Model.synthetic(c, seed=99).state_dict()
    keep = (f"layers.{dec_full}.attn_norm.", f"layers.{dec_full}.attn.compressor.")
    with torch.no_grad():
        for name, p in other.named_parameters():
            layer = int(name.split(".")[1]) if name.startswith("layers.") else None
            if (layer is not None and layer >= dec_full and not name.startswith(keep)) \
                    or name.startswith(("norm.", "head.")):
                p.copy_(fresh[name])
    st2 = other.new_state()
    logits2 = other.prefill(ids, st2)
    assert not torch.allclose(logits, logits2)
    assert state.main_kv[dec_full].equal(st2.main_kv[dec_full])
    with torch.no_grad():
        other.layers[1].ffn.shared_experts.w2.weight.mul_(3.0)
    st3 = other.new_state()
    other.prefill(ids, st3)
    assert not state.main_kv[dec_full].equal(st3.main_kv[dec_full])
    assert state.main_kv[2].equal(st2.main_kv[2])


def test_rope_regimes_and_inverse():
    from dsv41.model.rope import Rope, yarn_frequencies
    from dsv41 import ModelConfig
    c = ModelConfig.preset("v41-flash")
    swa, comp = Rope.for_layer(c, 0), Rope.for_layer(c, 2)
    assert torch.allclose(swa.freqs, 1 / 10000.0 ** (torch.arange(0, 64, 2).double() / 64))
    plain = 1 / 160000.0 ** (torch.arange(0, 64, 2).double() / 64)
    # YaRN keeps the fast dims and divides the slow ones by the factor (16).
    assert torch.allclose(comp.freqs[:4], plain[:4])
    assert torch.allclose(comp.freqs[-2:], plain[-2:] / 16)
    assert torch.equal(yarn_frequencies(64, 160000.0, None), plain)
    x = torch.randn(5, 3, 512)
    pos = torch.tensor([0, 1, 77, 5000, 1 << 19])
    y = comp.rotate(x, pos)
    assert torch.equal(y[..., :448], x[..., :448])
    assert torch.equal(y[0], x[0])
    torch.testing.assert_close(comp.rotate(y, pos, inverse=True), x, atol=1e-5, rtol=1e-5)
    # Relative: <R(a) q, R(b) k> depends on a - b only.
    q, k = torch.randn(1, 512), torch.randn(1, 512)
    d1 = (comp.rotate(q, torch.tensor([10])) * comp.rotate(k, torch.tensor([3]))).sum()
    d2 = (comp.rotate(q, torch.tensor([1010])) * comp.rotate(k, torch.tensor([1003]))).sum()
    assert math.isclose(float(d1), float(d2), rel_tol=1e-4)


def test_hadamard_rotation_preserves_dot_products_and_is_switchable(tiny_config):
    from dsv41.model.indexer import hadamard
    a, b = torch.randn(4, 128), torch.randn(4, 128)
    torch.testing.assert_close((hadamard(a) * hadamard(b)).sum(-1), (a * b).sum(-1),
                               atol=1e-4, rtol=1e-5)
    plain = Model.synthetic(tiny_config, seed=0, indexer_rotation=False)
    rotated = Model.synthetic(tiny_config, seed=0)
    ids = token_ids(20, seed=18)
    s1, s2 = plain.new_state(), rotated.new_state()
    plain.prefill(ids, s1)
    rotated.prefill(ids, s2)
    assert not s1.index_keys[2].equal(s2.index_keys[2])
    assert s1.main_kv[2].equal(s2.main_kv[2])
    with pytest.raises(ValueError, match="model options"):
        rotated.prefill([1], s1)
    assert plain.kv_fingerprint() != rotated.kv_fingerprint()


def test_init_synthetic_is_deterministic_by_seed(tiny_config):
    a = Model.synthetic(tiny_config, seed=4)
    b = Model.synthetic(tiny_config, seed=4)
    c = Model.synthetic(tiny_config, seed=5)
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(),
                               c.state_dict().values()):
        assert torch.equal(x, y), name
        assert not torch.equal(x, z), name
    init_synthetic(c, 4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 c.state_dict().values()))
