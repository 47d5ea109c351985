"""The per-layer plan: what each layer computes and which layers' state it reads
(docs/design.md#layer-modes; docs/config.md "Layer plan")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .values import ConfigError

__all__ = [
    "MODE_FULL",
    "MODE_REINDEX",
    "MODE_REUSE",
    "MODE_SWA_ONLY",
    "PART_DECODER",
    "PART_ENCODER",
    "PART_LAYER",
    "LayerPlan",
    "build_plan",
    "check_candidates",
    "check_split",
]

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
    `overlap`: the layer's compressor pools overlapping windows (V4's CSA).
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
    overlap: bool = False


class PlanFields(Protocol):
    """The ModelConfig fields a layer plan is built from (model.py imports this module, not
    the other way round)."""

    num_layers: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    dense_compress_ratios: tuple[int, ...]
    overlap_compress_ratios: tuple[int, ...]
    encoder_decoder: bool
    num_encoder_layers: int
    index_topk: int
    candidate_source_layer_id: int | None
    candidate_topk_blocks: int
    candidate_block_size: int


def _latest_same_ratio(ratios: tuple[int, ...], sources: set[int], layer: int) -> int | None:
    return next((s for s in range(layer, -1, -1)
                 if s in sources and ratios[s] == ratios[layer]), None)


def _part(cfg: PlanFields, layer: int) -> str:
    if not cfg.encoder_decoder:
        return PART_LAYER
    return PART_ENCODER if layer < cfg.num_encoder_layers else PART_DECODER


def build_plan(cfg: PlanFields) -> list[LayerPlan]:
    kv_ids, index_ids = set(cfg.kv_source_layer_ids), set(cfg.index_source_layer_ids)
    plan = []
    for layer, ratio in enumerate(cfg.compress_ratios):
        dense = ratio in cfg.dense_compress_ratios
        kv_source = index_source = None
        if ratio:
            kv_source = _latest_same_ratio(cfg.compress_ratios, kv_ids, layer)
            if kv_source is None:
                raise ConfigError(f"layer {layer}: compress ratio {ratio} but no KV source "
                                  f"at or before it with the same ratio")
            if not dense:
                # Every non-dense KV source is an index source, so this finds one at or
                # after kv_source: top-k and indexer keys always share the KV source.
                index_source = _latest_same_ratio(cfg.compress_ratios, index_ids, layer)
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
            part=_part(cfg, layer),
            mode=mode,
            compress_ratio=ratio,
            kv_source=kv_source,
            index_source=index_source,
            index_key_source=None if index_source is None else kv_source,
            owns_kv=mode == MODE_FULL,
            owns_indexer_keys=mode == MODE_FULL and not dense,
            owns_index_query=mode in (MODE_FULL, MODE_REINDEX) and not dense,
            dense=dense,
            overlap=ratio in cfg.overlap_compress_ratios,
        ))
    return plan


def check_candidates(cfg: PlanFields, plan: list[LayerPlan]) -> None:
    src = cfg.candidate_source_layer_id
    if src is None:
        return
    if not 0 <= src < cfg.num_layers or plan[src].mode != MODE_FULL or plan[src].dense:
        raise ConfigError(f"candidate_source_layer_id={src} must be a Full layer (a KV "
                          f"source with its own indexer)")
    if cfg.candidate_topk_blocks <= 0 or cfg.candidate_block_size <= 0:
        raise ConfigError("candidate_topk_blocks and candidate_block_size must be positive")
    if cfg.candidate_topk_blocks * cfg.candidate_block_size < cfg.index_topk:
        raise ConfigError(f"candidate_topk_blocks x candidate_block_size = "
                          f"{cfg.candidate_topk_blocks * cfg.candidate_block_size} "
                          f"candidates is fewer than index_topk={cfg.index_topk}")
    ratio = cfg.compress_ratios[src]
    for p in plan:
        # Reindex layers score only the candidate source's candidates.
        if p.mode == MODE_REINDEX and (p.layer < src or p.compress_ratio != ratio):
            raise ConfigError(f"layer {p.layer}: Reindex layer must come after the "
                              f"candidate source layer {src} and share its ratio {ratio}")


def check_split(cfg: PlanFields, plan: list[LayerPlan]) -> None:
    split = cfg.num_encoder_layers
    if not 0 < split < cfg.num_layers:
        raise ConfigError(f"num_encoder_layers={split} must leave a non-empty encoder and "
                          f"decoder out of num_layers={cfg.num_layers}")
    first = plan[split]
    if first.mode != MODE_FULL or split != cfg.candidate_source_layer_id:
        raise ConfigError(f"first decoder layer {split} must be a Full KV source and equal "
                          f"candidate_source_layer_id={cfg.candidate_source_layer_id} "
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
