"""Model configuration: the architecture fields, the per-layer plan, presets and JSON I/O.

A `ModelConfig` is validated once, at construction, so every other part of dsv41 (model,
cache manager, budget, replay) can trust its layer plan. The rules are those of SPEC
section 2; docs/config.md lists every field, the JSON key mapping and the validation rules.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from .formats import layout

__all__ = [
    "ConfigError",
    "LayerPlan",
    "ModelConfig",
    "PRESETS",
    "preset_names",
    "SUPPORTED_RATIOS",
    "MAIN_KV_FORMATS",
]


class ConfigError(ValueError):
    """An invalid or incomplete model configuration."""


# Compression ratios each main-KV format can serve. NVFP4 is the V4.1 format (ratios 1 and
# 2 only); fp8_v4 exists only to account DeepSeek-V4-Flash's bytes (CSA 4, HCA 128).
SUPPORTED_RATIOS: dict[str, tuple[int, ...]] = {"nvfp4": (0, 1, 2), "fp8_v4": (0, 4, 128)}
MAIN_KV_FORMATS = tuple(SUPPORTED_RATIOS)
SCORING_FUNCS = ("sqrtsoftplus",)

# Assumed YaRN betas when a config gives only factor and original length (the DeepSeek-V3
# defaults; the V4.1 release does not state them).
DEFAULT_BETA_FAST = 32.0
DEFAULT_BETA_SLOW = 1.0

PART_ENCODER = "encoder"
PART_DECODER = "decoder"
PART_LAYER = "layer"  # every layer of a model without the causal encoder-decoder split

MODE_SWA_ONLY = "swa-only"
MODE_FULL = "full"
MODE_REINDEX = "reindex"
MODE_REUSE = "reuse"


@dataclass(frozen=True)
class LayerPlan:
    """What one layer computes and which layers' state it reads.

    `index_source` is the layer whose top-k this layer uses; `index_key_source` the layer
    that owns the indexer keys that top-k was scored against (always the KV source).
    `dense` layers (V4's HCA) attend to every compressed entry and have no indexer.
    """

    layer: int
    part: str
    mode: str
    compress_ratio: int
    kv_source: int | None
    index_source: int | None
    index_key_source: int | None
    owns_kv: bool
    owns_indexer_keys: bool
    owns_index_query: bool
    dense: bool


@dataclass(frozen=True)
class ModelConfig:
    """One text model. Layer counts exclude the draft (MTP) layers.

    Fields without a default are required in JSON. Types are normalised at construction
    (lists -> tuples, ints -> floats for float fields) so that equality and `fingerprint()`
    do not depend on how a JSON file spelled a number.
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float            # SWA-only layers
    compress_rope_theta: float   # compressing layers (with YaRN when rope_scaling is set)
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # Hierarchical candidates of the decoder; None for models without them (V4), in which
    # case candidate_topk_blocks and candidate_block_size are not used.
    candidate_source_layer_id: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    max_position_embeddings: int
    num_kv_heads: int = 1
    # YaRN: {factor, original_max_position_embeddings, beta_fast, beta_slow} or None.
    rope_scaling: dict[str, Any] | None = None
    num_nextn_predict_layers: int = 0
    encoder_decoder: bool = True
    # None -> num_layers // 2 for encoder-decoder models, 0 otherwise (resolved at init).
    num_encoder_layers: int | None = None
    main_kv_format: str = "nvfp4"
    # Ratios whose layers attend to all compressed entries without an indexer (V4 HCA: 128).
    dense_compress_ratios: tuple[int, ...] = ()
    # V4 persisted SWA state too: the whole window of every layer, once per interval.
    persistent_swa: bool = False
    persistent_swa_interval_tokens: int = 0

    def __post_init__(self) -> None:
        self._normalise()
        self._check_scalars()
        self._check_format_dims()
        self._check_layer_lists()
        plan = self._build_plan()
        object.__setattr__(self, "_plan", tuple(plan))
        if self.encoder_decoder:
            self._check_split(plan)
        self._check_candidates(plan)

    def __hash__(self) -> int:  # rope_scaling is a dict, so hash the canonical form
        return hash(self.fingerprint())

    # ---- normalisation and validation -------------------------------------------------

    def _normalise(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float":
                value = _as_float(f.name, value)
            elif f.type == "int" or (f.type == "int | None" and value is not None):
                value = _as_int(f.name, value)
            elif f.type == "bool" and not isinstance(value, bool):
                raise ConfigError(f"{f.name}: expected a bool, got {value!r}")
            elif f.type == "str" and not isinstance(value, str):
                raise ConfigError(f"{f.name}: expected a string, got {value!r}")
            elif f.type == "tuple[int, ...]":
                if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                    raise ConfigError(f"{f.name}: expected a list of ints, got {value!r}")
                value = tuple(_as_int(f.name, v) for v in value)
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "rope_scaling", _normalise_rope_scaling(self.rope_scaling))
        if self.num_encoder_layers is None:
            default = self.num_layers // 2 if self.encoder_decoder else 0
            object.__setattr__(self, "num_encoder_layers", default)

    def _check_scalars(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim",
                    "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                    "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.n_shared_experts < 0 or self.num_nextn_predict_layers < 0:
            raise ConfigError("n_shared_experts and num_nextn_predict_layers must be >= 0")
        if self.num_kv_heads != 1:
            raise ConfigError(f"num_kv_heads must be 1 (MQA; one KV entry per token), "
                              f"got {self.num_kv_heads}")
        if self.num_heads % self.o_groups:
            raise ConfigError(f"num_heads={self.num_heads} is not divisible by "
                              f"o_groups={self.o_groups}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                              f"n_routed_experts={self.n_routed_experts}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func {self.scoring_func!r} not supported "
                              f"(supported: {SCORING_FUNCS})")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0 or self.compress_rope_theta <= 0:
            raise ConfigError("rms_norm_eps, rope_theta and compress_rope_theta must be > 0")
        if self.persistent_swa != (self.persistent_swa_interval_tokens > 0):
            raise ConfigError("persistent_swa needs persistent_swa_interval_tokens > 0, and "
                              "persistent_swa_interval_tokens is only valid with persistent_swa")
        if not self.encoder_decoder and self.num_encoder_layers != 0:
            raise ConfigError("num_encoder_layers must be 0 when encoder_decoder is False")

    def _check_format_dims(self) -> None:
        if self.main_kv_format not in SUPPORTED_RATIOS:
            raise ConfigError(f"main_kv_format {self.main_kv_format!r} unknown "
                              f"(known: {MAIN_KV_FORMATS})")
        if self.rope_head_dim % 2 or self.rope_head_dim >= self.head_dim:
            raise ConfigError(f"rope_head_dim={self.rope_head_dim} must be even and smaller "
                              f"than head_dim={self.head_dim}")
        # The byte-size functions reject dims that are not whole format blocks; reuse them so
        # the rule lives in one place.
        checks = [("index_head_dim", lambda: layout.mxfp4_bytes(self.index_head_dim))]
        if self.main_kv_format == "nvfp4":
            checks += [("head_dim", lambda: layout.nvfp4_bytes(self.head_dim)),
                       ("head_dim", lambda: layout.fp8_swa_bytes(self.head_dim))]
        else:
            checks += [("head_dim", lambda: layout.fp8_v4_main_bytes(self.nope_head_dim,
                                                                     self.rope_head_dim))]
        for name, check in checks:
            try:
                check()
            except ValueError as exc:
                raise ConfigError(f"{name}={getattr(self, name)} does not fit the "
                                  f"{self.main_kv_format} cache formats: {exc}") from None

    def _check_layer_lists(self) -> None:
        n = self.num_layers
        if len(self.compress_ratios) != n:
            raise ConfigError(f"compress_ratios has {len(self.compress_ratios)} entries, "
                              f"expected num_layers={n}")
        allowed = SUPPORTED_RATIOS[self.main_kv_format]
        for layer, ratio in enumerate(self.compress_ratios):
            if ratio not in allowed:
                raise ConfigError(f"layer {layer}: compress ratio {ratio} not supported by "
                                  f"{self.main_kv_format} (supported: {allowed})")
        for ratio in self.dense_compress_ratios:
            if ratio == 0 or ratio not in allowed:
                raise ConfigError(f"dense_compress_ratios: {ratio} is not a supported "
                                  f"nonzero ratio for {self.main_kv_format}")
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = getattr(self, name)
            if list(ids) != sorted(set(ids)):
                raise ConfigError(f"{name} must be sorted and unique, got {list(ids)}")
            for layer in ids:
                if not 0 <= layer < n:
                    raise ConfigError(f"{name}: layer {layer} out of range [0, {n})")
                if self.compress_ratios[layer] == 0:
                    raise ConfigError(f"{name}: layer {layer} has compress ratio 0 "
                                      f"(SWA-only layers own no global KV or indexer)")
        for layer in self.index_source_layer_ids:
            if self.compress_ratios[layer] in self.dense_compress_ratios:
                raise ConfigError(f"index_source_layer_ids: layer {layer} has dense ratio "
                                  f"{self.compress_ratios[layer]}, which has no indexer")
        for layer in self.kv_source_layer_ids:
            dense = self.compress_ratios[layer] in self.dense_compress_ratios
            if not dense and layer not in self.index_source_layer_ids:
                raise ConfigError(f"layer {layer}: KV source owns no indexer (not in "
                                  f"index_source_layer_ids); its indexer keys would be missing")

    def _build_plan(self) -> list[LayerPlan]:
        kv_ids, index_ids = set(self.kv_source_layer_ids), set(self.index_source_layer_ids)
        plan = []
        for layer, ratio in enumerate(self.compress_ratios):
            dense = ratio in self.dense_compress_ratios
            kv_source = index_source = None
            if ratio:
                kv_source = _latest_same_ratio(self.compress_ratios, kv_ids, layer)
                if kv_source is None:
                    raise ConfigError(f"layer {layer}: compress ratio {ratio} but no KV source "
                                      f"at or before it with the same ratio")
                if not dense:
                    # Every non-dense KV source is an index source, so this finds one at or
                    # after kv_source: top-k and indexer keys always share the KV source.
                    index_source = _latest_same_ratio(self.compress_ratios, index_ids, layer)
            if ratio == 0:
                mode = MODE_SWA_ONLY
            elif layer in kv_ids:
                mode = MODE_FULL
            elif layer in index_ids:
                mode = MODE_REINDEX
            else:
                mode = MODE_REUSE
            plan.append(LayerPlan(
                layer=layer,
                part=self._part(layer),
                mode=mode,
                compress_ratio=ratio,
                kv_source=kv_source,
                index_source=index_source,
                index_key_source=None if index_source is None else kv_source,
                owns_kv=mode == MODE_FULL,
                owns_indexer_keys=mode == MODE_FULL and not dense,
                owns_index_query=mode in (MODE_FULL, MODE_REINDEX) and not dense,
                dense=dense,
            ))
        return plan

    def _part(self, layer: int) -> str:
        if not self.encoder_decoder:
            return PART_LAYER
        return PART_ENCODER if layer < self.num_encoder_layers else PART_DECODER

    def _check_candidates(self, plan: list[LayerPlan]) -> None:
        src = self.candidate_source_layer_id
        if src is None:
            return
        if not 0 <= src < self.num_layers or plan[src].mode != MODE_FULL or plan[src].dense:
            raise ConfigError(f"candidate_source_layer_id={src} must be a Full layer (a KV "
                              f"source with its own indexer)")
        if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
            raise ConfigError("candidate_topk_blocks and candidate_block_size must be positive")
        if self.candidate_topk_blocks * self.candidate_block_size < self.index_topk:
            raise ConfigError(f"candidate_topk_blocks x candidate_block_size = "
                              f"{self.candidate_topk_blocks * self.candidate_block_size} "
                              f"candidates is fewer than index_topk={self.index_topk}")
        ratio = self.compress_ratios[src]
        for p in plan:
            # Reindex layers score only the candidate source's candidates.
            if p.mode == MODE_REINDEX and (p.layer < src or p.compress_ratio != ratio):
                raise ConfigError(f"layer {p.layer}: Reindex layer must come after the "
                                  f"candidate source layer {src} and share its ratio {ratio}")

    def _check_split(self, plan: list[LayerPlan]) -> None:
        split = self.num_encoder_layers
        if not 0 < split < self.num_layers:
            raise ConfigError(f"num_encoder_layers={split} must leave a non-empty encoder and "
                              f"decoder out of num_layers={self.num_layers}")
        first = plan[split]
        if first.mode != MODE_FULL or split != self.candidate_source_layer_id:
            raise ConfigError(f"first decoder layer {split} must be a Full KV source and equal "
                              f"candidate_source_layer_id={self.candidate_source_layer_id} "
                              f"(got mode {first.mode!r})")
        for p in plan:
            if p.part == PART_ENCODER and p.mode == MODE_REINDEX:
                raise ConfigError(f"layer {p.layer}: Reindex layer in the encoder (an index "
                                  f"source that is not a KV source is decoder-only)")
            if p.part == PART_DECODER and p.mode == MODE_SWA_ONLY:
                raise ConfigError(f"layer {p.layer}: SWA-only layer in the decoder")
            if p.part == PART_DECODER and p.kv_source is not None and p.kv_source < split:
                raise ConfigError(f"layer {p.layer}: decoder layer reads encoder KV source "
                                  f"{p.kv_source} (decoder global KV must come from the "
                                  f"decoder's Full layer)")

    # ---- derived views ----------------------------------------------------------------

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def encoder_layers(self) -> range:
        """Encoder layer ids; empty for models without the encoder-decoder split."""
        return range(self.num_encoder_layers)

    @property
    def decoder_layers(self) -> range:
        """Decoder layer ids; empty for models without the encoder-decoder split."""
        if not self.encoder_decoder:
            return range(0)
        return range(self.num_encoder_layers, self.num_layers)

    def layer_plan(self) -> list[LayerPlan]:
        return list(self._plan)  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, Any]:
        """Flat dict of every field (python names, JSON-serialisable)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else (
                dict(value) if isinstance(value, dict) else value)
        return out

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of all fields: a stable model key for cache hashes."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- JSON -------------------------------------------------------------------------

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face spelling: text model under `text_config`, dsv41 extras beside."""
        flat = self.to_dict()
        text: dict[str, Any] = {}
        for f in fields(self):
            if f.name in ("name", "rope_scaling"):
                continue
            text[_KEYS[f.name][0]] = flat[f.name]
        if self.rope_scaling is not None:
            text["rope_scaling"] = {"type": "yarn", **self.rope_scaling}
        else:
            text["rope_scaling"] = None
        return {"name": self.name, "text_config": text}

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path, name: str | None = None) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()), name=name)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str | None = None) -> "ModelConfig":
        """Read the HF spelling (nested `text_config` or top level), the flat reference
        `inference/config.json` spelling, or `to_dict()` output. Unknown keys are ignored;
        `compress_ratios` entries past num_layers (draft layers) are dropped."""
        src = dict(d)
        if isinstance(src.get("text_config"), Mapping):
            src.update(src.pop("text_config"))
        kwargs: dict[str, Any] = {}
        defaults = {f.name for f in fields(cls)
                    if f.default is not dataclasses.MISSING}
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
        n = _as_int("num_layers", kwargs["num_layers"])
        if not isinstance(ratios, (list, tuple)) or len(ratios) < n:
            count = len(ratios) if isinstance(ratios, (list, tuple)) else ratios
            raise ConfigError(f"compress_ratios has {count} entries, fewer than "
                              f"num_layers={n}")
        kwargs["compress_ratios"] = tuple(ratios[:n])
        return cls(**kwargs)

    # ---- presets ----------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        try:
            return PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r} (known: {preset_names()})") from None


# Accepted JSON keys per field, in lookup order: HF spelling first (what to_json writes),
# then the flat reference spelling, then any other spelling seen in released configs.
# The python field name is always accepted last so that from_dict(to_dict()) works.
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


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"{name}: expected an integer, got {value!r}")


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    return float(value)


def _normalise_rope_scaling(rs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if rs is None:
        return None
    if not isinstance(rs, Mapping):
        raise ConfigError(f"rope_scaling: expected a dict or None, got {rs!r}")
    kind = rs.get("type", rs.get("rope_type", "yarn"))
    if kind != "yarn":
        raise ConfigError(f"rope_scaling: only YaRN is supported, got type {kind!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in rs:
            raise ConfigError(f"rope_scaling: missing required key {key!r}")
    out = {
        "factor": _as_float("rope_scaling.factor", rs["factor"]),
        "original_max_position_embeddings": _as_int(
            "rope_scaling.original_max_position_embeddings",
            rs["original_max_position_embeddings"]),
        "beta_fast": _as_float("rope_scaling.beta_fast", rs.get("beta_fast", DEFAULT_BETA_FAST)),
        "beta_slow": _as_float("rope_scaling.beta_slow", rs.get("beta_slow", DEFAULT_BETA_SLOW)),
    }
    if out["factor"] < 1 or out["original_max_position_embeddings"] <= 0:
        raise ConfigError(f"rope_scaling: factor must be >= 1 and the original length "
                          f"positive, got {out}")
    return out


def _read_rope_scaling(src: Mapping[str, Any]) -> dict[str, Any] | None:
    """YaRN from a nested HF dict (`rope_scaling`, or `rope_parameters` in newer
    transformers) or from the flat reference keys rope_factor / original_seq_len."""
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
    return {"factor": src["rope_factor"],
            "original_max_position_embeddings": src["original_seq_len"],
            "beta_fast": src.get("beta_fast", DEFAULT_BETA_FAST),
            "beta_slow": src.get("beta_slow", DEFAULT_BETA_SLOW)}


def _latest_same_ratio(ratios: tuple[int, ...], sources: set[int], layer: int) -> int | None:
    return next((s for s in range(layer, -1, -1)
                 if s in sources and ratios[s] == ratios[layer]), None)


# ---- presets ------------------------------------------------------------------------------

def _v41_flash() -> ModelConfig:
    return ModelConfig(
        name="v41-flash",
        vocab_size=129280,
        hidden_size=5120,
        num_layers=40,
        num_heads=64,
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=1280,
        o_groups=8,
        o_lora_rank=1024,
        moe_intermediate_size=2304,
        n_routed_experts=384,
        n_shared_experts=1,
        num_experts_per_tok=6,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        rms_norm_eps=1e-20,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        sliding_window=128,
        # The public list has 43 entries; the last 3 are the draft layers.
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
        kv_source_layer_ids=(2, 8, 14, 20),
        index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
        index_n_heads=32,
        index_head_dim=128,
        index_topk=512,
        candidate_source_layer_id=20,
        candidate_topk_blocks=2048,
        candidate_block_size=8,
        max_position_embeddings=1048576,
        rope_scaling={"factor": 16.0, "original_max_position_embeddings": 65536,
                      "beta_fast": DEFAULT_BETA_FAST, "beta_slow": DEFAULT_BETA_SLOW},
        num_nextn_predict_layers=3,
    )


def _v4_flash() -> ModelConfig:
    """DeepSeek-V4-Flash, only for byte accounting against V4.1 (never run).

    Assumed: CSA (ratio 4) and HCA (ratio 128) interleave from layer 2 starting with CSA;
    the order does not change any byte count. Each CSA layer is its own KV and index
    source, each HCA layer its own KV source without an indexer. V4's SWA entries use its
    584-byte main-KV entry, and its persistent cache checkpointed the SWA state of every
    layer once per 1024 tokens (the release only says SWA was about half of it).
    """
    ratios = (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(41))
    sources = tuple(i for i, r in enumerate(ratios) if r)
    return ModelConfig(
        name="v4-flash",
        vocab_size=129280,
        hidden_size=4096,
        num_layers=43,
        num_heads=64,
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=6,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        sliding_window=128,
        compress_ratios=ratios,
        kv_source_layer_ids=sources,
        index_source_layer_ids=tuple(i for i in sources if ratios[i] == 4),
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        candidate_source_layer_id=None,
        candidate_topk_blocks=0,
        candidate_block_size=0,
        max_position_embeddings=1048576,
        rope_scaling={"factor": 16.0, "original_max_position_embeddings": 65536,
                      "beta_fast": DEFAULT_BETA_FAST, "beta_slow": DEFAULT_BETA_SLOW},
        num_nextn_predict_layers=1,
        encoder_decoder=False,
        main_kv_format="fp8_v4",
        dense_compress_ratios=(128,),
        persistent_swa=True,
        persistent_swa_interval_tokens=1024,
    )


def _v41_scaled(name: str, **dims: Any) -> ModelConfig:
    """A scaled-down V4.1-Flash: Flash's constants (routing, clamps, eps, RoPE thetas,
    candidate block size) with smaller dims and layer plan, and no draft layers."""
    return dataclasses.replace(_v41_flash(), name=name, num_nextn_predict_layers=0,
                               num_encoder_layers=None, **dims)


def _v41_tiny() -> ModelConfig:
    """Unit tests: a full forward on CPU in milliseconds, same layer-plan shape as Flash.
    encoder [0 swa, 1 swa, 2 full r2, 3 reuse r2], decoder [4 full, 5 reuse, 6 reindex,
    7 reuse] at ratio 1."""
    return _v41_scaled(
        "v41-tiny", vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, head_dim=64,
        rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, sliding_window=16,
        compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(2, 4),
        index_source_layer_ids=(2, 4, 6), index_n_heads=2, index_head_dim=32, index_topk=8,
        candidate_source_layer_id=4, candidate_topk_blocks=4, max_position_embeddings=4096,
        rope_scaling={"factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": DEFAULT_BETA_FAST, "beta_slow": DEFAULT_BETA_SLOW},
    )


def _v41_small() -> ModelConfig:
    """Benchmarks: runs on CPU at 16K tokens. encoder [0, 1 swa; 2 full + 3, 4 reuse;
    5 full + 6, 7 reuse] at ratio 2; decoder [8 full + 9-11 reuse; 12 reindex + 13-15
    reuse] at ratio 1."""
    return _v41_scaled(
        "v41-small", vocab_size=1024, hidden_size=256, num_layers=16, num_heads=8, head_dim=128,
        rope_head_dim=32, q_lora_rank=128, o_groups=4, o_lora_rank=128,
        moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
        sliding_window=128, compress_ratios=(0, 0) + (2,) * 6 + (1,) * 8,
        kv_source_layer_ids=(2, 5, 8), index_source_layer_ids=(2, 5, 8, 12), index_n_heads=4,
        index_head_dim=64, index_topk=128, candidate_source_layer_id=8, candidate_topk_blocks=64,
        max_position_embeddings=65536,
        rope_scaling={"factor": 4.0, "original_max_position_embeddings": 16384,
                      "beta_fast": DEFAULT_BETA_FAST, "beta_slow": DEFAULT_BETA_SLOW},
    )


PRESETS: dict[str, ModelConfig] = {
    cfg.name: cfg for cfg in (_v41_flash(), _v41_small(), _v41_tiny(), _v4_flash())
}


def preset_names() -> list[str]:
    return list(PRESETS)
