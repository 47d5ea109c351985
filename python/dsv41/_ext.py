"""The one module that loads the compiled extension dsv41._C.

Every layer that needs the compiled code imports `_C` from here (`from .._ext import _C`),
never from the package root, so that importing a low layer (dsv41.formats, dsv41.ops,
dsv41.cache.io) loads only torch and the extension, not the model or the engine.
Loading _C registers the torch ops `torch.ops.dsv41.*` of csrc/bindings.
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libc10/libtorch, which _C links against)

try:
    from . import _C
except ImportError as e:  # pragma: no cover - only hit on a broken install
    raise ImportError(
        "dsv41's compiled extension dsv41._C could not be loaded "
        f"({e}). Build it with `bash scripts/test.sh` (or `pip install --no-build-isolation .`) "
        "using the same torch you run with."
    ) from e

__all__ = ["_C"]
