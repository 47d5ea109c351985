"""CPU-only shortcuts of the production path, and the switch that turns them off.

On the CPU some steps run a different sequence of ops than on a GPU, because the CPU's
costs differ: small-row GEMMs on float32 copies of bf16 weights (model/gemm.cpu_f32), the
MoE of a few rows on gathered expert weights (model/moe_grouped.py), mHC as three C++ ops
(ops/layer.py), a per-sequence decode's attention decoding only the rows it reads
(model/production.attend_one) and gathering its selected entries, like the indexer's
keys, from a decoded copy that decodes only new rows (model/state.RowStore.decoded), and
the selection ops called without the custom-op dispatch (ops/attention.py). Each gives the same values up to float32 summation order.

They are on by default. `off()` turns them off for a block, so the step runs the ops a GPU
would launch: bench/bench_decode.py counts the ops of a step that way (dsv41.opcount), as
the CPU's proxy for a GPU's launches, and times it with the shortcuts on. The switch is
process-wide: it is for benchmarks and tests, not for serving code.
"""
from __future__ import annotations

from contextlib import contextmanager

__all__ = ["enabled", "off"]

_on = [True]


def enabled() -> bool:
    return _on[0]


@contextmanager
def off():
    was = _on[0]
    _on[0] = False
    try:
        yield
    finally:
        _on[0] = was
