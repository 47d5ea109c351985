"""Model configuration: the architecture fields and their validation (`model`), the
per-layer plan (`plan`), the JSON spellings it reads and writes (`json_io`) and the presets
(`presets`). Everything public is re-exported here: `from dsv41.config import ModelConfig`.

Imports run one way: `values` <- `plan`, `json_io`, `presets` <- `model`. Only `model`
knows the ModelConfig class; the others work on its field values (json_io builds a config
through the class it is given, plan reads the fields it needs).
"""
from __future__ import annotations

from .model import PRESETS, ModelConfig
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
from .presets import preset_names
from .values import (
                   DEFAULT_BETA_FAST,
                   DEFAULT_BETA_SLOW,
                   MAIN_KV_FORMATS,
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
                   "ConfigError",
                   "LayerPlan",
                   "ModelConfig",
                   "preset_names",
]
