"""v41-flash's widths on a few layers: the model one GPU can hold whole, for measuring the
Flash-size kernels and step (scripts/gpu_model.py, bench/bench_decode.py)."""
from __future__ import annotations

from .model import ModelConfig

__all__ = ["flash_width"]


def flash_width(layers: int, experts: int) -> ModelConfig:
    """v41-flash's dimensions on `layers` layers and `experts` routed experts: one SWA-only
    layer, then ratio-2 (CSA) encoder layers and ratio-1 decoder layers, in v41-flash's
    proportions; the first layer of each ratio is its KV and index source, the first
    ratio-1 layer the candidate source."""
    if layers < 3:
        raise ValueError("a Flash-width model needs at least 3 layers (an SWA, a ratio-2 "
                         f"and a ratio-1 layer), got {layers}")
    if experts < 1:
        raise ValueError(f"a Flash-width model needs at least 1 routed expert, got {experts}")
    flash = ModelConfig.preset("v41-flash")
    csa = (layers - 1) // 2
    ratios = (0,) + (2,) * csa + (1,) * (layers - 1 - csa)
    first2, first1 = ratios.index(2), ratios.index(1)
    return flash.replace(
        name=f"v41-flash-width-{layers}l-{experts}e", num_layers=layers, compress_ratios=ratios,
        num_encoder_layers=first1, n_routed_experts=experts,
        num_experts_per_tok=min(flash.num_experts_per_tok, experts),
        kv_source_layer_ids=(first2, first1), index_source_layer_ids=(first2, first1),
        candidate_source_layer_id=first1, num_nextn_predict_layers=0)
