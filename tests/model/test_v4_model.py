"""DeepSeek-V4 machinery inside dsv41 (no transformers needed): v4-tiny's stored state
equals kv_budget ledger by ledger; a prompt split across calls (carried overlap window,
pending blocks) gives the one-shot logits; the float32 reference mode stays close to the
stored formats; hash layers route by token id; V4.1's
decoder global KV with several mHC streams is defined by H_enc alone."""
from __future__ import annotations

import pytest
import torch

from dsv41.budget import kv_budget
from dsv41.config import MODE_FULL, PART_DECODER, ModelConfig
from dsv41.formats import layout
from dsv41.model import Extend, Model, state_diff

V4 = ModelConfig.preset("v4-tiny")


@pytest.fixture(scope="module")
def v4_model():
    return Model.synthetic(V4, seed=0)


def _ids(n, seed=0):
    return torch.randint(0, V4.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def test_v4_state_bytes_equal_budget_ledger_by_ledger(v4_model):
    st = v4_model.new_state()
    ids = _ids(140)
    for chunk in (ids[:3], ids[3:70], ids[70:130], ids[130:]):
        v4_model.prefill(chunk, st)
        st.check_budget()
    v4_model.decode_step(7, st)
    st.check_budget()
    assert st.nbytes()["main"] == kv_budget(V4).bytes_for(st.position)["main"] > 0
    entry = layout.fp8_v4_main_bytes(V4.nope_head_dim, V4.rope_head_dim)
    assert st.main_kv[2].row_bytes == entry and st.main_kv[3].n == 1  # one HCA entry


def test_v4_split_prompt_equals_one_shot(v4_model):
    ids = _ids(137, seed=1)
    one = v4_model.prefill(ids, v4_model.new_state(), return_all_logits=True)
    st = v4_model.new_state()
    parts = [v4_model.prefill(ids[a:b], st, return_all_logits=True)
             for a, b in ((0, 5), (5, 6), (6, 130), (130, 137))]
    assert torch.equal(torch.cat(parts), one)


def test_float32_reference_is_close_to_stored(v4_model):
    ref = Model.synthetic(V4, seed=0, kv_dtype="float32")
    ids = _ids(140, seed=2)
    a = v4_model.prefill(ids, v4_model.new_state(), return_all_logits=True)
    b = ref.prefill(ids, ref.new_state(), return_all_logits=True)
    assert not torch.equal(a, b)  # the stored formats do quantize
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean()
    assert top1 > 0.8
    with pytest.raises(ValueError, match="never cached"):
        ref.kv_fingerprint()


def test_hash_layer_routes_by_token_id(v4_model):
    gate = v4_model.layers[0].ffn.gate
    assert gate.tid2eid.dtype == torch.int64 and not hasattr(gate, "bias")
    x = torch.randn(3, V4.hidden_size)
    ids, w = gate(x, torch.tensor([5, 5, 9]))
    assert torch.equal(ids[0], gate.tid2eid[5]) and torch.equal(ids[2], gate.tid2eid[9])
    assert torch.allclose(w.sum(-1), torch.full((3,), V4.routed_scaling_factor, dtype=w.dtype))
    assert hasattr(v4_model.layers[1].ffn.gate, "bias")


def test_v41_decoder_global_kv_reads_collapsed_encoder_streams():
    """With hc_mult > 1 the decoder's Full layer projects attn_norm(collapse_pre(H_enc)),
    H_enc being the encoder's output streams: a decoder replay (decoder on the last tokens
    only) writes the same decoder global KV as a plain prefill."""
    cfg = ModelConfig.preset("v41-tiny").replace(hc_mult=2)
    model = Model.synthetic(cfg, seed=0)
    full_layer = next(p.layer for p in cfg.layer_plan()
                      if p.part == PART_DECODER and p.mode == MODE_FULL)
    ids = torch.randint(0, cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(3))
    plain, trace = model.new_state(), {}
    model.prefill(ids, plain, trace=trace)
    assert trace[full_layer]["h_enc"].shape == (48, 2, cfg.hidden_size)
    replay = model.new_state()
    model.extend_batch([Extend(ids, replay, decoder_start=40)])
    assert plain.main_kv[full_layer].equal(replay.main_kv[full_layer])
    assert plain.index_keys[full_layer].equal(replay.index_keys[full_layer])
    assert state_diff(plain, replay)  # the decoder's SWA rings differ (it ran on 8 tokens)


def test_v4_batch_equals_alone(v4_model):
    a, b = _ids(40, seed=5), _ids(9, seed=6)
    sa, sb = v4_model.new_state(), v4_model.new_state()
    v4_model.prefill(a[:3], sa)
    outs = v4_model.prefill_batch([a[3:], b], [sa, sb], return_all_logits=True)
    alone_a, alone_b = v4_model.new_state(), v4_model.new_state()
    v4_model.prefill(a[:3], alone_a)
    assert torch.equal(outs[0], v4_model.prefill(a[3:], alone_a, return_all_logits=True))
    assert torch.equal(outs[1], v4_model.prefill(b, alone_b, return_all_logits=True))
    assert state_diff(sa, alone_a) == [] and state_diff(sb, alone_b) == []


def test_v4_checkpoint_round_trip_keeps_int64_tables(v4_model, tmp_path):
    v4_model.save_pretrained(tmp_path)
    back = Model.from_pretrained(tmp_path)
    sd, sd2 = v4_model.state_dict(), back.state_dict()
    assert sd2["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_v4_refuses_replay_over_cached_kv_before_touching_state(v4_model):
    st = v4_model.new_state()
    v4_model.prefill(_ids(8), st)
    before = st.clone()
    with pytest.raises(ValueError, match="overlapping compressor windows"):
        v4_model.extend_batch([Extend(_ids(8, seed=9), st, swa_start=8, cached_until=128)])
    assert state_diff(st, before) == []
