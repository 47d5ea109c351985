"""save_pretrained / from_pretrained: bit-exact round trip, clear errors, full-size meta model."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41 import Model, ModelConfig
from dsv41.model import CheckpointError

from .conftest import token_ids


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tiny.save_pretrained(path, max_shard_bytes=400_000)
    return path


def test_round_trip_is_bit_exact(tiny, saved):
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((saved / s).exists() for s in shards)
    assert set(index["weight_map"]) == set(tiny.state_dict())
    loaded = Model.from_pretrained(saved)
    assert loaded.config == tiny.config and loaded.options == tiny.options
    for name, t in tiny.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    ids = token_ids(25, seed=31)
    assert torch.equal(loaded.prefill(ids, loaded.new_state(), return_all_logits=True),
                       tiny.prefill(ids, tiny.new_state(), return_all_logits=True))


def _copy(saved, tmp_path):
    for f in saved.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


def _edit_shard(path, name, edit):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"][name]
    tensors = load_file(str(shard))
    edit(tensors, index)
    save_file(tensors, str(shard))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    name = "layers.3.attn.wq_a.weight"

    def drop(tensors, index):
        del tensors[name]
        del index["weight_map"][name]
    _edit_shard(path, name, drop)
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.3\.attn\.wq_a\.weight"):
        Model.from_pretrained(path)


def test_missing_tensor_listed_in_the_index_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    name = "layers.6.attn.indexer.wq_b.weight"
    _edit_shard(path, name, lambda tensors, index: tensors.pop(name))
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.6\.attn\.indexer\.wq_b\.weight' .*not there"):
        Model.from_pretrained(path)


def test_misshaped_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    name = "layers.2.attn.compressor.wgate.weight"

    def reshape(tensors, index):
        tensors[name] = torch.zeros(64, 63)
    _edit_shard(path, name, reshape)
    with pytest.raises(CheckpointError, match=r"'layers\.2\.attn\.compressor\.wgate\.weight' has "
                                              r"shape \(64, 63\), expected \(64, 64\)"):
        Model.from_pretrained(path)


def test_extra_tensor_is_named(saved, tmp_path):
    path = _copy(saved, tmp_path)
    name = "norm.weight"

    def add(tensors, index):
        tensors["layers.3.attn.compressor.wkv.weight"] = torch.zeros(64, 64)
        index["weight_map"]["layers.3.attn.compressor.wkv.weight"] = index["weight_map"][name]
    _edit_shard(path, name, add)
    with pytest.raises(CheckpointError, match=r"unexpected tensors: layers\.3\.attn\.compressor"):
        Model.from_pretrained(path)


def test_missing_files(saved, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        Model.from_pretrained(tmp_path)
    path = _copy(saved, tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    (path / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(CheckpointError, match=r"shard model-0000\d-of-0000\d\.safetensors .* is missing"):
        Model.from_pretrained(path)


def _expected_parameter_count(c: ModelConfig) -> int:
    dim, H, D, q, G, R = (c.hidden_size, c.num_heads, c.head_dim, c.q_lora_rank, c.o_groups,
                          c.o_lora_rank)
    Hi, Di, E, inter = c.index_n_heads, c.index_head_dim, c.n_routed_experts, c.moe_intermediate_size
    total = 2 * c.vocab_size * dim + dim                    # embed, head, final norm
    n = c.hc_mult
    if n > 1:                                               # mHC: hc_head, 2 sites a layer
        total += n * n * dim + n + 1 + c.num_layers * 2 * ((2 + n) * n * (n * dim + 1) + 3)
    for p in c.layer_plan():
        total += 2 * dim                                    # attn_norm, ffn_norm
        total += dim * q + q + q * H * D + dim * D + D + H * D * R + G * R * dim + H
        if p.owns_kv:
            total += dim * D * (2 if p.compress_ratio > 1 else 1) + D
        if p.owns_index_query:
            total += q * Hi * Di + dim * Hi
        if p.owns_indexer_keys:
            total += D * Di + Di
        total += E * dim + E + 3 * dim * inter * (E + c.n_shared_experts)
    return total


def test_full_size_model_builds_on_the_meta_device():
    c = ModelConfig.preset("v41-flash")
    with torch.device("meta"):
        model = Model(c)
    n = sum(p.numel() for p in model.parameters())
    assert n == _expected_parameter_count(c)
    assert 3e11 < n < 1e12  # hundreds of billions (384 experts x 40 layers)
    names = set(dict(model.named_parameters()))
    for name in ("embed.weight", "head.weight", "norm.weight", "layers.0.attn.attn_sink",
                 "layers.0.attn.wq_a.weight", "layers.0.attn.q_norm.weight",
                 "layers.0.attn.wq_b.weight", "layers.0.attn.wkv.weight",
                 "layers.0.attn.kv_norm.weight", "layers.0.attn.wo_a.weight",
                 "layers.0.attn.wo_b.weight", "layers.2.attn.compressor.wkv.weight",
                 "layers.2.attn.compressor.wgate.weight", "layers.2.attn.compressor.norm.weight",
                 "layers.2.attn.indexer.wq_b.weight", "layers.2.attn.indexer.weights_proj.weight",
                 "layers.2.attn.indexer.wk.weight", "layers.2.attn.indexer.k_norm.weight",
                 "layers.20.attn.compressor.wkv.weight", "layers.24.attn.indexer.wq_b.weight",
                 "layers.39.ffn.gate.weight", "layers.39.ffn.gate.bias",
                 "layers.39.ffn.experts.383.w1.weight", "layers.39.ffn.experts.383.w2.weight",
                 "layers.39.ffn.experts.383.w3.weight", "layers.39.ffn.shared_experts.w1.weight",
                 "layers.0.attn_norm.weight", "layers.0.ffn_norm.weight"):
        assert name in names, name
    # Ratio-1 layers have no gate; Reindex layers no key projection; Reuse layers neither.
    for name in ("layers.20.attn.compressor.wgate.weight", "layers.24.attn.indexer.wk.weight",
                 "layers.3.attn.compressor.wkv.weight", "layers.25.attn.indexer.wq_b.weight"):
        assert name not in names, name
    assert model.layers[0].attn.wo_a.weight.shape == (8 * 1024, 64 * 512 // 8)


@pytest.fixture(scope="module")
def saved_v4(tmp_path_factory):
    """v4-tiny: its layer 0 routes by token id (an int64 tid2eid table)."""
    path = tmp_path_factory.mktemp("ckpt_v4")
    Model.synthetic(ModelConfig.preset("v4-tiny"), seed=0).save_pretrained(path)
    return path


def _single(saved, tmp_path):
    """The checkpoint as one model.safetensors (no index), weights digest dropped."""
    tensors = {}
    for f in sorted(saved.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((saved / "config.json").read_bytes())
    return tmp_path, tensors


def test_an_out_of_range_hash_table_fails_at_load(saved_v4, tmp_path):
    """tid2eid naming expert 99 of 4 used to load, then fail in the first prefill with
    `index 99 is out of bounds` inside moe.py."""
    path, tensors = _single(saved_v4, tmp_path)
    name = "layers.0.ffn.gate.tid2eid"
    table = tensors[name].clone()
    table[17, 1] = 99
    save_file({**tensors, name: table}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.0\.ffn\.gate\.tid2eid': "
                                              r"tid2eid names expert 99 \(token 17, slot 1\); "
                                              r"the layer has experts 0\.\.3"):
        Model.from_pretrained(path)
    table[17, 1] = -1
    save_file({**tensors, name: table}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"names expert -1 \(token 17, slot 1\)"):
        Model.from_pretrained(path)
    save_file({**tensors, name: tensors[name].float()}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tid2eid must hold integer expert ids, got "
                                              r"dtype torch\.float32"):
        Model.from_pretrained(path)
    # int32 (as some ports store it) holds the same ids: accepted, widened to int64
    save_file({**tensors, name: tensors[name].int()}, str(path / "model.safetensors"))
    loaded = Model.from_pretrained(path)
    assert torch.equal(loaded.state_dict()[name], tensors[name])


def test_a_damaged_shard_is_named_with_what_is_wrong(saved, tmp_path):
    path = _copy(saved, tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / sorted(set(index["weight_map"].values()))[1]
    good = shard.read_bytes()
    shard.write_bytes(good[:-100])
    with pytest.raises(CheckpointError, match=rf"shard .*{shard.name}: truncated: tensor "
                                              r"'.*' ends at byte \d+ of the data section, "
                                              r"the file holds \d+ \(100 bytes missing\)"):
        Model.from_pretrained(path)
    shard.write_bytes(good[:1000])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated: the header alone "
                                              r"should take \d+ bytes after its length, the "
                                              r"file has 992"):
        Model.from_pretrained(path)
    shard.write_bytes(good + b"\0" * 7)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: 7 bytes after the last tensor"):
        Model.from_pretrained(path)
    shard.write_bytes(good[:8] + b"x" + good[9:])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: the safetensors header is "
                                              r"not JSON"):
        Model.from_pretrained(path)
    shard.write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match=rf"{shard.name}: not a safetensors file: 1 "
                                              r"bytes, shorter than the 8-byte header length"):
        Model.from_pretrained(path)
    shard.write_bytes(good)
    (path / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not JSON"):
        Model.from_pretrained(path)


def test_a_hostile_index_is_refused_without_reading_it(saved, tmp_path, monkeypatch):
    """The index is read whole, so only a regular file of bounded size is read at all (a
    FIFO would block the load, /dev/zero never end): issue 29 item 4."""
    import os

    from dsv41.model import checkpoint
    path = _copy(saved, tmp_path)
    index = path / "model.safetensors.index.json"
    good = index.read_bytes()
    index.unlink()
    os.mkfifo(index)
    with pytest.raises(CheckpointError, match=r"index\.json is not a regular file"):
        Model.from_pretrained(path)
    index.unlink()
    index.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"index\.json is not a regular file"):
        Model.from_pretrained(path)
    index.unlink()
    index.write_bytes(good)
    monkeypatch.setattr(checkpoint, "INDEX_MAX_BYTES", len(good) - 1)
    with pytest.raises(CheckpointError, match=rf"index\.json is more than the {len(good) - 1:,} bytes allowed"):
        Model.from_pretrained(path)
    monkeypatch.undo()
    for text, msg in (("[1, 2]", "expected a JSON object at the top level"), ('{"weight_map": [1]}', "weight_map"),
                      ('{"weight_map": {"a": NaN}}', "NaN"), (b'{"\xff": 1}', "not UTF-8")):
        index.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(CheckpointError, match=msg):
            Model.from_pretrained(path)


@pytest.mark.parametrize("section,msg", [
    ([1], r'the "dsv41" key must hold a JSON object, got an array'),
    ("v1", r'the "dsv41" key must hold a JSON object, got a string'),
    ({"model_options": 3}, r'"dsv41"\."model_options" must be a JSON object, got a number'),
    ({"model_options": {"bogus": 1}}, r'"dsv41"\."model_options" holds unknown options bogus'),
    ({"model_options": {"indexer_rotation": "yes"}}, r'"dsv41"\."model_options"\."indexer_rotation" must be bool, '
                                                     r'got a string'),
])
def test_a_malformed_dsv41_key_is_named(saved, tmp_path, section, msg):
    """The "dsv41" key of config.json (save_pretrained's model options) is checked: a value
    of the wrong shape is a one-line error naming the key, not an AttributeError."""
    path = _copy(saved, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["dsv41"] = section
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: " + msg):
        Model.from_pretrained(path)


def test_the_dsv41_key_is_optional_and_kv_dtype_in_it_ignored(saved, tmp_path):
    path = _copy(saved, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["dsv41"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert Model.from_pretrained(path).options == {"indexer_rotation": True}
    cfg["dsv41"] = {"model_options": {"indexer_rotation": True, "kv_dtype": "fp8"}}
    (path / "config.json").write_text(json.dumps(cfg))
    assert Model.from_pretrained(path).options == {"indexer_rotation": True}
