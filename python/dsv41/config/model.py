"""The model configuration: architecture fields and their validation.

A `ModelConfig` is validated once, at construction, so every other part of dsv41 (model,
cache manager, budget, replay) can trust its layer plan. The rules are those of
docs/design.md#layer-modes; docs/config.md lists every field, the JSON key mapping and the
validation rules.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..formats import layout
from . import json_io
from .plan import LayerPlan, build_plan, check_candidates, check_split
from .presets import PRESET_FIELDS, preset_names
from .values import (
    MAIN_KV_FORMATS,
    SCORING_FUNCS,
    ConfigError,
    as_float,
    as_int,
    normalise_rope_scaling,
    ratio_supported,
    supported_ratios_text,
)

__all__ = ["PRESETS", "ModelConfig"]


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
    # mHC (manifold-constrained hyper-connections): hc_mult residual streams, mixed per
    # block by pre/post/comb weights (comb projected by hc_sinkhorn_iters Sinkhorn
    # iterations). hc_mult = 1 is the plain residual (no hc_* weights).
    hc_mult: int = 1
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # V4's hash-MoE: the first num_hash_layers MoE layers choose experts by token id
    # (a frozen int64 tid2eid table) instead of by score; they have no gate bias.
    num_hash_layers: int = 0
    # V4's compressors: a learned position bias `ape` [ratio, width] added to the gate
    # scores of the tokens of each window.
    compressor_ape: bool = False
    # Ratios whose compressors pool overlapping windows (width 2m, stride m; V4's CSA).
    overlap_compress_ratios: tuple[int, ...] = ()
    # V4's indexer keys come from its own compressor over the layer input; V4.1's are a
    # projection of the main compressor's entry.
    indexer_compressor: bool = False

    def __post_init__(self) -> None:
        self._normalise()
        self._check_scalars()
        self._check_format_dims()
        self._check_layer_lists()
        self._check_v4_fields()
        plan = build_plan(self)
        object.__setattr__(self, "_plan", tuple(plan))
        if self.encoder_decoder:
            check_split(self, plan)
        check_candidates(self, plan)

    def __hash__(self) -> int:  # rope_scaling is a dict, so hash the canonical form
        return hash(self.fingerprint())

    # ---- normalisation and validation -------------------------------------------------

    def _normalise(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float":
                value = as_float(f.name, value)
            elif f.type == "int" or (f.type == "int | None" and value is not None):
                value = as_int(f.name, value)
            elif f.type == "bool" and not isinstance(value, bool):
                raise ConfigError(f"{f.name}: expected a bool, got {value!r}")
            elif f.type == "str" and not isinstance(value, str):
                raise ConfigError(f"{f.name}: expected a string, got {value!r}")
            elif f.type == "tuple[int, ...]":
                if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                    raise ConfigError(f"{f.name}: expected a list of ints, got {value!r}")
                value = tuple(as_int(f.name, v) for v in value)
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "rope_scaling", normalise_rope_scaling(self.rope_scaling))
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
        if self.main_kv_format not in MAIN_KV_FORMATS:
            raise ConfigError(f"main_kv_format {self.main_kv_format!r} unknown "
                              f"(known: {MAIN_KV_FORMATS})")
        if self.rope_head_dim % 2 or self.rope_head_dim >= self.head_dim:
            raise ConfigError(f"rope_head_dim={self.rope_head_dim} must be even and smaller "
                              f"than head_dim={self.head_dim}")

    def check_stored_formats(self) -> None:
        """ConfigError unless the dims are whole blocks of the stored KV formats (main KV,
        SWA KV, MXFP4 indexer keys). Not part of construction: a model whose KV stays
        float32 (kv_dtype="float32", the reference mode) stores nothing and needs no
        blocks; the stored model, the KV budget and the cache check it."""
        # The byte-size functions reject dims that are not whole format blocks; reuse them so
        # the rule lives in one place.
        checks = [("index_head_dim", lambda: layout.mxfp4_bytes(self.index_head_dim))]
        if self.main_kv_format == "nvfp4":
            checks += [("head_dim", lambda: layout.nvfp4_bytes(self.head_dim)),
                       ("head_dim", lambda: layout.fp8_swa_bytes(self.head_dim))]
        else:
            checks += [("head_dim", lambda: layout.fp8_v4_main_bytes(self.nope_head_dim,
                                                                     self.rope_head_dim))]
        problems = []
        for name, check in checks:
            try:
                check()
            except ValueError as exc:
                problems.append(f"{name}={getattr(self, name)} ({exc})")
        if problems:
            raise ConfigError(f"config {self.name!r} does not fit the {self.main_kv_format} "
                              f"stored KV formats: {', '.join(problems)}; kv_dtype='float32' "
                              f"(the unquantized reference mode) runs it")

    def _check_layer_lists(self) -> None:
        n = self.num_layers
        if len(self.compress_ratios) != n:
            raise ConfigError(f"compress_ratios has {len(self.compress_ratios)} entries, "
                              f"expected num_layers={n}")
        fmt = self.main_kv_format
        for layer, ratio in enumerate(self.compress_ratios):
            if not ratio_supported(fmt, ratio):
                raise ConfigError(f"layer {layer}: compress ratio {ratio} not supported by "
                                  f"{fmt} (supported: {supported_ratios_text(fmt)})")
        for ratio in self.dense_compress_ratios:
            if ratio == 0 or not ratio_supported(fmt, ratio):
                raise ConfigError(f"dense_compress_ratios: {ratio} is not a supported "
                                  f"nonzero ratio for {fmt}")
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

    def _check_v4_fields(self) -> None:
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1 or self.hc_eps < 0:
            raise ConfigError(f"hc_mult ({self.hc_mult}) and hc_sinkhorn_iters "
                              f"({self.hc_sinkhorn_iters}) must be >= 1 and hc_eps >= 0")
        if not 0 <= self.num_hash_layers <= self.num_layers:
            raise ConfigError(f"num_hash_layers={self.num_hash_layers} must lie in "
                              f"[0, num_layers={self.num_layers}]")
        for ratio in self.overlap_compress_ratios:
            if ratio < 2 or not ratio_supported(self.main_kv_format, ratio):
                raise ConfigError(f"overlap_compress_ratios: {ratio} is not a supported "
                                  f"ratio > 1 for {self.main_kv_format}")
            if ratio in self.dense_compress_ratios:
                raise ConfigError(f"overlap_compress_ratios: {ratio} is a dense (HCA) "
                                  f"ratio; only indexed (CSA) compressors overlap")

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

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def hash_layer(self, layer: int) -> bool:
        """True when the layer's MoE routes by token id (V4's hash layers)."""
        return layer < self.num_hash_layers

    # ---- JSON (the spellings and their mapping live in json_io.py) ---------------------

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json's dict: every field at the top level under its Hugging Face key, and
        transformers' own keys where transformers' DeepseekV4 builds this model
        (json_io.py)."""
        return json_io.to_hf_dict(self)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path, name: str | None = None) -> ModelConfig:
        return cls.from_dict(json_io.read_config_file(path), name=name)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str | None = None) -> ModelConfig:
        """Read any supported spelling (docs/config.md): dsv41/HF V4.1 (nested
        `text_config` or top level), transformers' DeepseekV4Config, DeepSeek's flat
        inference config, or `to_dict()` output."""
        return json_io.from_dict(cls, d, name=name)

    # ---- presets ----------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        try:
            return PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r} (known: {preset_names()})") from None


# The presets, built and validated once (their field values live in presets.py).
PRESETS: dict[str, ModelConfig] = {name: ModelConfig(**fields)
                                   for name, fields in PRESET_FIELDS.items()}
