"""KV budget: every figure re-derived in the test from the docs/design.md#formats format
definitions (bits per value plus one scale per block), not from the code under test."""
from __future__ import annotations

import json
from fractions import Fraction

import pytest

from dsv41.budget import compare, format_budget_table, kv_budget
from dsv41.config import ModelConfig, preset_names
from dsv41.formats import layout

FLASH = ModelConfig.preset("v41-flash")
V4 = ModelConfig.preset("v4-flash")


# docs/design.md#formats, from the format descriptions.
def doc_nvfp4(dim: int) -> int:  # 4-bit E2M1 codes + one 1-byte E4M3 scale per 16
    return dim * 4 // 8 + dim // 16


def doc_mxfp4(dim: int) -> int:  # 4-bit E2M1 codes + one 1-byte UE8M0 scale per 32
    return dim * 4 // 8 + dim // 32


def doc_fp8_swa(dim: int) -> int:  # 1-byte E4M3 values + one UE8M0 scale per 32
    return dim + dim // 32


V4_ENTRY = 448 + 64 * 2 + 7 + 1  # e4m3 no-RoPE + bf16 RoPE + 7 ue8m0 scales + 1 pad


def test_format_sizes_match_spec():
    assert doc_nvfp4(512) == layout.nvfp4_bytes(512) == 288
    assert doc_mxfp4(128) == layout.mxfp4_bytes(128) == 68
    assert doc_fp8_swa(512) == layout.fp8_swa_bytes(512) == 528
    assert V4_ENTRY == layout.fp8_v4_main_bytes(448, 64) == 584


def test_flash_global_is_890():
    b = kv_budget(FLASH)
    main, key = doc_nvfp4(512), doc_mxfp4(128)
    assert b.global_bytes_per_token == 3 * main / 2 + main + 3 * key / 2 + key == 890
    assert b.main_bytes_per_token == 3 * main / 2 + main
    assert b.indexer_bytes_per_token == 3 * key / 2 + key
    assert b.persistent_bytes_per_token == 890  # V4.1 persists global KV only
    assert b.persistent_swa_bytes_per_token == 0


def test_flash_per_layer_rows():
    b = kv_budget(FLASH)
    assert [r.layer for r in b.per_layer] == [2, 8, 14, 20]
    for r in b.per_layer:
        ratio = [0, 0, *[2] * 18, *[1] * 20][r.layer]
        assert r.compress_ratio == ratio and r.mode == "full"
        assert r.main_bytes_per_token == doc_nvfp4(512) / ratio
        assert r.index_bytes_per_token == doc_mxfp4(128) / ratio


@pytest.mark.parametrize("name", preset_names())
def test_ledgers_are_sums_of_their_parts(name):
    b = kv_budget(ModelConfig.preset(name))
    assert b.main_bytes_per_token == pytest.approx(sum(r.main_bytes_per_token for r in b.per_layer))
    assert b.indexer_bytes_per_token == pytest.approx(
        sum(r.index_bytes_per_token for r in b.per_layer))
    assert b.global_bytes_per_token == pytest.approx(
        sum(r.total_bytes_per_token for r in b.per_layer))
    assert b.global_bytes_per_token == b.main_bytes_per_token + b.indexer_bytes_per_token
    assert b.persistent_bytes_per_token == pytest.approx(
        b.global_bytes_per_token + b.persistent_swa_bytes_per_token)
    # Only layers that own state appear, and every owner appears once.
    owners = [p.layer for p in b.config.layer_plan() if p.owns_kv or p.owns_indexer_keys]
    assert [r.layer for r in b.per_layer] == owners


def test_flash_swa():
    b = kv_budget(FLASH)
    assert b.swa_bytes_per_token_per_layer == doc_fp8_swa(512) == 528
    assert b.swa_bytes_per_sequence == 128 * 40 * 528


def test_budget_is_derived_from_the_config():
    # Halving head_dim halves the main entry; nothing is a per-token constant.
    b = kv_budget(FLASH.replace(head_dim=256))
    main, key = doc_nvfp4(256), doc_mxfp4(128)
    assert b.global_bytes_per_token == 3 * main / 2 + main + 3 * key / 2 + key
    assert b.swa_bytes_per_token_per_layer == doc_fp8_swa(256)


def test_v4_flash_global_and_persistent():
    b = kv_budget(V4)
    glob = Fraction(21 * V4_ENTRY, 4) + Fraction(20 * V4_ENTRY, 128) + Fraction(21 * 68, 4)
    assert b.global_bytes_per_token == float(glob) == 3514.25
    assert b.swa_bytes_per_token_per_layer == V4_ENTRY
    assert b.swa_bytes_per_sequence == 128 * 43 * V4_ENTRY
    swa = Fraction(128 * 43 * V4_ENTRY, 1024)  # documented assumption: once per 1024 tokens
    assert b.persistent_bytes_per_token == float(glob + swa) == 3514.25 + 3139.0


def test_ratios_v41_vs_v4():
    a, b = kv_budget(FLASH), kv_budget(V4)
    c = compare(a, b)
    assert c.name == "v4-flash"
    assert 0.2 < c.global_ratio < 0.3 and c.global_ratio == pytest.approx(890 / 3514.25)
    assert 0.1 < c.persistent_ratio < 0.15
    assert c.persistent_ratio == pytest.approx(890 / (3514.25 + 3139.0))


def test_compressor_state():
    # Ratio-2 sources carry at most one pending token of kv + score (float32, head_dim each);
    # ratio-1 sources carry none.
    assert kv_budget(FLASH).compressor_state_bytes_per_sequence == 3 * 1 * 2 * 512 * 4


def test_bytes_for_exact_counts():
    b = kv_budget(FLASH)
    n = 1 << 20
    out = b.bytes_for(n)
    assert out["global"] == 890 * n == out["main"] + out["indexer"] == out["persistent"]
    assert out["swa"] == b.swa_bytes_per_sequence and out["compressor_state"] == 0
    odd = b.bytes_for(1001)  # 500 entries per ratio-2 source, 1001 per ratio-1 source
    assert odd["main"] == 3 * 500 * 288 + 1001 * 288
    assert odd["indexer"] == 3 * 500 * 68 + 1001 * 68
    assert odd["compressor_state"] == b.compressor_state_bytes_per_sequence
    assert b.bytes_for(10)["swa"] == 10 * 40 * 528
    assert b.bytes_for(0) == dict.fromkeys(odd, 0)
    with pytest.raises(ValueError):
        b.bytes_for(-1)


def test_bytes_for_v4_includes_swa_checkpoints():
    b = kv_budget(V4)
    n = 128 * 1024  # a multiple of every ratio and of the checkpoint interval
    out = b.bytes_for(n)
    assert out["global"] == b.global_bytes_per_token * n
    assert out["persistent"] == out["global"] + (n // 1024) * b.swa_bytes_per_sequence
    assert out["persistent"] == b.persistent_bytes_per_token * n


def test_to_dict_and_table():
    a, b = kv_budget(FLASH), kv_budget(V4)
    d = json.loads(json.dumps(a.to_dict(compare_to=b)))
    for key in ("global_bytes_per_token", "persistent_bytes_per_token",
                "swa_bytes_per_token_per_layer", "swa_bytes_per_sequence", "preset", "name",
                "per_layer", "vs"):
        assert key in d, key
    assert d["global_bytes_per_token"] == 890 and d["preset"] == "v41-flash"
    assert len(d["per_layer"]) == 4 and d["per_layer"][0]["layer"] == 2
    assert d["vs"]["name"] == "v4-flash"
    assert d["vs"]["global_ratio"] == pytest.approx(890 / 3514.25)
    assert "vs" not in a.to_dict()

    table = format_budget_table(a, compare_to=b)
    assert "890.00" in table and "2,703,360" in table and "vs v4-flash" in table
    assert "0.253x" in table and "0.134x" in table
    assert "vs" not in format_budget_table(a).split("\n")[-1]
