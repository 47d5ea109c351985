"""The training forward computes the serving model's function: its logits equal the
reference model's (kv_dtype="float32", the unquantized KV it trains) on the same weights,
with top-k selection and in the dense stage, and its gradients go where DeepSeek's recipe
sends them (the LM loss never reaches the indexer; the indexer KL reaches only it)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv41.config import ModelConfig
from dsv41.model import Model
from dsv41.train.forward import balance_bias, check_trainable, train_forward


@pytest.fixture(scope="module")
def model():
    return Model.synthetic(ModelConfig.preset("v41-tiny"), seed=3, kv_dtype="float32")


def _reference(model, toks, dense):
    model.dense_attention = dense
    try:
        return torch.stack([model.prefill(t.tolist(), model.new_state(), return_all_logits=True)
                            for t in toks])
    finally:
        model.dense_attention = False


def _until_first_flip(topk_a: dict, topk_b: dict, shape) -> torch.Tensor:
    """[B, T] bool: the positions before the first query whose selected entry set differs
    between the two forwards, in any layer."""
    flip = torch.zeros(shape, dtype=torch.bool)
    for layer, a in topk_a.items():
        flip |= (a.sort(-1).values != topk_b[layer].sort(-1).values).any(-1)
    return flip.cumsum(-1) == 0


@pytest.mark.parametrize("dense", [False, True])
def test_logits_equal_the_reference_model(model, dense):
    g = torch.Generator().manual_seed(7)
    toks = torch.randint(3, 256, (3, 75), generator=g)   # 75: a partial compressor block at the end
    ref = _reference(model, toks, dense)
    out64 = train_forward(model, toks, dense=dense, dtype=torch.float64)
    assert (out64.logits.float() - ref).abs().max() < 1e-5
    out32 = train_forward(model, toks, dense=dense)
    # float32 may break a near-tie in the top-k differently from float64 (it does on some
    # CPUs: AMD EPYC flips one of 8 entries at one query); every later position of that
    # sequence then sees other KV. Compare each sequence up to its first flip.
    same = _until_first_flip(out32.topk, out64.topk, toks.shape)
    assert same.sum() >= 0.9 * same.numel()
    assert (out32.logits - ref).abs().amax(-1)[same].max() < 1e-4
    assert set(out32.index_kl) == {2, 4, 6}          # the Full and Reindex layers of v41-tiny


def test_selection_equals_the_reference_trace(model):
    toks = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    trace = {}
    model.prefill(toks[0].tolist(), model.new_state(), trace=trace)
    out = train_forward(model, toks, dtype=torch.float64)
    for layer in (2, 4, 6):
        want = trace[layer]["kv_idx"].long()
        assert torch.equal(out.topk[layer][0], want), layer


def test_gradients_follow_the_indexer_recipe(model):
    params = dict(model.named_parameters())
    for p in params.values():
        p.requires_grad_(True)
    try:
        toks = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(2))
        out = train_forward(model, toks)
        out.logits.square().mean().backward(retain_graph=True)
        assert params["layers.4.attn.wq_b.weight"].grad.abs().sum() > 0
        assert params["layers.4.attn.compressor.wkv.weight"].grad.abs().sum() > 0
        assert params["layers.2.attn.indexer.wq_b.weight"].grad is None
        assert params["layers.4.attn.indexer.wk.weight"].grad is None
        model.zero_grad(set_to_none=True)
        torch.stack(list(out.index_kl.values())).sum().backward()
        assert params["layers.4.attn.indexer.wq_b.weight"].grad.abs().sum() > 0
        assert params["layers.6.attn.indexer.weights_proj.weight"].grad.abs().sum() > 0
        assert params["layers.4.attn.wq_b.weight"].grad is None
        assert params["embed.weight"].grad is None
    finally:
        model.zero_grad(set_to_none=True)
        for p in params.values():
            p.requires_grad_(False)


def test_kl_rows_subsample_and_padding_does_not_reach_back(model):
    toks = torch.randint(3, 256, (2, 48), generator=torch.Generator().manual_seed(4))
    full = train_forward(model, toks, kl_stride=1)
    strided = train_forward(model, toks, kl_stride=4)
    assert torch.equal(full.logits, strided.logits)
    assert all(torch.isfinite(v) and v >= 0 for v in strided.index_kl.values())
    longer = torch.cat((toks, torch.full((2, 9), 2)), 1)        # right padding (data.collate)
    assert (train_forward(model, longer).logits[:, :48] - full.logits).abs().max() < 1e-5


def test_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="mHC"):
        check_trainable(dataclasses.replace(ModelConfig.preset("v41-tiny"), hc_mult=4))
    with pytest.raises(ValueError, match="V4 compressors"):
        check_trainable(ModelConfig.preset("v4-tiny"))
    stored = Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0)
    with pytest.raises(ValueError, match="kv_dtype='float32'"):
        train_forward(stored, torch.ones(1, 4, dtype=torch.int64))


def test_balance_bias_moves_toward_the_mean_load(model):
    bias = model.layers[0].ffn.gate.bias
    before = bias.clone()
    balance_bias(model, {0: torch.tensor([10.0, 0.0, 5.0, 5.0])}, 0.01)
    assert torch.allclose(bias - before, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    bias.copy_(before)


def test_fake_quant_equals_the_stored_format_model():
    """Quantization-aware fine-tuning trains exactly what is served: with fake_quant the
    forward equals the default model (NVFP4 / FP8 / MXFP4 stored KV) on the same weights."""
    cfg = ModelConfig.preset("v41-tiny")
    ref32, stored = Model.synthetic(cfg, seed=3, kv_dtype="float32"), Model.synthetic(cfg, seed=3)
    toks = torch.randint(3, 256, (2, 75), generator=torch.Generator().manual_seed(7))
    want = torch.stack([stored.prefill(t.tolist(), stored.new_state(), return_all_logits=True)
                        for t in toks])
    got = train_forward(ref32, toks, fake_quant=True, dtype=torch.float64).logits.float()
    assert (got - want).abs().max() < 1e-5
    plain = train_forward(ref32, toks, dtype=torch.float64).logits.float()
    assert (plain - want).abs().max() > 1e-2        # the formats matter: the check has teeth
