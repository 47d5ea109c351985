"""Configs transformers 5.23's DeepseekV4 accepts, in both directions: a model transformers
saves loads in dsv41 with the same logits (or is refused with the reason), and a model dsv41
saves is read by transformers as the same model. Comparisons run dsv41's float32 reference
mode and stop at the first top-k tie (test_v4_oracle.run_both)."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

from dsv41.config import ConfigError, ModelConfig  # noqa: E402
from dsv41.model import Model  # noqa: E402
from dsv41.model.oracle import random_deepseek_v4  # noqa: E402

from .test_v4_oracle import TOL, run_both, tiny_v4_config  # noqa: E402

SHORT = dict(chunks=(70, 5), decode=2)     # enough for the small HCA rates below


def _saved_by_transformers(tmp_path, seed=0, **over):
    hf = random_deepseek_v4(tiny_v4_config(**over), seed)
    hf.save_pretrained(tmp_path)
    return hf


def _agrees(hf, path, seed=1, **run):
    agree = run_both(hf, Model.from_pretrained(path, kv_dtype="float32"), seed=seed, **run)
    assert agree.worst <= TOL, agree
    assert agree.compared >= 40, agree
    return agree


# ---- dsv41 -> transformers ------------------------------------------------------------------

def _v4_small() -> ModelConfig:
    """v4-tiny with 16 indexer heads (ties at the top-k boundary are rare) and 2 hash layers."""
    return ModelConfig.preset("v4-tiny").replace(name="v4-small-test", index_n_heads=16,
                                                 num_hash_layers=2, index_topk=4)


def test_transformers_reads_a_config_saved_by_dsv41(tmp_path):
    """DeepseekV4Config.from_pretrained on dsv41's config.json used to return transformers'
    defaults (hidden 4096, 43 layers): dsv41 nested the model under text_config."""
    cfg = _v4_small()
    cfg.to_json(tmp_path / "config.json")
    hf = DeepseekV4Config.from_pretrained(tmp_path)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.vocab_size) == (64, 6, 256)
    assert hf.layer_types == ["sliding_attention", "sliding_attention",
                              "compressed_sparse_attention", "heavily_compressed_attention"] * 1 \
        + ["compressed_sparse_attention", "heavily_compressed_attention"]
    assert hf.mlp_layer_types == ["hash_moe"] * 2 + ["moe"] * 4
    assert hf.compress_rates == {"compressed_sparse_attention": 4,
                                 "heavily_compressed_attention": 128}
    assert hf.qk_rope_head_dim == cfg.rope_head_dim and hf.hc_mult == cfg.hc_mult
    assert hf.rope_parameters["compress"]["factor"] == cfg.rope_scaling["factor"]
    assert hf.rope_parameters["main"]["rope_type"] == "default"
    assert (hf.index_n_heads, hf.index_topk, hf.sliding_window) == (16, 4, 16)
    # and back: transformers' save of that config reads as the same dsv41 config
    hf.save_pretrained(tmp_path / "again")
    assert ModelConfig.from_json(tmp_path / "again" / "config.json", name=cfg.name) == cfg


def test_transformers_runs_a_checkpoint_saved_by_dsv41(tmp_path):
    ours = Model.synthetic(_v4_small(), seed=5)
    ours.save_pretrained(tmp_path)
    hf = DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    _agrees(hf, tmp_path, seed=6)


def test_configs_transformers_cannot_build_are_not_given_its_model_type(tmp_path):
    """A V4.1 config (or a V4 one transformers would build differently) is written with
    model_type "dsv41": transformers' AutoConfig refuses it instead of building another
    model from it."""
    for cfg in (ModelConfig.preset("v41-tiny"), _v4_small().replace(n_shared_experts=2)):
        cfg.to_json(tmp_path / "config.json")
        assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "dsv41"
        with pytest.raises(ValueError, match="dsv41"):
            transformers.AutoConfig.from_pretrained(tmp_path)
        assert ModelConfig.from_json(tmp_path / "config.json") == cfg


# ---- transformers -> dsv41: configs transformers accepts ---------------------------------------

def test_head_dims_that_fit_no_stored_format_run_in_float32(tmp_path):
    """head_dim 96 with 16 RoPE dims (80 no-RoPE dims: not whole 64-dim FP8 tiles) and an
    index head of 48 (not whole 32-dim MXFP4 blocks, not a power of two): nothing is stored
    in the float32 mode, so it runs; the stored mode says why it cannot."""
    hf = _saved_by_transformers(tmp_path, head_dim=96, partial_rotary_factor=16 / 96,
                                index_head_dim=48)
    assert hf.config.qk_rope_head_dim == 16
    _agrees(hf, tmp_path)
    with pytest.raises(ConfigError, match=r"does not fit the fp8_v4 stored KV formats: "
                                          r"index_head_dim=48 .*, head_dim=96 .*; "
                                          r"kv_dtype='float32'"):
        Model.from_pretrained(tmp_path)


def test_index_head_as_wide_as_the_rope_dims(tmp_path):
    hf = _saved_by_transformers(tmp_path, index_head_dim=64)     # RoPE dims: 64
    _agrees(hf, tmp_path)


def test_one_shared_expert_whatever_n_shared_experts_says(tmp_path):
    """transformers builds one shared expert of moe_intermediate_size whatever
    n_shared_experts says (a shape error in dsv41 before)."""
    hf = _saved_by_transformers(tmp_path, n_shared_experts=2)
    assert ModelConfig.from_json(tmp_path / "config.json").n_shared_experts == 1
    _agrees(hf, tmp_path)


def test_other_compression_rates(tmp_path):
    """CSA every 8 tokens and HCA every 32 (dsv41 refused every rate but 4 and 128)."""
    hf = _saved_by_transformers(tmp_path, compress_rates={
        "compressed_sparse_attention": 8, "heavily_compressed_attention": 32})
    cfg = ModelConfig.from_json(tmp_path / "config.json")
    assert cfg.compress_ratios == (0, 8, 32, 8, 0, 32)
    assert cfg.overlap_compress_ratios == (8,) and cfg.dense_compress_ratios == (32,)
    _agrees(hf, tmp_path, **SHORT)


def test_an_all_swa_model(tmp_path):
    """Every layer sliding-window only (the error said missing kv_source_layer_ids)."""
    hf = _saved_by_transformers(tmp_path, layer_types=["sliding_attention"] * 6)
    cfg = ModelConfig.from_json(tmp_path / "config.json")
    assert cfg.compress_ratios == (0,) * 6 and cfg.kv_source_layer_ids == ()
    _agrees(hf, tmp_path, **SHORT)


def test_sigmoid_router(tmp_path):
    hf = _saved_by_transformers(tmp_path, scoring_func="sigmoid")
    _agrees(hf, tmp_path, **SHORT)


def test_tied_word_embeddings(tmp_path):
    """transformers saves no head weight for a tied model (dsv41 reported it missing)."""
    hf = _saved_by_transformers(tmp_path, tie_word_embeddings=True)
    _agrees(hf, tmp_path, **SHORT)


@pytest.mark.parametrize("over, reason", [
    (dict(hc_mult=1), r"hc_mult=1: transformers' DeepseekV4 and DeepSeek's reference still "
                      r"run one mHC stream with weights"),
    (dict(mlp_layer_types=["moe", "hash_moe"] + ["moe"] * 4),
     r"layer 1 routes by token id \(hash_moe\) after layer 0, which routes by score"),
    (dict(compress_rates={"compressed_sparse_attention": 16,
                          "heavily_compressed_attention": 16}),
     r"CSA and HCA layers both compress by 16"),
    (dict(swiglu_limit=0.0), r"swiglu_limit=0.0: transformers' DeepseekV4 clamps the "
                             r"experts' activations to it"),
    # 30 RoPE dims of 176: transformers derives int(176 * (30 / 176)) = 29
    (dict(head_dim=176, partial_rotary_factor=30 / 176),
     r"transformers derives int\(head_dim \* partial_rotary_factor\) = 29 RoPE dims"),
    (dict(rope_parameters={
        "main": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024,
                 "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "compress": {"rope_type": "default", "rope_theta": 160000.0,
                     "partial_rotary_factor": 0.5}}),
     r"rope_parameters\.main: rope_type 'yarn'; dsv41, like DeepSeek's reference, scales"),
])
def test_configs_refused_with_the_reason(tmp_path, over, reason):
    """transformers' DeepseekV4Config accepts each of these and saves it; dsv41 says why it
    does not run it (for the odd RoPE dims transformers itself then fails to build YaRN)."""
    tiny_v4_config(**over).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=reason):
        ModelConfig.from_json(tmp_path / "config.json")
