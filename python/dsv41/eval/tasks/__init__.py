"""Task generators with programmatic scorers (one module each). `TASKS[name]` is an
instance; `make(...)` builds a TaskInstance, `score(answer, outputs)` grades the decoded
output of each turn."""
from __future__ import annotations

from .base import PLACEMENTS, SUFFIX_KINDS, Task, TaskError, TaskInstance
from .code_edit import CodeEdit
from .extraction import Extraction
from .multihop import MultiHop
from .passkey import Passkey
from .tool_loop import ToolLoop

TASKS: dict[str, Task] = {t.name: t for t in (Passkey(), MultiHop(), Extraction(), CodeEdit(), ToolLoop())}

__all__ = ["TASKS", "Task", "TaskInstance", "TaskError", "PLACEMENTS", "SUFFIX_KINDS"]
