"""The DeepSeek-V4.1-Flash model in PyTorch (CPU reference) with an explicit KV state.

See docs/model.md for the architecture as implemented, the state layout, the determinism
approach and the checkpoint name mapping.
"""
from __future__ import annotations

from .checkpoint import CheckpointError
from .context import swa_index
from .model import Block, Extend, Model
from .state import RowStore, SequenceState, SwaSnapshot, state_bytes_equal, state_diff

__all__ = [
           "Block",
           "CheckpointError",
           "Extend",
           "Model",
           "RowStore",
           "SequenceState",
           "SwaSnapshot",
           "state_bytes_equal",
           "state_diff",
           "swa_index",
]
