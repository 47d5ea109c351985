"""ModelConfig: presets, the layer plan against docs/design.md#layer-modes, both JSON
spellings, and every validation rule."""
from __future__ import annotations

import json

import pytest

from dsv41.config import ConfigError, LayerPlan, ModelConfig, PRESETS, preset_names

FLASH = ModelConfig.preset("v41-flash")

# docs/design.md#layer-modes, written out independently of the code under test.
FLASH_RATIOS = [0, 0] + [2] * 18 + [1] * 20
FLASH_FULL = {2, 8, 14, 20}
FLASH_REINDEX = {24, 28, 32, 36}
FLASH_SWA = {0, 1}
DRAFT_RATIOS = [0, 0, 0]  # the 3 draft layers' entries; ignored by the loader


def expected_kv_source(layer: int) -> int | None:
    if layer in FLASH_SWA:
        return None
    return max(s for s in FLASH_FULL if s <= layer and FLASH_RATIOS[s] == FLASH_RATIOS[layer])


def expected_index_source(layer: int) -> int | None:
    if layer in FLASH_SWA:
        return None
    sources = FLASH_FULL | FLASH_REINDEX
    return max(s for s in sources if s <= layer and FLASH_RATIOS[s] == FLASH_RATIOS[layer])


def hf_flash_dict() -> dict:
    """A realistic released Hugging Face config: multimodal wrapper, text model under
    text_config, many keys dsv41 does not use, 43 compress_ratios (3 draft layers)."""
    return {
        "architectures": ["DeepseekV41ForConditionalGeneration"],
        "model_type": "deepseek_v41",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0",
        "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24},
        "text_config": {
            "model_type": "deepseek_v41_text",
            "vocab_size": 129280,
            "hidden_size": 5120,
            "num_hidden_layers": 40,
            "num_attention_heads": 64,
            "num_key_value_heads": 1,
            "head_dim": 512,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 1280,
            "o_lora_rank": 1024,
            "o_groups": 8,
            "moe_intermediate_size": 2304,
            "n_routed_experts": 384,
            "n_shared_experts": 1,
            "num_experts_per_tok": 6,
            "scoring_func": "sqrtsoftplus",
            "routed_scaling_factor": 1.5,
            "norm_topk_prob": True,
            "topk_method": "noaux_tc",
            "swiglu_limit": 10,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-20,
            "rope_theta": 10000,
            "compress_rope_theta": 160000,
            "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0},
            "sliding_window": 128,
            "compress_ratios": FLASH_RATIOS + DRAFT_RATIOS,
            "kv_source_layer_ids": [2, 8, 14, 20],
            "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
            "index_n_heads": 32,
            "index_head_dim": 128,
            "index_topk": 512,
            "candidate_source_layer_id": 20,
            "candidate_topk_blocks": 2048,
            "candidate_block_size": 8,
            "num_nextn_predict_layers": 3,
            "max_position_embeddings": 1048576,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "engram_layer_ids": [1, 14],
            "tie_word_embeddings": False,
        },
    }


def flat_flash_dict() -> dict:
    """The flat reference inference/config.json spelling."""
    return {
        "vocab_size": 129280,
        "dim": 5120,
        "n_layers": 40,
        "n_heads": 64,
        "head_dim": 512,
        "rope_head_dim": 64,
        "q_lora_rank": 1280,
        "o_lora_rank": 1024,
        "o_groups": 8,
        "moe_inter_dim": 2304,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "n_activated_experts": 6,
        "score_func": "sqrtsoftplus",
        "route_scale": 1.5,
        "swiglu_limit": 10.0,
        "norm_eps": 1e-20,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_factor": 16,
        "original_seq_len": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
        "window_size": 128,
        "compress_ratios": FLASH_RATIOS + DRAFT_RATIOS,
        "kv_source_layers": [2, 8, 14, 20],
        "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 512,
        "candidate_source_layer": 20,
        "candidate_topk_blocks": 2048,
        "candidate_block_size": 8,
        "n_mtp_layers": 3,
        "max_seq_len": 1048576,
        "dtype": "fp8",
        "hc_mult": 4,
    }


def assert_same_fields(a: ModelConfig, b: ModelConfig, ignore: tuple[str, ...] = ("name",)):
    da, db = a.to_dict(), b.to_dict()
    for key in da:
        if key not in ignore:
            assert da[key] == db[key], key


# ---- presets and the layer plan -----------------------------------------------------------

def test_presets_construct():
    assert set(preset_names()) == {"v41-flash", "v4-flash", "v41-tiny", "v41-small", "v4-tiny"}
    for name in preset_names():
        cfg = ModelConfig.preset(name)
        assert cfg.name == name and PRESETS[name] is cfg
        assert len(cfg.compress_ratios) == cfg.num_layers == len(cfg.layer_plan())
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        ModelConfig.preset("nope")


def test_flash_fields_match_spec():
    c = FLASH
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (40, 5120, 64, 1)
    assert (c.head_dim, c.rope_head_dim, c.nope_head_dim) == (512, 64, 448)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank) == (1280, 8, 1024)
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok) == (384, 1, 6)
    assert (c.moe_intermediate_size, c.routed_scaling_factor, c.swiglu_limit) == (2304, 1.5, 10)
    assert c.scoring_func == "sqrtsoftplus" and c.rms_norm_eps == 1e-20
    assert list(c.compress_ratios) == FLASH_RATIOS
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 512)
    assert (c.candidate_source_layer_id, c.candidate_topk_blocks, c.candidate_block_size) \
        == (20, 2048, 8)
    assert c.rope_scaling["factor"] == 16 and \
        c.rope_scaling["original_max_position_embeddings"] == 65536
    assert (c.rope_theta, c.compress_rope_theta) == (10000, 160000)
    assert (c.max_position_embeddings, c.vocab_size, c.sliding_window) == (1048576, 129280, 128)
    assert c.encoder_layers == range(0, 20) and c.decoder_layers == range(20, 40)


def test_flash_plan_matches_spec():
    plan = FLASH.layer_plan()
    assert all(isinstance(p, LayerPlan) for p in plan)
    for p in plan:
        i = p.layer
        expected_mode = ("swa-only" if i in FLASH_SWA else "full" if i in FLASH_FULL
                         else "reindex" if i in FLASH_REINDEX else "reuse")
        assert p.mode == expected_mode, i
        assert p.part == ("encoder" if i < 20 else "decoder"), i
        assert p.compress_ratio == FLASH_RATIOS[i]
        assert p.kv_source == expected_kv_source(i), i
        assert p.index_source == expected_index_source(i), i
        assert p.index_key_source == expected_kv_source(i), i
        assert p.owns_kv == p.owns_indexer_keys == (i in FLASH_FULL)
        assert p.owns_index_query == (i in FLASH_FULL | FLASH_REINDEX)
        assert not p.dense
    # Spot checks straight from the prose of docs/design.md#layer-modes.
    assert plan[26].kv_source == 20 and plan[26].index_source == 24
    assert plan[19].kv_source == 14 and plan[19].index_source == 14
    assert plan[23].index_source == 20


@pytest.mark.parametrize("name", ["v41-tiny", "v41-small"])
def test_small_presets_keep_the_v41_shape(name):
    cfg = ModelConfig.preset(name)
    plan = cfg.layer_plan()
    enc = [p for p in plan if p.part == "encoder"]
    dec = [p for p in plan if p.part == "decoder"]
    assert len(enc) == len(dec) == cfg.num_layers // 2
    assert [p.mode for p in plan[:2]] == ["swa-only", "swa-only"]
    assert {p.compress_ratio for p in enc[2:]} == {2}
    assert {p.mode for p in enc[2:]} == {"full", "reuse"} and enc[2].mode == "full"
    assert {p.compress_ratio for p in dec} == {1}
    assert dec[0].mode == "full" and dec[0].layer == cfg.candidate_source_layer_id
    assert [p.mode for p in dec[1:]].count("reindex") >= 1
    assert all(p.mode in ("reindex", "reuse") for p in dec[1:])
    for a, b in zip(plan, plan[1:]):  # Full/Reindex are each followed by Reuse
        if a.mode in ("full", "reindex") and b.part == a.part:
            assert b.mode == "reuse"
    assert all(p.kv_source >= dec[0].layer for p in dec)
    assert cfg.head_dim % 32 == 0 and cfg.index_head_dim % 32 == 0


def test_tiny_plan_is_the_documented_one():
    modes = [(p.part, p.mode, p.compress_ratio) for p in ModelConfig.preset("v41-tiny").layer_plan()]
    assert modes == [("encoder", "swa-only", 0), ("encoder", "swa-only", 0),
                     ("encoder", "full", 2), ("encoder", "reuse", 2),
                     ("decoder", "full", 1), ("decoder", "reuse", 1),
                     ("decoder", "reindex", 1), ("decoder", "reuse", 1)]


def test_v4_flash_plan():
    cfg = ModelConfig.preset("v4-flash")
    plan = cfg.layer_plan()
    assert cfg.num_layers == 43 and not cfg.encoder_decoder
    assert cfg.encoder_layers == range(0) and cfg.decoder_layers == range(0)
    assert {p.part for p in plan} == {"layer"}
    csa = [p for p in plan if p.compress_ratio == 4]
    hca = [p for p in plan if p.compress_ratio == 128]
    assert (len(csa), len(hca)) == (21, 20) and plan[2].compress_ratio == 4
    assert all(p.mode == "full" and p.owns_indexer_keys and p.index_source == p.layer
               for p in csa)
    assert all(p.mode == "full" and p.dense and p.owns_kv and not p.owns_indexer_keys
               and p.index_source is None and p.index_key_source is None for p in hca)


# ---- JSON -----------------------------------------------------------------------------------

def test_from_json_hf_nested(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_flash_dict()))
    cfg = ModelConfig.from_json(path)
    assert cfg.name == "deepseek_v41_text"  # no name key: falls back to model_type
    assert_same_fields(cfg, FLASH)
    assert ModelConfig.from_json(path, name="v41-flash") == FLASH


def test_from_dict_hf_top_level():
    d = hf_flash_dict()["text_config"]
    assert ModelConfig.from_dict(d, name="v41-flash") == FLASH


def test_from_dict_flat_inference():
    cfg = ModelConfig.from_dict(flat_flash_dict(), name="v41-flash")
    assert_same_fields(cfg, FLASH, ignore=())


def test_flat_rope_betas_default():
    d = flat_flash_dict()
    del d["beta_fast"], d["beta_slow"]
    rs = ModelConfig.from_dict(d).rope_scaling
    assert (rs["beta_fast"], rs["beta_slow"]) == (32, 1)


def test_newer_transformers_rope_parameters():
    d = hf_flash_dict()
    text = d["text_config"]
    text["rope_parameters"] = text.pop("rope_scaling")
    text["rope_parameters"]["rope_type"] = text["rope_parameters"].pop("type")
    assert ModelConfig.from_dict(d, name="v41-flash") == FLASH


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_json_round_trip(tmp_path, name):
    cfg = PRESETS[name]
    path = tmp_path / f"{name}.json"
    cfg.to_json(path)
    written = json.loads(path.read_text())
    assert written["num_hidden_layers"] == cfg.num_layers and "text_config" not in written
    # transformers' model type only where transformers builds this very model
    assert written["model_type"] == ("deepseek_v4" if name.startswith("v4-") else "dsv41")
    back = ModelConfig.from_json(path)
    assert back == cfg and back.fingerprint() == cfg.fingerprint()
    assert back.layer_plan() == cfg.layer_plan()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_fingerprint_stable_and_sensitive():
    fp = FLASH.fingerprint()
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert ModelConfig.from_dict(flat_flash_dict(), name="v41-flash").fingerprint() == fp
    assert FLASH.replace(index_topk=256).fingerprint() != fp
    assert len({FLASH, FLASH.replace(), FLASH.replace(index_topk=256)}) == 2


def test_replace_validates():
    assert FLASH.replace(index_topk=1024).index_topk == 1024
    with pytest.raises(ConfigError):
        FLASH.replace(sliding_window=0)


# ---- validation ----------------------------------------------------------------------------

def with_ratio(cfg: ModelConfig, layer: int, ratio: int) -> ModelConfig:
    ratios = list(cfg.compress_ratios)
    ratios[layer] = ratio
    return cfg.replace(compress_ratios=tuple(ratios))


@pytest.mark.parametrize("make, message", [
    (lambda: FLASH.replace(index_source_layer_ids=(2, 14, 20, 24, 28, 32, 36)),
     r"layer 8: KV source owns no indexer"),
    (lambda: with_ratio(FLASH, 5, 3), r"layer 5: compress ratio 3 not supported"),
    (lambda: with_ratio(ModelConfig.preset("v4-flash"), 3, 1),
     r"layer 3: compress ratio 1 not supported by fp8_v4 \(supported: 0 and any ratio >= 2\)"),
    (lambda: FLASH.replace(index_source_layer_ids=(2, 8, 10, 14, 20, 24, 28, 32, 36)),
     r"layer 10: Reindex layer in the encoder"),
    (lambda: with_ratio(FLASH, 21, 2), r"layer 21: decoder layer reads encoder KV source 14"),
    (lambda: FLASH.replace(num_encoder_layers=21),
     r"first decoder layer 21 must be a Full KV source"),
    (lambda: FLASH.replace(candidate_source_layer_id=8),
     r"first decoder layer 20 .*candidate_source_layer_id=8"),
    (lambda: FLASH.replace(num_encoder_layers=40), r"non-empty encoder and decoder"),
    (lambda: with_ratio(FLASH, 39, 0), r"layer 39: SWA-only layer in the decoder"),
    (lambda: FLASH.replace(compress_ratios=tuple(FLASH_RATIOS[:39])),
     r"compress_ratios has 39 entries, expected num_layers=40"),
    (lambda: FLASH.replace(kv_source_layer_ids=(8, 14, 20)),
     r"layer 2: compress ratio 2 but no KV source at or before it"),
    (lambda: FLASH.replace(kv_source_layer_ids=(2, 8, 14, 20, 40)),
     r"kv_source_layer_ids: layer 40 out of range"),
    (lambda: FLASH.replace(index_source_layer_ids=(1, 2, 8, 14, 20, 24, 28, 32, 36)),
     r"index_source_layer_ids: layer 1 has compress ratio 0"),
    (lambda: FLASH.replace(kv_source_layer_ids=(8, 2, 14, 20)), r"sorted and unique"),
    # the stored formats' blocks: checked by the stored model, the budget and the cache
    (lambda: ModelConfig.preset("v41-tiny").replace(head_dim=48).check_stored_formats(),
     r"does not fit the nvfp4 stored KV formats: head_dim=48 \(fp8_swa"),
    (lambda: ModelConfig.preset("v41-tiny").replace(index_head_dim=48).check_stored_formats(),
     r"stored KV formats: index_head_dim=48 \(mxfp4"),
    (lambda: ModelConfig.preset("v41-tiny").replace(o_groups=3),
     r"num_heads=4 is not divisible by o_groups=3"),
    (lambda: FLASH.replace(sliding_window=0), r"sliding_window must be positive"),
    (lambda: FLASH.replace(num_kv_heads=2), r"num_kv_heads must be 1"),
    (lambda: FLASH.replace(main_kv_format="fp16"), r"main_kv_format 'fp16' unknown"),
    (lambda: FLASH.replace(persistent_swa=True), r"persistent_swa needs"),
    (lambda: FLASH.replace(candidate_topk_blocks=32), r"fewer than index_topk=512"),
    (lambda: FLASH.replace(rope_scaling={"type": "linear", "factor": 2.0}),
     r"only YaRN is supported"),
    (lambda: ModelConfig.preset("v4-flash").replace(index_source_layer_ids=tuple(
        sorted(ModelConfig.preset("v4-flash").index_source_layer_ids + (41,)))),
     r"layer 41 has dense ratio 128"),
    (lambda: FLASH.replace(num_layers=40.5), r"num_layers: expected an integer"),
])
def test_validation_errors(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_missing_key_in_json_names_it():
    d = hf_flash_dict()
    del d["text_config"]["hidden_size"]
    with pytest.raises(ConfigError, match=r"missing required key 'hidden_size'.*'dim'"):
        ModelConfig.from_dict(d)
    flat = flat_flash_dict()
    del flat["index_source_layers"]
    with pytest.raises(ConfigError, match=r"'index_source_layers'"):
        ModelConfig.from_dict(flat)


def test_too_few_compress_ratios_in_json():
    d = hf_flash_dict()
    d["text_config"]["compress_ratios"] = FLASH_RATIOS[:39]
    with pytest.raises(ConfigError, match=r"compress_ratios has 39 entries, fewer than "
                                          r"num_layers=40"):
        ModelConfig.from_dict(d)


def test_config_package_has_no_import_circle():
    """Every import between the config modules (module level, inside functions and under
    TYPE_CHECKING alike) runs one way: values <- plan, json_io, presets <- model <-
    flash_width (configs built from a preset)."""
    import ast
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[1] / "python" / "dsv41" / "config"
    names = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    edges = {}
    for name in names:
        tree = ast.parse((pkg / f"{name}.py").read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
        edges[name] = deps & names

    def reaches(start, goal, seen=()):
        return any(d == goal or (d not in seen and reaches(d, goal, seen + (d,)))
                   for d in edges[start])

    circles = sorted(n for n in names if reaches(n, n))
    assert circles == [], {n: sorted(edges[n]) for n in circles}
    above_model = {"flash_width"}
    assert edges["values"] == set()
    assert "model" not in set().union(*(edges[n] for n in names - above_model))
