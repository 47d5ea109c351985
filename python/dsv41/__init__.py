"""dsv41: a runtime for DeepSeek-V4.1-Flash-style models.

FP4 global KV resident on the GPU, exact SWA KV in a short-lived host pool, a persistent
prefix cache on SSD, and bounded SWA replay when the SWA state is gone.

Importing the package loads the compiled extension (through `dsv41._ext`) and the op
layers (`formats`, `ops`: they register the torch ops); everything above them (config,
model, engine, replay) is imported on first use of its name, so `import dsv41.formats`
does not load the model.
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import _ext  # noqa: F401  (dsv41._C: the compiled ops; fails loudly when missing)
from . import formats, ops  # noqa: E402  (register the format, attention and cache ops)

__all__ = ["__version__", "build_info", "formats", "ops", "ModelConfig", "LayerPlan",
           "ConfigError", "kv_budget", "KVBudget", "Model", "SequenceState", "Engine",
           "SamplingParams", "RequestOutput", "ReplayConfig"]

# name -> the submodule that defines it, imported on first use.
_LAZY = {"build_info": "_build", "KVBudget": "budget", "kv_budget": "budget",
         "ConfigError": "config", "LayerPlan": "config", "ModelConfig": "config",
         "Model": "model", "SequenceState": "model",
         "Engine": "engine", "SamplingParams": "engine", "RequestOutput": "engine",
         "ReplayConfig": "replay"}


def __getattr__(name: str):
    """dsv41.Model, dsv41.ModelConfig, dsv41.Engine, ... (imported on first use)."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'dsv41' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
