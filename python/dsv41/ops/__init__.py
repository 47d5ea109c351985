"""dsv41's torch ops (namespace `torch.ops.dsv41`).

Loading this package loads the compiled extension (which registers the CPU and CUDA
kernels) and the fake kernels that let the ops run under torch.compile / FakeTensor.
The format ops are wrapped with argument checks in `dsv41.formats`.
"""
from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (registers torch.ops.dsv41.*)
from . import _fake  # noqa: F401
from . import cache_ops  # noqa: F401  (cache writes, block copies: kernels in csrc/)
from . import _kernel_schemas  # noqa: F401  (after the model's ops: defines only what is missing)

ops = torch.ops.dsv41
