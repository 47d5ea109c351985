"""`dsv41 plan`: weight bytes as stored, counted on the meta device, against a closed form."""
from __future__ import annotations

import json
import math

import pytest
from dsv41.cli import main
from dsv41.config import ModelConfig
from dsv41.gpu_plan import StoredFormat, memory_plan, weight_bytes


def _fp8(o, i):
    return o * i + math.ceil(o / 128) * math.ceil(i / 128)


def _fp4(o, i):
    return o * i // 2 + o * i // 32


def _stored_bytes(c: ModelConfig) -> int:
    """DeepSeek's release layout from the config's shapes alone: FP8 dense Linears with a
    UE8M0 byte per 128x128 block, FP4 routed experts with a UE8M0 byte per 32 inputs, the
    embedding/head/norms/router in bf16, mHC and attention sinks in float32."""
    dim, H, D, q, G, R = (c.hidden_size, c.num_heads, c.head_dim, c.q_lora_rank, c.o_groups,
                          c.o_lora_rank)
    Hi, Di, E, inter = c.index_n_heads, c.index_head_dim, c.n_routed_experts, c.moe_intermediate_size
    assert c.num_hash_layers == 0 and not any(p.overlap for p in c.layer_plan())
    total = 2 * (2 * c.vocab_size * dim + dim)
    n = c.hc_mult
    if n > 1:
        total += 4 * (n * n * dim + n + 1 + c.num_layers * 2 * ((2 + n) * n * (n * dim + 1) + 3))
    shared = c.n_shared_experts * inter
    for p in c.layer_plan():
        total += 2 * (2 * dim + q + D) + 4 * H
        total += (_fp8(q, dim) + _fp8(H * D, q) + _fp8(D, dim) + _fp8(G * R, H * D // G)
                  + _fp8(dim, G * R))
        if p.owns_kv:
            total += _fp8(D, dim) * (2 if p.compress_ratio > 1 else 1) + 2 * D
        if p.owns_index_query:
            total += _fp8(Hi * Di, q) + _fp8(Hi, dim)
        if p.owns_indexer_keys:
            total += _fp8(Di, D) + 2 * Di
        total += 2 * (E * dim + E) + 2 * _fp8(shared, dim) + _fp8(dim, shared)
        total += E * (2 * _fp4(inter, dim) + _fp4(dim, inter))
    return total


def test_full_size_weight_bytes_match_closed_form():
    c = ModelConfig.preset("v41-flash")
    wb = weight_bytes(c, StoredFormat())
    assert sum(wb.values()) == _stored_bytes(c)
    assert 2.5e11 < sum(wb.values()) < 3.5e11


def test_plan_per_gpu_and_budget():
    c = ModelConfig.preset("v41-flash")
    one, four = memory_plan(c, gpus=1), memory_plan(c, gpus=4)
    assert not one.fits and one.global_kv_tokens_per_gpu == 0
    assert four.fits and four.weight_bytes_per_gpu == math.ceil(four.weight_bytes_total / 4)
    left = 141 * 10**9 - 10 * 10**9 - four.weight_bytes_per_gpu
    assert four.kv_budget_bytes_per_gpu == left
    assert four.global_kv_tokens_per_gpu == int(left // four.global_kv_bytes_per_token)
    assert four.global_kv_bytes_per_token == pytest.approx(890, abs=1)
    assert four.swa_sessions_per_gpu == left // four.swa_state_bytes_per_session
    small = memory_plan(ModelConfig.preset("v41-small"))
    assert small.fits and small.stored_format["dense"] == "bf16"


def test_cli_plan(capsys, tmp_path):
    assert main(["plan", "--preset", "v41-tiny", "--gpus", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpus"] == 2 and d["fits"] and d["weight_bytes_total"] > 0
    assert main(["plan", "--preset", "v4-tiny", "--gpu-memory-gb", "80"]) == 0
    assert "KV budget left per GPU" in capsys.readouterr().out
    cfg = ModelConfig.preset("v4-tiny").to_hf_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                  "expert_dtype": "fp4"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["stored_format"]["dense"] == "fp8" and d["stored_format"]["experts"] == "fp4"
    with pytest.raises(SystemExit) as e:   # argparse: --gpus is at least 1
        main(["plan", "--preset", "v41-tiny", "--gpus", "0"])
    assert e.value.code == 2 and "--gpus" in capsys.readouterr().err
