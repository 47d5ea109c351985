"""V4 config spellings: DeepSeek's flat inference config.json (no max_seq_len: DeepSeek's
ModelArgs default 4096; original_seq_len 0: no YaRN) and transformers' layer lists."""
from __future__ import annotations

import pytest

from dsv41.config import ConfigError, ModelConfig
from dsv41.config.json_io import DEEPSEEK_MAX_SEQ_LEN


def flat_v4() -> dict:
    return {"vocab_size": 256, "dim": 64, "n_layers": 4, "n_hash_layers": 1, "n_mtp_layers": 1,
            "n_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
            "n_activated_experts": 2, "score_func": "sqrtsoftplus", "route_scale": 1.5,
            "swiglu_limit": 10.0, "q_lora_rank": 32, "head_dim": 128, "rope_head_dim": 64,
            "norm_eps": 1e-6, "o_groups": 2, "o_lora_rank": 32, "window_size": 16,
            "moe_inter_dim": 32, "compress_ratios": [0, 4, 128, 4, 0],
            "compress_rope_theta": 160000.0, "rope_theta": 10000.0, "rope_factor": 16,
            "original_seq_len": 0, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 2,
            "index_head_dim": 128, "index_topk": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6}


def test_deepseek_flat_v4_defaults():
    cfg = ModelConfig.from_dict(flat_v4(), name="flat")
    assert cfg.max_position_embeddings == DEEPSEEK_MAX_SEQ_LEN == 4096
    assert cfg.rope_scaling is None  # original_seq_len 0
    assert cfg.compress_ratios == (0, 4, 128, 4)  # the draft layer's entry dropped
    assert cfg.num_hash_layers == 1 and cfg.kv_source_layer_ids == (1, 2, 3)
    assert cfg.index_source_layer_ids == (1, 3) and cfg.dense_compress_ratios == (128,)
    assert cfg.overlap_compress_ratios == (4,) and cfg.compressor_ape


def test_transformers_layer_lists_are_checked():
    d = flat_v4()
    del d["compress_ratios"]
    d["layer_types"] = ["sliding_attention", "compressed_sparse_attention",
                        "heavily_compressed_attention", "linear_attention"]
    with pytest.raises(ConfigError, match="unknown layer type"):
        ModelConfig.from_dict(d)
    d["layer_types"][3] = "sliding_attention"
    d["mlp_layer_types"] = ["moe", "hash_moe", "moe", "moe"]
    del d["n_hash_layers"]
    with pytest.raises(ConfigError, match=r"layer 1 routes by token id \(hash_moe\) after "
                                          r"layer 0, which routes by score"):
        ModelConfig.from_dict(d)


def test_v4_presets_have_v4_machinery():
    for name in ("v4-flash", "v4-tiny"):
        cfg = ModelConfig.preset(name)
        assert cfg.hc_mult == 4 and cfg.num_hash_layers >= 1 and cfg.indexer_compressor
    assert ModelConfig.preset("v41-flash").hc_mult == 4
    assert ModelConfig.preset("v41-flash").num_hash_layers == 0
