"""DeepSeek-V4 against transformers 5.23.0's DeepseekV4ForCausalLM (the oracle): tiny
random V4 models (mHC, hash layers, CSA 4, HCA 128, SWA-only layers, YaRN) saved by
transformers, loaded by dsv41 in the float32 reference mode; logits of a prefill, a
second prefill chunk and decode steps must agree to 1e-4. A checkpoint in DeepSeek's
naming with FP8 weights must give the logits of transformers run on the same bytes
dequantized by transformers' own FP8 code."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

from dsv41.config import ModelConfig  # noqa: E402
from dsv41.model import Model  # noqa: E402
from dsv41.model.oracle import random_deepseek_v4, tied_rows  # noqa: E402

TOL = 1e-4
CHUNKS = (133, 6)   # the first chunk completes one HCA (128) window
DECODE = 3


def tiny_v4_config(**over) -> DeepseekV4Config:
    kw = dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=6, num_attention_heads=2,
        head_dim=128, partial_rotary_factor=0.5, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        # 16 indexer heads: an entry scores exactly 0 only when every head's ReLU is 0
        # (2^-16); with 4 heads such ties at the top-k boundary are common and the two
        # implementations break them differently (dsv41 toward the lower index).
        index_n_heads=16, index_head_dim=128, index_topk=4, sliding_window=8,
        max_position_embeddings=4096,
        layer_types=["sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention", "compressed_sparse_attention",
                     "sliding_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1},
    )
    kw.update(over)
    return DeepseekV4Config(**kw)


def random_hf_model(cfg: DeepseekV4Config, seed: int = 0) -> DeepseekV4ForCausalLM:
    return random_deepseek_v4(cfg, seed)


@dataclass
class Agreement:
    """max |logit difference| over the compared rows; rows from the first top-k tie on
    are not compared (dsv41.model.oracle.tied_rows), and are counted."""

    worst: float = 0.0
    compared: int = 0
    skipped: int = 0
    first_tie: int | None = None

    def __str__(self) -> str:
        tie = "" if self.first_tie is None else f" (top-k tie at row {self.first_tie})"
        return (f"max |logit diff| {self.worst:.2e} over {self.compared} rows, "
                f"{self.skipped} skipped{tie}")


def run_both(hf: DeepseekV4ForCausalLM, ours: Model, seed: int = 1,
             chunks=CHUNKS, decode: int = DECODE) -> Agreement:
    """Every token's logits of prefill chunks and decode steps, from both models. A row
    whose indexer selection is tied makes the two implementations differ from that row on
    (its hidden state feeds every later row), so the comparison stops at the first one."""
    g = torch.Generator().manual_seed(seed)
    vocab = hf.config.vocab_size
    cache = transformers.DynamicCache(config=hf.config)
    state = ours.new_state()
    out = Agreement()
    steps = [torch.randint(0, vocab, (n,), generator=g) for n in chunks]
    steps += [torch.randint(0, vocab, (1,), generator=g) for _ in range(decode)]
    with torch.no_grad():
        for ids in steps:
            want = hf(input_ids=ids[None], past_key_values=cache, use_cache=True).logits[0]
            trace: dict = {}
            got = ours.prefill(ids, state, return_all_logits=True, trace=trace)
            tied = tied_rows(ours, state, trace)
            if out.first_tie is None and tied.any():
                first = int(tied.nonzero()[0, 0])
                out.first_tie = state.position - len(ids) + first
                want, got = want[:first], got[:first]
            elif out.first_tie is not None:
                want, got = want[:0], got[:0]
            out.skipped += len(ids) - len(got)
            out.compared += len(got)
            if len(got):
                out.worst = max(out.worst, (want - got).abs().max().item())
    print(out)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = tiny_v4_config()
    hf = random_hf_model(cfg)
    path = tmp_path_factory.mktemp("hf_v4")
    hf.save_pretrained(path)
    return hf, path


def test_config_from_transformers(saved):
    _, path = saved
    cfg = ModelConfig.from_json(path / "config.json")
    assert cfg.compress_ratios == (0, 4, 128, 4, 0, 128)
    assert cfg.kv_source_layer_ids == (1, 2, 3, 5) and cfg.index_source_layer_ids == (1, 3)
    assert cfg.dense_compress_ratios == (128,) and cfg.overlap_compress_ratios == (4,)
    assert cfg.num_hash_layers == 2 and cfg.hc_mult == 4 and cfg.rope_head_dim == 64
    assert cfg.rope_scaling["factor"] == 4.0 and cfg.compress_rope_theta == 160000.0
    assert cfg.main_kv_format == "fp8_v4" and not cfg.encoder_decoder


def test_transformers_checkpoint_matches_oracle(saved):
    hf, path = saved
    ours = Model.from_pretrained(path, kv_dtype="float32")
    agree = run_both(hf, ours)
    assert agree.worst <= TOL and agree.compared >= CHUNKS[0]


def test_oracle_without_mhc_or_yarn(tmp_path):
    """hc_mult 1 in transformers is still a (1-stream) hyper-connection with weights, so
    this variant keeps mHC but drops YaRN and hash layers and uses a longer window."""
    cfg = tiny_v4_config(rope_parameters=None, mlp_layer_types=["moe"] * 6, sliding_window=16,
                         hc_mult=2, index_topk=64)
    hf = random_hf_model(cfg, seed=3)
    hf.save_pretrained(tmp_path)
    agree = run_both(hf, Model.from_pretrained(tmp_path, kv_dtype="float32"), seed=4)
    assert agree.worst <= TOL and agree.compared >= CHUNKS[0]


def test_oracle_compares_around_top_k_ties(tmp_path):
    """With 2 indexer heads an entry scores exactly 0 whenever both heads' ReLU are 0, so
    the scores tie at the top-k boundary early; dsv41 keeps the lower entry ids,
    transformers torch.topk's order. The rows before the first tie agree; from it on the
    two correct implementations differ (here by far more than the tolerance)."""
    cfg = tiny_v4_config(index_n_heads=2)
    hf = random_hf_model(cfg, seed=0)
    hf.save_pretrained(tmp_path)
    ours = Model.from_pretrained(tmp_path, kv_dtype="float32")
    agree = run_both(hf, ours, seed=1)
    assert agree.first_tie is not None and agree.skipped > 0 and agree.compared > 4
    assert agree.worst <= TOL
    ids = torch.randint(0, cfg.vocab_size, (CHUNKS[0],), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
    got = ours.prefill(ids, ours.new_state(), return_all_logits=True)
    assert (want - got)[agree.first_tie].abs().max() > 100 * TOL


def _e8m0_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 weight + one power-of-two UE8M0 scale per block x block tile (the test's
    own quantizer: it only has to produce valid DeepSeek-layout bytes)."""
    out_dim, in_dim = w.shape
    tiles = torch.nn.functional.pad(w, (0, -in_dim % block, 0, -out_dim % block))
    tiles = tiles.view(tiles.shape[0] // block, block, tiles.shape[1] // block, block)
    amax = tiles.abs().amax((1, 3)).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 448.0))
    scale = torch.exp2(exp)
    full = scale.repeat_interleave(block, 0)[:out_dim].repeat_interleave(block, 1)[:, :in_dim]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def test_deepseek_fp8_checkpoint_matches_oracle_on_same_bytes(saved, tmp_path):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    hf, path = saved
    block = 32
    ours_names = Model.from_pretrained(path, kv_dtype="float32").state_dict()
    tensors, deq = {}, {}
    for name, t in ours_names.items():
        quantize = t.dim() == 2 and name.endswith(".weight") and (
            ".attn.w" in name or ".ffn.experts." in name or ".shared_experts." in name) \
            and ".compressor." not in name
        if quantize:
            q, s = _e8m0_blocks(t, block)
            tensors[name], tensors[name.removesuffix("weight") + "scale"] = q, s
            # transformers' own FP8 dequantization of the same bytes
            deq[name] = _dequantize_fp8_weight(q, s, [block, block], torch.float32)
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "weight_block_size": [block, block], "scale_fmt": "ue8m0"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = Model.from_pretrained(tmp_path, kv_dtype="float32")
    # the same dequantized values into transformers' model
    hf_q = random_hf_model(hf.config)
    hf_q.load_state_dict(hf.state_dict())
    sd = hf_q.state_dict()
    from dsv41.model.weights import _rename  # dsv41 name of each transformers tensor
    with torch.no_grad():
        for name, t in sd.items():
            new = _rename(name)
            if new in deq:
                t.copy_(deq[new])
            elif new.endswith(("experts.gate_up_proj", "experts.down_proj")):
                prefix = new.rsplit(".", 1)[0]
                for e in range(t.shape[0]):
                    if new.endswith("gate_up_proj"):
                        inter = t.shape[1] // 2
                        t[e, :inter] = deq[f"{prefix}.{e}.w1.weight"]
                        t[e, inter:] = deq[f"{prefix}.{e}.w3.weight"]
                    else:
                        t[e] = deq[f"{prefix}.{e}.w2.weight"]
    assert any(not torch.equal(a, b) for a, b in zip(hf_q.state_dict().values(),
                                                     hf.state_dict().values()))
    agree = run_both(hf_q, ours)
    assert agree.worst <= TOL and agree.compared >= CHUNKS[0]
