"""dsv41 against facts of the public DeepSeek-V4-Flash release (tests/model/fixtures/
deepseek_v4_flash: its config.json byte for byte and its tensor-name listing): the config
reads as the v4-flash preset, its weight formats are read from where DeepSeek puts them
(`expert_dtype` at the top level), and the model built from it has exactly the release's
tensor names and shapes."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41 import Model, ModelConfig
from dsv41.model import CheckpointError, production
from dsv41.model.weights import read_quantization

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek_v4_flash"
RELEASE = json.loads((FIXTURES / "config.json").read_text())


def test_release_config_reads_as_the_v4_flash_preset():
    cfg = ModelConfig.from_json(FIXTURES / "config.json", name="v4-flash")
    assert cfg == ModelConfig.preset("v4-flash")


def test_release_weight_formats_are_read_where_deepseek_puts_them():
    # expert_dtype sits at the top level of the release's config.json, beside a
    # quantization_config that does not repeat it
    assert "expert_dtype" not in RELEASE["quantization_config"]
    assert read_quantization(RELEASE) == {"weight_block_size": [128, 128], "dense_dtype": "fp8",
                                          "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


@pytest.mark.parametrize("raw, want", [
    # transformers' DeepseekV4Config folds the top-level expert_dtype into quantization_config
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                              "expert_dtype": "fp4"}},
     {"weight_block_size": [32, 32], "dense_dtype": "fp8", "expert_dtype": "fp4"}),
    # the V4.1 release: the text model nested, quantization_config beside it
    ({"text_config": {"quantization_config": {"weight_block_size": [32, 32],
                                              "expert_dtype": "fp4"}}},
     {"weight_block_size": [32, 32], "expert_dtype": "fp4"}),
    # DeepSeek's flat inference config (ModelArgs: dtype, expert_dtype, scale_fmt)
    ({"dim": 64, "dtype": "fp8", "expert_dtype": "fp4", "scale_fmt": "ue8m0"},
     {"dense_dtype": "fp8", "expert_dtype": "fp4", "scale_fmt": "ue8m0"}),
    ({"dim": 64, "dtype": "bf16"}, {"dense_dtype": "bf16"}),
    # the HF dtype names the unquantized tensors' dtype, not a quantization
    ({"torch_dtype": "bfloat16", "dtype": "bfloat16"}, None),
])
def test_every_spelling_of_the_weight_formats(raw, want):
    assert read_quantization(raw) == want


def test_conflicting_spellings_are_refused():
    raw = {"expert_dtype": "fp4", "quantization_config": {"expert_dtype": "fp8"}}
    with pytest.raises(ValueError, match=r"expert dtype twice.*quantization_config\."
                                         r"expert_dtype = 'fp8', expert_dtype = 'fp4'"):
        read_quantization(raw)
    with pytest.raises(ValueError, match="expert_dtype = 'int4' is not a weight format"):
        read_quantization({"expert_dtype": "int4"})


def _deepseek_quantized(path: Path, block: int = 64) -> None:
    """Rewrite a saved v4-tiny checkpoint as DeepSeek ships V4: dense Linears FP8 E4M3 with
    one UE8M0 scale per block x block tile, experts packed FP4 with UE8M0 scales per 32."""
    g = torch.Generator().manual_seed(0)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for f in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name in [n for n in tensors if n.endswith(".weight") and tensors[n].dim() == 2]:
            base = name.removesuffix(".weight")
            if base in ("embed", "head") or base.endswith(".gate") or ".compressor." in name:
                continue
            w = tensors[name]
            if ".experts." in name and ".shared_experts." not in name:
                tensors[name] = torch.randint(-128, 128, (w.shape[0], w.shape[1] // 2),
                                              generator=g, dtype=torch.int8)
                tensors[f"{base}.scale"] = torch.randint(
                    118, 124, (w.shape[0], w.shape[1] // 32), generator=g,
                    dtype=torch.uint8).view(torch.float8_e8m0fnu)
            else:
                codes, scale = production.quantize_fp8(w, (block, block))
                tensors[name] = codes
                tensors[f"{base}.scale"] = scale
            index["weight_map"][f"{base}.scale"] = f.name
        save_file(tensors, str(f), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_release_spelling_with_fp4_experts_loads(tmp_path):
    """expert_dtype at the top level (the release's spelling) used to fail with
    `quantization_config.expert_dtype is None`."""
    Model.synthetic(ModelConfig.preset("v4-tiny"), seed=0).save_pretrained(tmp_path)
    _deepseek_quantized(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["expert_dtype"] = RELEASE["expert_dtype"]
    cfg["quantization_config"] = dict(RELEASE["quantization_config"], weight_block_size=[64, 64])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "weights_digest.json").unlink()          # the shards were rewritten
    model = Model.from_pretrained(tmp_path)
    w = model.layers[2].ffn.experts[1].w1.weight
    assert w.dtype == torch.float32 and w.shape == (32, 64)
    # every packed value is one of the FP4 codes times a power of two
    assert torch.isfinite(w).all() and (w != 0).any()
    # the same formats kept as shipped on the production path
    prod = Model.from_pretrained(tmp_path, precision="bf16")
    assert prod.layers[2].ffn.experts[1].w1.weight.dtype == torch.int8
    # two spellings that disagree are refused, naming both
    cfg["quantization_config"]["expert_dtype"] = "fp8"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="expert dtype twice"):
        Model.from_pretrained(tmp_path)


def _family(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".N", name)


def test_release_tensor_names_and_shapes_match_the_model():
    listing = json.loads((FIXTURES / "tensors.json").read_text())
    release = dict(listing["families"])
    config = ModelConfig.from_json(FIXTURES / "config.json")
    with torch.device("meta"):
        model = Model(config)
    ours = Counter(_family(n) for n in model.state_dict())
    # the release adds one `.scale` per quantized Linear weight; nothing else differs
    scales = {f for f in release if f.endswith(".scale")}
    assert all(f.removesuffix(".scale") + ".weight" in ours for f in scales), scales
    assert {f: n for f, n in release.items() if f not in scales} == dict(ours)
    params = model.state_dict()
    for name, (dtype, shape) in listing["layer0"].items():
        if name.endswith(".scale"):
            continue
        logical = list(shape)
        if dtype == "I8":                   # FP4: two codes a byte along the input dim
            logical[-1] *= 2
        assert list(params[name].shape) == logical, name
    assert params["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
