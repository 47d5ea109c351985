"""Model configuration: the architecture fields and their validation (`model`), the
per-layer plan (`plan`), the JSON spellings it reads and writes (`json_io`) and the presets
(`presets`). Everything public is re-exported here: `from dsv41.config import ModelConfig`.
"""
from __future__ import annotations

from .model import ModelConfig
from .plan import (
                   MODE_FULL,
                   MODE_REINDEX,
                   MODE_REUSE,
                   MODE_SWA_ONLY,
                   PART_DECODER,
                   PART_ENCODER,
                   PART_LAYER,
                   LayerPlan,
)
from .presets import PRESETS, preset_names
from .values import (
                   DEFAULT_BETA_FAST,
                   DEFAULT_BETA_SLOW,
                   MAIN_KV_FORMATS,
                   SUPPORTED_RATIOS,
                   ConfigError,
)

__all__ = [
                   "DEFAULT_BETA_FAST",
                   "DEFAULT_BETA_SLOW",
                   "MAIN_KV_FORMATS",
                   "MODE_FULL",
                   "MODE_REINDEX",
                   "MODE_REUSE",
                   "MODE_SWA_ONLY",
                   "PART_DECODER",
                   "PART_ENCODER",
                   "PART_LAYER",
                   "PRESETS",
                   "SUPPORTED_RATIOS",
                   "ConfigError",
                   "LayerPlan",
                   "ModelConfig",
                   "preset_names",
]
