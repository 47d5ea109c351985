"""Checkpoint tensor names and quantized weights: turns what a checkpoint holds into
dsv41's parameter names and float32 values (docs/model.md, "Checkpoints").

Naming: dsv41's own names are DeepSeek's (`embed.weight`, `layers.3.attn.wq_a.weight`,
`layers.3.hc_attn_fn`, `layers.0.ffn.gate.tid2eid`, ...). transformers' in-memory names
(`model.layers.3.self_attn.q_a_proj.weight`, fused `mlp.experts.gate_up_proj`, ...) are
renamed by inverting transformers' conversion mapping for deepseek_v4
(transformers/conversion_mapping.py). What transformers 5.23's save_pretrained writes is
that mapping reversed (DeepSeek's names under a "model." prefix, `model.hc_head.hc_fn`,
and the attention's kv_norm as `attn.norm`): the same rules read it.

Which formats a checkpoint uses is read from its config.json by `read_quantization`, in
every spelling DeepSeek and transformers use: `quantization_config` (top level or inside
`text_config`: `weight_block_size`, `expert_dtype`, `scale_fmt`, `fmt`); `expert_dtype` at
the top level (DeepSeek-V4's released config.json puts it there; transformers folds it into
quantization_config); and DeepSeek's flat inference config (`dtype` "fp8"/"bf16" for the
dense weights, `expert_dtype`, `scale_fmt`). Two spellings that disagree are an error.

Quantized weights (DeepSeek's release; transformers' FP8 integration reads the same bytes):
  - FP8: `X.weight` float8_e4m3fn [out, in] with `X.scale` (DeepSeek) or
    `X.weight_scale_inv` (transformers) [ceil(out/b0), ceil(in/b1)], one scale per
    b0 x b1 block, (b0, b1) = quantization_config.weight_block_size (DeepSeek's
    inference/model.py: block_size = 128); scales float32 or UE8M0 (float8_e8m0fnu, or
    its raw uint8 exponent byte). weight = e4m3 * scale of its block.
  - FP4 experts (quantization_config.expert_dtype == "fp4", V4.1): `X.weight` int8
    [out, in/2], two E2M1 codes per byte, element 2k in the low nibble (DeepSeek's
    inference/convert.py FP4_TABLE: 0, .5, 1, 1.5, 2, 3, 4, 6 and negatives, sign in bit
    3), `X.scale` UE8M0 [out, in/32] (fp4_block_size = 32 along the input dim).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

__all__ = [
    "FP4_TABLE",
    "WeightError",
    "dequantize_all",
    "from_transformers",
    "is_transformers_naming",
    "read_quantization",
]

FP4_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                          -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP4_BLOCK = 32
DEFAULT_FP8_BLOCK = (128, 128)


class WeightError(ValueError):
    """A checkpoint tensor that cannot be turned into a dsv41 parameter."""


EXPERT_DTYPES = ("fp4", "fp8", "bf16")   # formats a checkpoint's experts may be stored in
_DTYPE_NAMES = {"fp4": "fp4", "fp8": "fp8", "e4m3": "fp8", "float8_e4m3fn": "fp8",
                "bf16": "bf16", "bfloat16": "bf16"}


def _dtype_name(where: str, value) -> str:
    name = _DTYPE_NAMES.get(str(value).lower()) if isinstance(value, str) else None
    if name is None:
        raise WeightError(f"{where} = {value!r} is not a weight format dsv41 reads "
                          f"({', '.join(EXPERT_DTYPES)})")
    return name


def read_quantization(raw: Mapping) -> dict | None:
    """The weight formats a config.json (as parsed JSON) declares, as one dict:
    {"weight_block_size": [b0, b1], "expert_dtype", "dense_dtype", "scale_fmt"} with the
    keys it states (dtypes "fp4" / "fp8" / "bf16"); None when it states none (the caller
    then falls back to what the tensors' own dtypes say). See the module docstring for the
    spellings read."""
    if not isinstance(raw, Mapping):
        return None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else {}
    found: dict[str, tuple[str, object]] = {}   # key -> (where it was read, value)

    def take(key: str, where: str, value) -> None:
        if value is None:
            return
        if key in found and found[key][1] != value:
            raise WeightError(f"config.json states the {key.replace('_', ' ')} twice and "
                              f"differently: {found[key][0]} = {found[key][1]!r}, "
                              f"{where} = {value!r}")
        found.setdefault(key, (where, value))

    for prefix, src in (("", raw), ("text_config.", text)):
        q = src.get("quantization_config")
        if isinstance(q, Mapping):
            at = f"{prefix}quantization_config"
            if q.get("weight_block_size") is not None:
                block = q["weight_block_size"]
                if (not isinstance(block, (list, tuple)) or len(block) != 2
                        or not all(isinstance(b, int) and b > 0 for b in block)):
                    raise WeightError(f"{at}.weight_block_size must be two positive ints, "
                                      f"got {block!r}")
                take("weight_block_size", f"{at}.weight_block_size", [int(b) for b in block])
            if q.get("expert_dtype") is not None:
                take("expert_dtype", f"{at}.expert_dtype",
                     _dtype_name(f"{at}.expert_dtype", q["expert_dtype"]))
            if q.get("quant_method") == "fp8" or q.get("fmt") is not None:
                fmt = q.get("fmt", "e4m3")
                take("dense_dtype", f"{at}.fmt", _dtype_name(f"{at}.fmt", fmt))
            if q.get("scale_fmt") is not None:
                take("scale_fmt", f"{at}.scale_fmt", str(q["scale_fmt"]))
        if src.get("expert_dtype") is not None:
            take("expert_dtype", f"{prefix}expert_dtype",
                 _dtype_name(f"{prefix}expert_dtype", src["expert_dtype"]))
        # DeepSeek's flat inference config (ModelArgs): `dtype` is "fp8" or "bf16" there;
        # the HF `dtype`/`torch_dtype` ("bfloat16") names the unquantized tensors' dtype.
        if src.get("dtype") in ("fp8", "bf16"):
            take("dense_dtype", f"{prefix}dtype", src["dtype"])
        if src.get("scale_fmt") is not None:
            take("scale_fmt", f"{prefix}scale_fmt", str(src["scale_fmt"]))
    if not found:
        return None
    return {key: value for key, (_, value) in found.items()}


def is_transformers_naming(names) -> bool:
    return any(n.startswith(("model.layers.", "model.embed_tokens.")) for n in names)


# transformers -> DeepSeek/dsv41, applied in order to the name with "model." stripped.
_RENAMES = [
    (r"^embed_tokens\.", "embed."), (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"), (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."), (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."), (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."), (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    # transformers 5.23's save_pretrained writes DeepSeek's names back by reversing its
    # mapping, which turns the attention's kv_norm into `attn.norm` and keeps "model."
    (r"\.attn\.norm\.", ".attn.kv_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
]


def _rename(name: str) -> str:
    out = name.removeprefix("model.")
    for pat, rep in _RENAMES:
        out = re.sub(pat, rep, out)
    return out


def from_transformers(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' names (and fused expert tensors) -> dsv41's."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        new = _rename(name)
        if new.endswith(".ffn.experts.gate_up_proj"):
            prefix = new.removesuffix("gate_up_proj")
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.w1.weight"] = t[e, :inter]
                out[f"{prefix}{e}.w3.weight"] = t[e, inter:]
        elif new.endswith(".ffn.experts.down_proj"):
            prefix = new.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.w2.weight"] = t[e]
        else:
            out[new] = t
    return out


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 values of a scale tensor: float, float8_e8m0fnu, or UE8M0 exponent bytes."""
    if scale.dtype == torch.uint8:
        return torch.ldexp(torch.ones(scale.shape), scale.to(torch.int32) - 127)
    return scale.float()


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   name: str) -> torch.Tensor:
    out_dim, in_dim = weight.shape
    b0, b1 = block
    want = (math.ceil(out_dim / b0), math.ceil(in_dim / b1))
    if tuple(scale.shape) != want:
        raise WeightError(f"tensor {name!r}: FP8 weight {tuple(weight.shape)} with block "
                          f"{block} needs scales of shape {want}, got {tuple(scale.shape)}")
    s = _scale_values(scale).repeat_interleave(b0, 0)[:out_dim].repeat_interleave(b1, 1)
    return weight.float() * s[:, :in_dim]


def dequantize_fp4(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    out_dim, half = weight.shape
    in_dim = 2 * half
    if in_dim % FP4_BLOCK or tuple(scale.shape) != (out_dim, in_dim // FP4_BLOCK):
        raise WeightError(f"tensor {name!r}: FP4 weight {tuple(weight.shape)} (packed) needs "
                          f"scales of shape {(out_dim, in_dim // FP4_BLOCK)}, got "
                          f"{tuple(scale.shape)}")
    b = weight.view(torch.uint8).long()
    values = torch.stack((FP4_TABLE[b & 0xF], FP4_TABLE[b >> 4]), -1).reshape(out_dim, in_dim)
    return values * _scale_values(scale).repeat_interleave(FP4_BLOCK, 1)


def dequantize_all(tensors: dict[str, torch.Tensor], quant: Mapping | None
                   ) -> dict[str, torch.Tensor]:
    """Replace every quantized `X.weight` (+ `X.scale` / `X.weight_scale_inv`) by its
    float32 values; other tensors pass through. quant: `read_quantization`'s dict."""
    quant = dict(quant or {})
    block = tuple(quant.get("weight_block_size") or DEFAULT_FP8_BLOCK)
    out = dict(tensors)
    for name, t in tensors.items():
        if not name.endswith(".weight"):
            continue
        base = name.removesuffix(".weight")
        scale_name = next((s for s in (f"{base}.scale", f"{base}.weight_scale_inv")
                           if s in tensors), None)
        if t.dtype == torch.float8_e4m3fn:
            if scale_name is None:
                raise WeightError(f"tensor {name!r}: FP8 weight without {base}.scale")
            out[name] = dequantize_fp8(t, tensors[scale_name], block, name)
        elif t.dtype in (torch.int8, torch.uint8) and scale_name is not None:
            if quant.get("expert_dtype") != "fp4":
                raise WeightError(f"tensor {name!r}: packed {t.dtype} weight but the config "
                                  f"states expert_dtype {quant.get('expert_dtype')!r}, not "
                                  f"'fp4' (read from expert_dtype or "
                                  f"quantization_config.expert_dtype)")
            out[name] = dequantize_fp4(t, tensors[scale_name], name)
        else:
            continue
        del out[scale_name]
    return out
