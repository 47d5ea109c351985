"""dsv41: a runtime for DeepSeek-V4.1-Flash-style models.

FP4 global KV resident on the GPU, exact SWA KV in a short-lived host pool, a persistent
prefix cache on SSD, and bounded SWA replay when the SWA state is gone.
"""
from __future__ import annotations

__version__ = "0.1.0"

import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

try:
    from . import _C  # noqa: F401  (the compiled ops; registers torch.ops.dsv41)
except ImportError as e:  # pragma: no cover - only hit on a broken install
    raise ImportError(
        "dsv41's compiled extension dsv41._C could not be loaded "
        f"({e}). Build it with `bash scripts/test.sh` (or `pip install --no-build-isolation .`) "
        "using the same torch you run with."
    ) from e

from . import formats, ops  # noqa: E402
from ._build import build_info  # noqa: E402
from .budget import KVBudget, kv_budget  # noqa: E402
from .config import ConfigError, LayerPlan, ModelConfig  # noqa: E402
from .model import Model, SequenceState  # noqa: E402

__all__ = ["__version__", "build_info", "formats", "ops", "ModelConfig", "LayerPlan",
           "ConfigError", "kv_budget", "KVBudget", "Model", "SequenceState", "Engine",
           "SamplingParams", "RequestOutput", "ReplayConfig"]

_LAZY = {"Engine": "engine", "SamplingParams": "engine", "RequestOutput": "engine",
         "ReplayConfig": "replay"}


def __getattr__(name: str):
    """dsv41.Engine, dsv41.SamplingParams, dsv41.ReplayConfig (imported on first use)."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'dsv41' has no attribute {name!r}")
