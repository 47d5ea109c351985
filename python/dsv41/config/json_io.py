"""The JSON spellings a `ModelConfig` is read from and written as (docs/config.md).

Read: (1) dsv41's own / the Hugging Face V4.1 spelling (text model nested under
`text_config` or at top level); (2) transformers' `DeepseekV4Config.save_pretrained`
(`layer_types` + `compress_rates`, `mlp_layer_types`, `partial_rotary_factor`, nested
`rope_parameters` {"main", "compress"}); (3) DeepSeek's flat inference `config.json`
(`dim`, `n_layers`, `window_size`, `rope_factor`, ..., as its `ModelArgs` reads it); and
`to_dict()` output. Written: (1).

A config whose compression ratios are V4's (4 and 128 only) gets V4's machinery
(`fp8_v4` KV, HCA dense, overlapping CSA windows, `ape`, the indexer's own compressor,
every compressing layer its own KV source) unless the file says otherwise.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from ..argcheck import read_regular_file
from .values import DEFAULT_BETA_FAST, DEFAULT_BETA_SLOW, ConfigError, as_int

if TYPE_CHECKING:
    from .model import ModelConfig

__all__ = ["CONFIG_MAX_BYTES", "CONFIG_MAX_DEPTH", "DEEPSEEK_MAX_SEQ_LEN", "from_dict", "read_config_file",
           "to_hf_dict"]

# What a config file may be, checked where it is read (read_config_file): model configs are
# a few KB, a few levels deep, with integers far below 2**53 (beyond it JSON numbers are not
# exact in most readers). Anything else is refused before a field is looked at.
CONFIG_MAX_BYTES = 4 << 20
CONFIG_MAX_DEPTH = 32
_MAX_JSON_INT = 2**53

# DeepSeek's inference ModelArgs default for max_seq_len (its flat config.json omits it).
DEEPSEEK_MAX_SEQ_LEN = 4096

# transformers' DeepseekV4Config layer types and their compression ratios.
V4_LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4,
                  "heavily_compressed_attention": 128}
V4_RATIOS = (4, 128)

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


def to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
    flat = cfg.to_dict()
    text: dict[str, Any] = {}
    for f in fields(cfg):
        if f.name in ("name", "rope_scaling"):
            continue
        text[_KEYS[f.name][0]] = flat[f.name]
    if cfg.rope_scaling is not None:
        text["rope_scaling"] = {"type": "yarn", **cfg.rope_scaling}
    else:
        text["rope_scaling"] = None
    return {"name": cfg.name, "text_config": text}


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in a config file, or ConfigError: not a regular file (a FIFO or
    /dev/zero would block or never end), over CONFIG_MAX_BYTES, not UTF-8, not JSON, NaN or
    Infinity, nested deeper than CONFIG_MAX_DEPTH, an integer of 2**53 or more, or not an
    object at the top level. OSError when it cannot be opened (missing, permissions)."""
    where = os.fspath(path)
    try:
        raw = read_regular_file(path, CONFIG_MAX_BYTES)
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


def from_dict(cls, d: Mapping[str, Any], name: str | None = None) -> ModelConfig:
    """Unknown keys are ignored; `compress_ratios` entries past num_layers (draft layers)
    are dropped. Whatever the document holds, the outcome is a ModelConfig or ConfigError:
    a value of a type the reading does not expect (a number where a list belongs, ...)
    is reported as such, not as the TypeError it would raise."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"a config is a JSON object (a mapping), got {_json_type(d)}")
    try:
        return _from_dict(cls, d, name)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
        raise ConfigError(f"malformed config: {type(e).__name__}: {e}") from None


def _from_dict(cls, d: Mapping[str, Any], name: str | None) -> ModelConfig:
    src = dict(d)
    if isinstance(src.get("text_config"), Mapping):
        src.update(src.pop("text_config"))
    _read_transformers_v4(src)
    if "max_position_embeddings" not in src and "max_seq_len" not in src and "dim" in src:
        src["max_seq_len"] = DEEPSEEK_MAX_SEQ_LEN  # DeepSeek's flat spelling
    _fill_v4_machinery(src)
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


def _read_transformers_v4(src: dict[str, Any]) -> None:
    """Rewrite transformers' DeepseekV4Config keys into the keys `_KEYS` reads."""
    if "layer_types" in src and "compress_ratios" not in src:
        rates = dict(src.get("compress_rates") or {})
        ratio_of = {**V4_LAYER_TYPES, **{k: int(v) for k, v in rates.items()}}
        bad = [t for t in src["layer_types"] if t not in ratio_of]
        if bad:
            raise ConfigError(f"layer_types: unknown layer type(s) {sorted(set(bad))} "
                              f"(known: {sorted(ratio_of)})")
        src["compress_ratios"] = [ratio_of[t] for t in src["layer_types"]]
    if "mlp_layer_types" in src and "num_hash_layers" not in src:
        kinds = list(src["mlp_layer_types"])
        n_hash = next((i for i, k in enumerate(kinds) if k != "hash_moe"), len(kinds))
        if any(k == "hash_moe" for k in kinds[n_hash:]) or any(
                k not in ("hash_moe", "moe") for k in kinds):
            raise ConfigError(f"mlp_layer_types: dsv41 supports hash_moe layers only as a "
                              f"prefix followed by moe layers, got {kinds}")
        src["num_hash_layers"] = n_hash
    if "qk_rope_head_dim" not in src and "rope_head_dim" not in src \
            and "partial_rotary_factor" in src and "head_dim" in src:
        src["qk_rope_head_dim"] = round(float(src["partial_rotary_factor"]) * src["head_dim"])
    rp = src.get("rope_parameters")
    if isinstance(rp, Mapping) and isinstance(rp.get("main"), Mapping):
        main, compress = rp["main"], rp.get("compress") or {}
        src.setdefault("rope_theta", main.get("rope_theta"))
        if "rope_theta" in compress:
            src["compress_rope_theta"] = compress["rope_theta"]
        kind = compress.get("rope_type", compress.get("type", "default"))
        src["rope_parameters"] = dict(compress) if kind != "default" else {"rope_type": "default"}


def _fill_v4_machinery(src: dict[str, Any]) -> None:
    """V4 configs (every nonzero ratio 4 or 128) name no KV/index sources and none of
    dsv41's V4 switches: fill them in as V4 defines them, keeping what the file says."""
    ratios = src.get("compress_ratios")
    n = src.get("num_hidden_layers", src.get("n_layers", src.get("num_layers")))
    if not isinstance(ratios, (list, tuple)) or not isinstance(n, int):
        return
    ratios = list(ratios[:n])
    nonzero = {r for r in ratios if r}
    if not nonzero or not nonzero <= set(V4_RATIOS):
        return
    csa, hca = V4_RATIOS
    defaults = {
        "kv_source_layer_ids": [i for i, r in enumerate(ratios) if r],
        "index_source_layer_ids": [i for i, r in enumerate(ratios) if r == csa],
        "candidate_source_layer_id": None, "candidate_topk_blocks": 0,
        "candidate_block_size": 0, "encoder_decoder": False, "main_kv_format": "fp8_v4",
        "dense_compress_ratios": [hca], "overlap_compress_ratios": [csa],
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
