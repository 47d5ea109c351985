"""Block payload layout: byte counts re-derived from docs/design.md#formats, validation,
pack/unpack."""
from __future__ import annotations

import pytest
import torch

from dsv41 import formats
from dsv41.budget import kv_budget
from dsv41.cache.errors import LayoutError, PayloadError
from dsv41.cache.layout import BlockLayout
from dsv41.config import ModelConfig


@pytest.mark.parametrize("preset", ["v41-flash", "v41-small", "v41-tiny"])
@pytest.mark.parametrize("block_tokens", [2, 64, 256])
def test_block_bytes_equal_the_global_kv_budget(preset, block_tokens):
    cfg = ModelConfig.preset(preset)
    lay = BlockLayout(cfg, block_tokens)
    assert lay.block_bytes == kv_budget(cfg).global_bytes_per_token * block_tokens
    # Arrays tile the block exactly, in order, without gaps.
    end = 0
    for s in lay.arrays:
        assert s.offset == end
        end += s.nbytes
    assert end == lay.block_bytes


def test_v41_flash_block_is_890_bytes_per_token():
    lay = BlockLayout(ModelConfig.preset("v41-flash"), 64)
    # 3 ratio-2 owners (32 entries) + 1 ratio-1 owner (64 entries); 288 B main + 68 B index keys.
    assert lay.block_bytes == 3 * 32 * (288 + 68) + 64 * (288 + 68) == 890 * 64
    assert lay.layers == [2, 8, 14, 20]
    s = lay.array(8, "main_scales")
    assert (s.entries, s.width, s.dtype) == (32, 512 // 16, torch.float8_e4m3fn)


def test_bad_block_sizes_and_models_are_refused():
    tiny = ModelConfig.preset("v41-tiny")  # ratios 2 and 1
    with pytest.raises(LayoutError, match="multiple of compress ratio"):
        BlockLayout(tiny, 63)
    with pytest.raises(LayoutError, match="positive"):
        BlockLayout(tiny, 0)
    with pytest.raises(LayoutError, match="multiple of compress ratio"):
        BlockLayout(ModelConfig.preset("v4-flash"), 64)  # HCA entries span 128 tokens


def test_v4_layout_holds_the_fp8_entry():
    cfg = ModelConfig.preset("v4-flash")
    lay = BlockLayout(cfg, 128)
    main = lay.array(2, "main_codes")
    assert (main.width, main.entries, lay.array(2, "main_scales").width) == (584, 32, 0)
    assert lay.array(3, "main_codes").entries == 1  # HCA: one entry, no indexer keys
    with pytest.raises(KeyError):
        lay.array(3, "index_codes")
    assert lay.block_bytes == 128 * kv_budget(cfg).global_bytes_per_token


def test_fingerprint_changes_with_the_layout():
    tiny = ModelConfig.preset("v41-tiny")
    assert BlockLayout(tiny, 64).fingerprint() == BlockLayout(tiny, 64).fingerprint()
    assert BlockLayout(tiny, 64).fingerprint() != BlockLayout(tiny, 32).fingerprint()
    assert BlockLayout(tiny, 64).fingerprint() != BlockLayout(ModelConfig.preset("v41-small"), 64).fingerprint()


def test_pack_unpack_round_trip_with_real_codes(gen):
    cfg = ModelConfig.preset("v41-tiny")
    lay = BlockLayout(cfg, 16)
    n_tokens = 16 * 5
    sources = {}
    for p in cfg.layer_plan():
        if not p.owns_kv:
            continue
        n = n_tokens // p.compress_ratio
        c, s = formats.quantize_nvfp4(torch.randn(n, cfg.head_dim, generator=gen))
        sources[(p.layer, "main_codes")], sources[(p.layer, "main_scales")] = c, s
        c, s = formats.quantize_mxfp4(torch.randn(n, cfg.index_head_dim, generator=gen))
        sources[(p.layer, "index_codes")], sources[(p.layer, "index_scales")] = c, s
    blocks = lay.pack(sources, 1, 3)  # blocks 1..3
    assert blocks.shape == (3, lay.block_bytes)
    view = lay.view(blocks, 2, "main_scales")
    assert view.dtype == torch.float8_e4m3fn and view.shape == (3, 8, cfg.head_dim // 16)
    assert torch.equal(view[0].view(torch.uint8), sources[(2, "main_scales")][8:16].view(torch.uint8))
    dest = {k: torch.zeros_like(v) for k, v in sources.items()}
    lay.unpack(blocks, dest, start_block=1)
    for k, v in sources.items():
        m = lay.array(*k).entries
        assert torch.equal(dest[k][m:4 * m].view(torch.uint8), v[m:4 * m].view(torch.uint8)), k
        assert not dest[k][:m].view(torch.uint8).any() and not dest[k][4 * m:].view(torch.uint8).any()


def test_payload_checks():
    lay = BlockLayout(ModelConfig.preset("v41-tiny"), 16)
    with pytest.raises(PayloadError, match="uint8"):
        lay.check_blocks(torch.zeros(1, lay.block_bytes, dtype=torch.int32))
    with pytest.raises(PayloadError, match="shape"):
        lay.check_blocks(torch.zeros(2, lay.block_bytes + 1, dtype=torch.uint8))
    with pytest.raises(PayloadError, match="lack"):
        lay.pack({}, 0, 1)
