"""The presets: V4.1-Flash and its scaled-down test/benchmark variants, V4-Flash and
v4-tiny, as the field values of each (`PRESET_FIELDS`); `ModelConfig.preset(name)` builds and
validates them. docs/config.md says where each value comes from."""
from __future__ import annotations

from typing import Any

from .values import DEFAULT_BETA_FAST, DEFAULT_BETA_SLOW

__all__ = ["PRESET_FIELDS", "V4_MACHINERY", "preset_names"]

Fields = dict[str, Any]

# What DeepSeek-V4 has beyond V4.1's attention (transformers' DeepseekV4Config defaults):
# mHC with 4 streams, 3 hash-routed MoE layers, `ape` in every compressor, overlapping CSA
# windows and an indexer with its own compressor.
V4_MACHINERY: dict[str, Any] = {
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_hash_layers": 3, "compressor_ape": True,
    "overlap_compress_ratios": (4,), "indexer_compressor": True}


def _v41_flash() -> Fields:
    return dict(
        name="v41-flash",
        vocab_size=129280,
        hidden_size=5120,
        num_layers=40,
        num_heads=64,
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=1280,
        o_groups=8,
        o_lora_rank=1024,
        moe_intermediate_size=2304,
        n_routed_experts=384,
        n_shared_experts=1,
        num_experts_per_tok=6,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        rms_norm_eps=1e-20,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        sliding_window=128,
        # The public list has 43 entries; the last 3 are the draft layers.
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
        kv_source_layer_ids=(2, 8, 14, 20),
        index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
        index_n_heads=32,
        index_head_dim=128,
        index_topk=512,
        candidate_source_layer_id=20,
        candidate_topk_blocks=2048,
        candidate_block_size=8,
        max_position_embeddings=1048576,
        rope_scaling={"factor": 16.0, "original_max_position_embeddings": 65536,
                      "beta_fast": DEFAULT_BETA_FAST, "beta_slow": DEFAULT_BETA_SLOW},
        num_nextn_predict_layers=3,
        # The published V4.1-Flash text_config (deepseek-ai/DeepSeek-V4.1-Flash config.json,
        # as quoted by public loaders; docs/config.md): hc_mult 4, 20 Sinkhorn iterations.
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
    )


def _v4_flash() -> Fields:
    """DeepSeek-V4-Flash (docs/design.md#v4-flash; transformers' DeepseekV4Config defaults
    for the dims).

    Layers 0-1 are SWA-only, then CSA (ratio 4) and HCA (ratio 128) alternate starting
    with CSA (the V4-Flash model card's layer table). Each CSA layer is its own KV and
    index source, each HCA layer its own KV source without an indexer. V4's SWA entries
    use its 584-byte main-KV entry, and its persistent cache checkpointed the SWA state of
    every layer once per 1024 tokens (the release only says SWA was about half of it).
    """
    ratios = (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(41))
    sources = tuple(i for i, r in enumerate(ratios) if r)
    return dict(
        name="v4-flash",
        vocab_size=129280,
        hidden_size=4096,
        num_layers=43,
        num_heads=64,
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=6,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        sliding_window=128,
        compress_ratios=ratios,
        kv_source_layer_ids=sources,
        index_source_layer_ids=tuple(i for i in sources if ratios[i] == 4),
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        candidate_source_layer_id=None,
        candidate_topk_blocks=0,
        candidate_block_size=0,
        max_position_embeddings=1048576,
        rope_scaling={"factor": 16.0, "original_max_position_embeddings": 65536,
                      "beta_fast": DEFAULT_BETA_FAST, "beta_slow": DEFAULT_BETA_SLOW},
        num_nextn_predict_layers=1,
        encoder_decoder=False,
        main_kv_format="fp8_v4",
        dense_compress_ratios=(128,),
        persistent_swa=True,
        persistent_swa_interval_tokens=1024,
        **V4_MACHINERY,
    )


def _v41_scaled(name: str, **dims: Any) -> Fields:
    """A scaled-down V4.1-Flash: Flash's constants (routing, clamps, eps, RoPE thetas,
    candidate block size) with smaller dims and layer plan, and no draft layers. The small
    presets keep the plain residual (hc_mult 1) so that their measured results stay
    comparable across releases; mHC on V4.1 is tested with hc_mult replaced."""
    return _v41_flash() | dict(name=name, num_nextn_predict_layers=0,
                               num_encoder_layers=None, hc_mult=1, **dims)


def _v41_tiny() -> Fields:
    """Unit tests: a full forward on CPU in milliseconds, same layer-plan shape as Flash.
    encoder [0 swa, 1 swa, 2 full r2, 3 reuse r2], decoder [4 full, 5 reuse, 6 reindex,
    7 reuse] at ratio 1."""
    return _v41_scaled(
        "v41-tiny", vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, head_dim=64,
        rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, sliding_window=16,
        compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(2, 4),
        index_source_layer_ids=(2, 4, 6), index_n_heads=2, index_head_dim=32, index_topk=8,
        candidate_source_layer_id=4, candidate_topk_blocks=4, max_position_embeddings=4096,
        rope_scaling={"factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": DEFAULT_BETA_FAST, "beta_slow": DEFAULT_BETA_SLOW},
    )


def _v41_small() -> Fields:
    """Benchmarks: runs on CPU at 16K tokens. encoder [0, 1 swa; 2 full + 3, 4 reuse;
    5 full + 6, 7 reuse] at ratio 2; decoder [8 full + 9-11 reuse; 12 reindex + 13-15
    reuse] at ratio 1."""
    return _v41_scaled(
        "v41-small", vocab_size=1024, hidden_size=256, num_layers=16, num_heads=8, head_dim=128,
        rope_head_dim=32, q_lora_rank=128, o_groups=4, o_lora_rank=128,
        moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
        sliding_window=128, compress_ratios=(0, 0) + (2,) * 6 + (1,) * 8,
        kv_source_layer_ids=(2, 5, 8), index_source_layer_ids=(2, 5, 8, 12), index_n_heads=4,
        index_head_dim=64, index_topk=128, candidate_source_layer_id=8, candidate_topk_blocks=64,
        max_position_embeddings=65536,
        rope_scaling={"factor": 4.0, "original_max_position_embeddings": 16384,
                      "beta_fast": DEFAULT_BETA_FAST, "beta_slow": DEFAULT_BETA_SLOW},
    )


def _v4_tiny() -> Fields:
    """Unit tests and the demo: DeepSeek-V4's machinery at CPU size. Layers [0 swa,
    1 swa, 2 CSA 4, 3 HCA 128, 4 CSA 4, 5 HCA 128]; mHC with 4 streams; one hash layer."""
    ratios = (0, 0, 4, 128, 4, 128)
    return _v4_flash() | dict(
        name="v4-tiny", vocab_size=256, hidden_size=64, num_layers=6,
        num_heads=4, head_dim=128, rope_head_dim=64, q_lora_rank=32, o_groups=2,
        o_lora_rank=32, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        sliding_window=16, compress_ratios=ratios,
        kv_source_layer_ids=tuple(i for i, r in enumerate(ratios) if r),
        index_source_layer_ids=tuple(i for i, r in enumerate(ratios) if r == 4),
        index_n_heads=2, index_head_dim=128, index_topk=8, max_position_embeddings=4096,
        num_nextn_predict_layers=0, num_hash_layers=1,
        rope_scaling={"factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": DEFAULT_BETA_FAST, "beta_slow": DEFAULT_BETA_SLOW},
    )


PRESET_FIELDS: dict[str, Fields] = {
    f["name"]: f for f in (_v41_flash(), _v41_small(), _v41_tiny(), _v4_flash(), _v4_tiny())
}


def preset_names() -> list[str]:
    return list(PRESET_FIELDS)
