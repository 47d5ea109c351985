"""The JSON spellings a `ModelConfig` is read from and written as (docs/config.md).

Read: (1) dsv41's own / the Hugging Face V4.1 spelling (text model nested under
`text_config` or at top level); (2) transformers' `DeepseekV4Config.save_pretrained`
(`layer_types` + `compress_rates`, `mlp_layer_types`, `partial_rotary_factor`, nested
`rope_parameters` {"main", "compress"}); (3) DeepSeek's flat inference `config.json`
(`dim`, `n_layers`, `window_size`, `rope_factor`, ..., as its `ModelArgs` reads it) and
DeepSeek's released HF config.json (`model_type` "deepseek_v4", `compress_ratios`); and
`to_dict()` output.

A DeepSeek-V4 file (transformers' or DeepSeek's spelling, or ratios that are V4's 4 and 128
only) gets V4's machinery (`fp8_v4` KV, dense HCA, overlapping CSA windows, `ape`, the
indexer's own compressor, every compressing layer its own KV source) unless the file says
otherwise, and is read as transformers' DeepseekV4 and DeepSeek's reference read it; what
they define and dsv41 does not model is refused with the reason (`_read_v4_semantics`).

Written (`to_hf_dict`): every field at the top level under its HF key. A config that
transformers' DeepseekV4 can build (`transformers_mismatch` is None) also gets
`model_type` "deepseek_v4" and transformers' own keys, so `DeepseekV4Config.
from_pretrained` reads the same model; any other config gets `model_type` "dsv41", which
transformers does not know, instead of one it would read as something else.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ..argcheck import read_regular_file
from .values import DEFAULT_BETA_FAST, DEFAULT_BETA_SLOW, ConfigError, as_int

__all__ = ["CONFIG_MAX_BYTES", "CONFIG_MAX_DEPTH", "DEEPSEEK_MAX_SEQ_LEN", "from_dict", "read_config_file",
           "to_hf_dict", "transformers_mismatch"]

# What a config file may be, checked where it is read (read_config_file): model configs are
# a few KB, a few levels deep, with integers far below 2**53 (beyond it JSON numbers are not
# exact in most readers). Anything else is refused before a field is looked at.
CONFIG_MAX_BYTES = 4 << 20
CONFIG_MAX_DEPTH = 32
_MAX_JSON_INT = 2**53

# DeepSeek's inference ModelArgs default for max_seq_len (its flat config.json omits it).
DEEPSEEK_MAX_SEQ_LEN = 4096

# transformers' DeepseekV4Config layer types; CSA and HCA compress by `compress_rates`
# (default 4 and 128, DeepSeek-V4's: its reference gives ratio-4 layers the indexer and
# overlapping windows and treats every other ratio as dense).
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
V4_LAYER_TYPES = ("sliding_attention", CSA, HCA)
V4_RATIOS = (4, 128)
V4_MODEL_TYPE = "deepseek_v4"

_KEY_ALIASES: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size", "vocab_size"),
    "hidden_size": ("hidden_size", "dim"),
    "num_layers": ("num_hidden_layers", "n_layers"),
    "num_heads": ("num_attention_heads", "n_heads"),
    "num_kv_heads": ("num_key_value_heads", "n_kv_heads"),
    "head_dim": ("head_dim", "head_dim"),
    "rope_head_dim": ("qk_rope_head_dim", "rope_head_dim"),
    "q_lora_rank": ("q_lora_rank", "q_lora_rank"),
    "o_groups": ("o_groups", "o_groups"),
    "o_lora_rank": ("o_lora_rank", "o_lora_rank"),
    "moe_intermediate_size": ("moe_intermediate_size", "moe_inter_dim"),
    "n_routed_experts": ("n_routed_experts", "n_routed_experts"),
    "n_shared_experts": ("n_shared_experts", "n_shared_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "n_activated_experts"),
    "scoring_func": ("scoring_func", "score_func"),
    "routed_scaling_factor": ("routed_scaling_factor", "route_scale"),
    "swiglu_limit": ("swiglu_limit", "swiglu_limit"),
    "rms_norm_eps": ("rms_norm_eps", "norm_eps"),
    "rope_theta": ("rope_theta", "rope_theta"),
    "compress_rope_theta": ("compress_rope_theta", "compress_rope_theta"),
    "sliding_window": ("sliding_window", "window_size"),
    "compress_ratios": ("compress_ratios", "compress_ratios"),
    "kv_source_layer_ids": ("kv_source_layer_ids", "kv_source_layers"),
    "index_source_layer_ids": ("index_source_layer_ids", "index_source_layers"),
    "index_n_heads": ("index_n_heads", "index_n_heads"),
    "index_head_dim": ("index_head_dim", "index_head_dim"),
    "index_topk": ("index_topk", "index_topk"),
    "candidate_source_layer_id": ("candidate_source_layer_id", "candidate_source_layer"),
    "candidate_topk_blocks": ("candidate_topk_blocks", "candidate_topk_blocks"),
    "candidate_block_size": ("candidate_block_size", "candidate_block_size"),
    "max_position_embeddings": ("max_position_embeddings", "max_seq_len"),
    "num_nextn_predict_layers": ("num_nextn_predict_layers", "n_mtp_layers"),
    "encoder_decoder": ("encoder_decoder", "encoder_decoder"),
    "num_encoder_layers": ("num_encoder_layers", "n_encoder_layers"),
    "main_kv_format": ("main_kv_format", "main_kv_format"),
    "dense_compress_ratios": ("dense_compress_ratios", "dense_compress_ratios"),
    "persistent_swa": ("persistent_swa", "persistent_swa"),
    "persistent_swa_interval_tokens": ("persistent_swa_interval_tokens",
                                       "persistent_swa_interval_tokens"),
}
_KEYS = {name: tuple(dict.fromkeys(keys + (name,))) for name, keys in _KEY_ALIASES.items()}
_KEYS["name"] = ("name",)
for _name, _extra in (("num_hash_layers", ("n_hash_layers",)), ("hc_mult", ()),
                      ("hc_sinkhorn_iters", ()), ("hc_eps", ()), ("compressor_ape", ()),
                      ("overlap_compress_ratios", ()), ("indexer_compressor", ())):
    _KEYS[_name] = (_name,) + _extra


def transformers_mismatch(cfg) -> str | None:
    """Why transformers' DeepseekV4ForCausalLM cannot build this config's model (None when
    it can): transformers' V4 always has V4's machinery, one shared expert, at least one mHC
    stream with weights, and derives the RoPE dims as int(head_dim * partial_rotary_factor)."""
    nonzero = sorted({r for r in cfg.compress_ratios if r})
    if cfg.main_kv_format != "fp8_v4" or cfg.encoder_decoder:
        return "a V4.1 model (NVFP4 KV, the causal encoder-decoder)"
    if not (cfg.compressor_ape and cfg.indexer_compressor):
        return "compressors without V4's position bias or indexer compressor"
    if len(cfg.overlap_compress_ratios) > 1 or len(cfg.dense_compress_ratios) > 1 or \
            set(cfg.overlap_compress_ratios) & set(cfg.dense_compress_ratios) or \
            set(nonzero) - set(cfg.overlap_compress_ratios) - set(cfg.dense_compress_ratios):
        return "layers that are neither one CSA (overlapping, indexed) nor one HCA (dense) rate"
    if list(cfg.kv_source_layer_ids) != [i for i, r in enumerate(cfg.compress_ratios) if r] \
            or list(cfg.index_source_layer_ids) != [
                i for i, r in enumerate(cfg.compress_ratios)
                if r and r not in cfg.dense_compress_ratios] \
            or cfg.candidate_source_layer_id is not None:
        return "compressing layers that share KV or top-k with others"
    if cfg.hc_mult < 2:
        return "the plain residual (hc_mult=1; transformers runs one mHC stream with weights)"
    if cfg.n_shared_experts != 1:
        return (f"n_shared_experts={cfg.n_shared_experts} (transformers builds one shared "
                f"expert of moe_intermediate_size)")
    if cfg.scoring_func not in ("sqrtsoftplus", "sigmoid"):
        return f"scoring_func {cfg.scoring_func!r} (transformers has no such router score)"
    if cfg.swiglu_limit <= 0:
        return "swiglu_limit <= 0 (transformers clamps the experts' activations to it)"
    if int(cfg.head_dim * (cfg.rope_head_dim / cfg.head_dim)) != cfg.rope_head_dim:
        return (f"rope_head_dim={cfg.rope_head_dim} of head_dim={cfg.head_dim}: transformers "
                f"derives int(head_dim * partial_rotary_factor) = "
                f"{int(cfg.head_dim * (cfg.rope_head_dim / cfg.head_dim))}")
    return None


def to_hf_dict(cfg) -> dict[str, Any]:
    """The config as config.json holds it; cfg is a ModelConfig (its fields are read, its
    class is not imported here)."""
    flat = cfg.to_dict()
    out: dict[str, Any] = {"name": cfg.name}
    for f in fields(cfg):
        if f.name not in ("name", "rope_scaling"):
            out[_KEYS[f.name][0]] = flat[f.name]
    yarn = None if cfg.rope_scaling is None else {"rope_type": "yarn", **cfg.rope_scaling}
    if transformers_mismatch(cfg) is not None:
        out["model_type"] = "dsv41"
        out["rope_scaling"] = yarn
        return out
    # transformers' own spelling of the same model (configuration_deepseek_v4.py)
    rates = {CSA: (cfg.overlap_compress_ratios or V4_RATIOS[:1])[0],
             HCA: (cfg.dense_compress_ratios or V4_RATIOS[1:])[0]}
    kind = {0: V4_LAYER_TYPES[0], rates[CSA]: CSA, rates[HCA]: HCA}
    factor = cfg.rope_head_dim / cfg.head_dim
    compress = {"rope_type": "default"} if yarn is None else dict(yarn, attention_factor=1.0)
    out.update({
        "model_type": V4_MODEL_TYPE, "architectures": ["DeepseekV4ForCausalLM"],
        "layer_types": [kind[r] for r in cfg.compress_ratios],
        "compress_rates": rates,
        "mlp_layer_types": ["hash_moe" if cfg.hash_layer(i) else "moe"
                            for i in range(cfg.num_layers)],
        "partial_rotary_factor": factor,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                     "partial_rotary_factor": factor},
            "compress": {**compress, "rope_theta": cfg.compress_rope_theta,
                         "partial_rotary_factor": factor}},
        "tie_word_embeddings": False,
    })
    return out


def read_config_file(path: str | os.PathLike, max_bytes: int = CONFIG_MAX_BYTES) -> dict[str, Any]:
    """The JSON object in a config file, or ConfigError: not a regular file (a FIFO or
    /dev/zero would block or never end), over max_bytes (CONFIG_MAX_BYTES unless a larger
    document, such as a checkpoint's index, is read), not UTF-8, not JSON, NaN or Infinity,
    nested deeper than CONFIG_MAX_DEPTH, an integer of 2**53 or more, or not an object at
    the top level. OSError when it cannot be opened (missing, permissions)."""
    where = os.fspath(path)
    try:
        raw = read_regular_file(path, max_bytes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start})") from None

    def no_constant(name: str):
        raise ConfigError(f"{where}: {name} is not a number a config may hold")
    try:
        doc = json.loads(text, parse_constant=no_constant)
    except ConfigError:
        raise
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested deeper than {CONFIG_MAX_DEPTH} levels") from None
    except ValueError:   # the only other: an integer of more digits than Python converts
        raise ConfigError(f"{where}: an integer with more digits than a config may hold") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a JSON object at the top level, got {_json_type(doc)}")
    _check_values(doc, where)
    return doc


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _check_values(doc: dict, where: str) -> None:
    """Depth and integer range of a parsed document (iteratively: no recursion to exhaust)."""
    stack: list[tuple[Any, int, str]] = [(doc, 1, "")]
    while stack:
        value, depth, at = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > CONFIG_MAX_DEPTH:
                raise ConfigError(f"{where}: nested deeper than {CONFIG_MAX_DEPTH} levels (at {at or 'the top'})")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack += [(v, depth + 1, f"{at}.{k}" if at else str(k)) for k, v in items]
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _MAX_JSON_INT:
            raise ConfigError(f"{where}: {at}: {value} is out of range (integers must be below 2**53)")


def from_dict(cls, d: Mapping[str, Any], name: str | None = None):
    """A `cls` (ModelConfig) from any supported spelling. Unknown keys are ignored;
    `compress_ratios` entries past num_layers (draft layers) are dropped. Whatever the
    document holds, the outcome is a `cls` or ConfigError: a value of a type the reading
    does not expect (a number where a list belongs, ...) is reported as such, not as the
    TypeError it would raise."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"a config is a JSON object (a mapping), got {_json_type(d)}")
    try:
        return _from_dict(cls, d, name)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
        raise ConfigError(f"malformed config: {type(e).__name__}: {e}") from None


def _from_dict(cls, d: Mapping[str, Any], name: str | None):
    src = dict(d)
    if isinstance(src.get("text_config"), Mapping):
        src.update(src.pop("text_config"))
    v4_family = "layer_types" in src or src.get("model_type") == V4_MODEL_TYPE
    rates = _read_transformers_v4(src)
    if v4_family:
        _read_v4_semantics(src)
    if "max_position_embeddings" not in src and "max_seq_len" not in src and "dim" in src:
        src["max_seq_len"] = DEEPSEEK_MAX_SEQ_LEN  # DeepSeek's flat spelling
    _fill_v4_machinery(src, rates, v4_family)
    kwargs: dict[str, Any] = {}
    defaults = {f.name for f in fields(cls) if f.default is not dataclasses.MISSING}
    for f in fields(cls):
        if f.name in ("name", "rope_scaling"):
            continue
        key = next((k for k in _KEYS[f.name] if k in src), None)
        if key is not None:
            kwargs[f.name] = src[key]
        elif f.name not in defaults:
            spellings = " / ".join(repr(k) for k in _KEYS[f.name])
            raise ConfigError(f"missing required key {spellings} for field {f.name}")
    kwargs["name"] = name or next(
        (str(src[k]) for k in ("name", "_name_or_path", "model_type") if src.get(k)),
        "custom")
    kwargs["rope_scaling"] = _read_rope_scaling(src)
    ratios = kwargs["compress_ratios"]
    n = as_int("num_layers", kwargs["num_layers"])
    if not isinstance(ratios, (list, tuple)) or len(ratios) < n:
        count = len(ratios) if isinstance(ratios, (list, tuple)) else ratios
        raise ConfigError(f"compress_ratios has {count} entries, fewer than "
                          f"num_layers={n}")
    kwargs["compress_ratios"] = tuple(ratios[:n])
    return cls(**kwargs)


def _read_transformers_v4(src: dict[str, Any]) -> tuple[int, int] | None:
    """Rewrite transformers' DeepseekV4Config keys into the keys `_KEYS` reads; returns
    its (CSA, HCA) compression rates when the file spells its layers as `layer_types`."""
    rates = None
    if "layer_types" in src:
        given = dict(src.get("compress_rates") or {})
        for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if src.get(key) is not None:          # transformers' legacy spelling
                given[kind] = src[key]
        rates = (as_int(f"compress_rates.{CSA}", given.get(CSA, V4_RATIOS[0])),
                 as_int(f"compress_rates.{HCA}", given.get(HCA, V4_RATIOS[1])))
        if rates[0] == rates[1]:
            raise ConfigError(f"compress_rates: CSA and HCA layers both compress by "
                              f"{rates[0]}; dsv41 tells a layer's kind (indexed with "
                              f"overlapping windows, or dense) by its ratio, so the rates "
                              f"must differ")
        bad = [t for t in src["layer_types"] if t not in V4_LAYER_TYPES]
        if bad:
            raise ConfigError(f"layer_types: unknown layer type(s) {sorted(set(bad))} "
                              f"(known: {list(V4_LAYER_TYPES)})")
        if "compress_ratios" not in src:
            ratio_of = dict(zip(V4_LAYER_TYPES, (0,) + rates))
            src["compress_ratios"] = [ratio_of[t] for t in src["layer_types"]]
    if "mlp_layer_types" in src and "num_hash_layers" not in src:
        kinds = list(src["mlp_layer_types"])
        bad = sorted({k for k in kinds if k not in ("hash_moe", "moe")})
        if bad:
            raise ConfigError(f"mlp_layer_types: unknown layer type(s) {bad} (known: "
                              f"['hash_moe', 'moe'])")
        n_hash = next((i for i, k in enumerate(kinds) if k != "hash_moe"), len(kinds))
        late = [i for i, k in enumerate(kinds) if k == "hash_moe" and i > n_hash]
        if late:
            raise ConfigError(f"mlp_layer_types: layer {late[0]} routes by token id "
                              f"(hash_moe) after layer {n_hash}, which routes by score; "
                              f"dsv41, like DeepSeek's reference (Gate.hash = layer_id < "
                              f"n_hash_layers), routes by token id exactly the first "
                              f"num_hash_layers layers")
        src["num_hash_layers"] = n_hash
    if "partial_rotary_factor" in src and "head_dim" in src and (
            "layer_types" in src or ("qk_rope_head_dim" not in src
                                     and "rope_head_dim" not in src)):
        # transformers' own rule (DeepseekV4Config.__post_init__, the rotary's dim):
        # truncation, not rounding; its rotary reads partial_rotary_factor, whatever
        # qk_rope_head_dim the file also holds
        factor = float(src["partial_rotary_factor"])
        dims = int(src["head_dim"] * factor)
        if dims % 2:
            raise ConfigError(f"partial_rotary_factor={factor!r}: transformers derives "
                              f"int(head_dim * partial_rotary_factor) = {dims} RoPE dims, an "
                              f"odd count (it then rotates {dims + 1} dims at the frequencies "
                              f"of {dims}); dsv41 rotates pairs of dims at their own "
                              f"frequencies and cannot run that")
        src["qk_rope_head_dim"] = dims
    rp = src.get("rope_parameters")
    if isinstance(rp, Mapping) and isinstance(rp.get("main"), Mapping):
        main, compress = rp["main"], rp.get("compress") or {}
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise ConfigError(f"rope_parameters.main: rope_type "
                              f"{main.get('rope_type', main.get('type'))!r}; dsv41, like "
                              f"DeepSeek's reference, scales RoPE (YaRN) only in the "
                              f"compressing layers, never in the SWA-only ones")
        src.setdefault("rope_theta", main.get("rope_theta"))
        if "rope_theta" in compress:
            src["compress_rope_theta"] = compress["rope_theta"]
        kind = compress.get("rope_type", compress.get("type", "default"))
        src["rope_parameters"] = dict(compress) if kind != "default" else {"rope_type": "default"}
    return rates


def _read_v4_semantics(src: dict[str, Any]) -> None:
    """A DeepSeek-V4 file means what transformers' DeepseekV4 and DeepSeek's reference
    build from it; where that is not what dsv41's own reading of a key would be, say so."""
    if src.get("hc_mult") == 1:
        raise ConfigError("hc_mult=1: transformers' DeepseekV4 and DeepSeek's reference "
                          "still run one mHC stream with weights (hc_attn_*, hc_ffn_*, "
                          "hc_head_*: pre = sigmoid + hc_eps, post = 2 sigmoid, a 1x1 "
                          "Sinkhorn comb), which is not the plain residual dsv41 runs at "
                          "hc_mult=1; dsv41 models mHC with hc_mult >= 2")
    if "layer_types" in src and "swiglu_limit" in src and src["swiglu_limit"] <= 0:
        raise ConfigError(f"swiglu_limit={src['swiglu_limit']}: transformers' DeepseekV4 "
                          f"clamps the experts' activations to it (all-zero experts), "
                          f"DeepSeek's reference and dsv41 read it as no clamp")
    # transformers builds one shared expert of moe_intermediate_size whatever
    # n_shared_experts says, and DeepSeek's V4 reference asserts n_shared_experts == 1;
    # dsv41's n_shared_experts fuses that many (DeepSeek-V3's rule), so the model is 1.
    if src.get("n_shared_experts") is not None:
        src["n_shared_experts"] = 1


def _fill_v4_machinery(src: dict[str, Any], rates: tuple[int, int] | None,
                       v4_family: bool) -> None:
    """V4 configs name no KV/index sources and none of dsv41's V4 switches: fill them in as
    V4 defines them, keeping what the file says. A config is V4's when it is in
    transformers' or DeepSeek's V4 spelling, or when its ratios are V4's (4 and 128)."""
    ratios = src.get("compress_ratios")
    n = src.get("num_hidden_layers", src.get("n_layers", src.get("num_layers")))
    if not isinstance(ratios, (list, tuple)) or not isinstance(n, int):
        return
    ratios = list(ratios[:n])
    nonzero = {r for r in ratios if r}
    if rates is not None:                 # transformers: the rates say which layer is which
        csa, dense = rates[0], [rates[1]]
    elif v4_family or (nonzero and nonzero <= set(V4_RATIOS)):
        # DeepSeek's reference: ratio 4 is CSA (indexer, overlap), every other ratio dense
        csa = V4_RATIOS[0]
        dense = sorted(nonzero - {csa}) or [V4_RATIOS[1]]
    else:
        return
    defaults = {
        "kv_source_layer_ids": [i for i, r in enumerate(ratios) if r],
        "index_source_layer_ids": [i for i, r in enumerate(ratios) if r == csa],
        "candidate_source_layer_id": None, "candidate_topk_blocks": 0,
        "candidate_block_size": 0, "encoder_decoder": False, "main_kv_format": "fp8_v4",
        "dense_compress_ratios": dense, "overlap_compress_ratios": [csa],
        "compressor_ape": True, "indexer_compressor": True,
        "persistent_swa": True, "persistent_swa_interval_tokens": 1024,
        # transformers' and DeepSeek's V4 defaults when the file omits them
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    }
    for field_name, value in defaults.items():
        if not any(k in src for k in _KEYS[field_name]):
            src[field_name] = value


def _read_rope_scaling(src: Mapping[str, Any]) -> dict[str, Any] | None:
    """YaRN from a nested HF dict (`rope_scaling`, or `rope_parameters` in newer
    transformers) or from the flat reference keys rope_factor / original_seq_len
    (original_seq_len 0 means no YaRN, as in DeepSeek's ModelArgs)."""
    for key in ("rope_scaling", "rope_parameters"):
        if key in src:
            rs = src[key]
            if isinstance(rs, Mapping) and rs.get("rope_type", rs.get("type")) == "default":
                return None  # transformers' spelling of "no scaling"
            return rs
    if "rope_factor" not in src:
        return None
    if "original_seq_len" not in src:
        raise ConfigError("missing required key 'original_seq_len' (flat YaRN spelling, "
                          "needed with 'rope_factor')")
    if not src["original_seq_len"]:
        return None
    return {"factor": src["rope_factor"],
            "original_max_position_embeddings": src["original_seq_len"],
            "beta_fast": src.get("beta_fast", DEFAULT_BETA_FAST),
            "beta_slow": src.get("beta_slow", DEFAULT_BETA_SLOW)}
