"""The attention ops, each defined in one place: here.

For `sparse_attention` and `dense_attention` this module holds the schema (a torch custom
op in the `dsv41` namespace), the argument checks (`_checks.check_attention`, the only
copy), the CPU implementation (the float64 torch reference, `dsv41.ops.reference`), the
CUDA implementation (the checks, then the kernels of `dsv41._C.kernels`: csrc/cuda/
attention*.cu) and the fake kernel for torch.compile. `dense_attention` has no CUDA kernel:
on CUDA tensors it runs the reference. docs/kernels.md says where every op lives.

The plan. Which CUDA kernel runs, how many key splits it uses and its workspace are
decided once per batch shape by `attention_plan(...)` and kept by the caller (FlashMLA's
get_mla_metadata, FlashInfer's plan()), then passed with `plan=`:

    plan = ops.attention_plan(num_queries=64, num_heads=8, head_dim=128, swa_width=128,
                              topk=128, device="cuda")
    out, lse = ops.sparse_attention(q, swa_values, swa_scales, swa_idx, kv_codes,
                                    kv_scales, kv_idx, sink, softmax_scale, plan=plan)

A call with a plan takes at most plan.num_queries queries (pad the batch to its bucket),
allocates only its outputs (a CUDA graph's pool owns them when captured) and never
synchronizes: one plan per CUDA-graph bucket is what a captured decode step needs. Without
a plan, each call is planned alone (automatic choice, workspace allocated per call).
DSV41_ATTENTION_IMPL (mma, wgmma, generic) and DSV41_ATTENTION_SPLITS (n, 0 = automatic)
override the choice of `attention_plan` when its `kernel`/`splits` are not given: for
benchmarks and debugging; nothing reads them per call.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from .. import profiling
from .._ext import _C
from . import _checks, reference
from .fallbacks import fallbacks

Tensor = torch.Tensor

__all__ = ["AttentionPlan", "attention_plan", "sparse_attention", "dense_attention", "KERNELS",
           "ENV_KERNEL", "ENV_SPLITS"]

ENV_KERNEL = "DSV41_ATTENTION_IMPL"
ENV_SPLITS = "DSV41_ATTENTION_SPLITS"
_K = _C.kernels
_KERNEL_IDS = {"auto": _K.AUTO, "generic": _K.GENERIC, "mma": _K.MMA, "wgmma": _K.WGMMA}
_KERNEL_NAMES = {v: k for k, v in _KERNEL_IDS.items()}
KERNELS = tuple(_KERNEL_IDS)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """What `sparse_attention` runs for batches of up to num_queries queries of num_heads
    heads of dim head_dim on `device`. kernel: "mma", "wgmma" or "generic" on CUDA,
    "reference" on the CPU. fallback: why the plan runs the generic kernel although a
    tensor-core kernel was wanted ("" otherwise). workspace: the split partials (float32,
    device memory the plan owns; None with one split), reused by every call with the plan:
    calls on one stream are ordered, concurrent streams need a plan each."""

    num_queries: int
    num_heads: int
    head_dim: int
    device: torch.device
    kernel: str
    num_splits: int
    workspace: Optional[Tensor]
    fallback: str = ""

    @property
    def kernel_id(self) -> int:
        return _KERNEL_IDS.get(self.kernel, _K.AUTO)


def _env_kernel() -> str:
    v = os.environ.get(ENV_KERNEL, "").strip()
    if v and v not in ("mma", "wgmma", "generic"):
        raise ValueError(f"{ENV_KERNEL} must be mma, wgmma or generic (or unset), got {v!r}")
    return v or "auto"


def _env_splits() -> int:
    v = os.environ.get(ENV_SPLITS, "").strip()
    try:
        n = int(v) if v else 0
    except ValueError:
        raise ValueError(f"{ENV_SPLITS} must be an integer >= 0, got {v!r}") from None
    if n < 0:
        raise ValueError(f"{ENV_SPLITS} must be an integer >= 0, got {v!r}")
    return n


def attention_plan(num_queries: int, num_heads: int, head_dim: int, *, swa_width: int, topk: int,
                   device, kernel: Optional[str] = None, splits: Optional[int] = None) -> AttentionPlan:
    """Plans `sparse_attention` for up to num_queries queries whose index lists are at most
    swa_width (SWA) and topk (global) wide. kernel: "auto" (default: wgmma where it runs and
    the batch has two or more 64-head groups, else mma.sync, else the generic kernel,
    counted as a fallback), or "mma", "wgmma", "generic" (a tensor-core kernel that cannot
    take the shape is an error). splits: key splits per query, 0 = automatic (default),
    1 = none (a query's bits then never depend on the batch). None reads the environment
    overrides (module docstring)."""
    kernel = _env_kernel() if kernel is None else kernel
    splits = _env_splits() if splits is None else int(splits)
    if kernel not in _KERNEL_IDS:
        raise ValueError(f"attention_plan: kernel must be one of {KERNELS}, got {kernel!r}")
    if splits < 0:
        raise ValueError(f"attention_plan: splits must be >= 0, got {splits}")
    for name, v in (("num_queries", num_queries), ("swa_width", swa_width), ("topk", topk)):
        if int(v) < 0:
            raise ValueError(f"attention_plan: {name} must be >= 0, got {v}")
    if int(num_heads) <= 0 or int(head_dim) <= 0 or int(head_dim) % 32:
        raise ValueError(f"attention_plan: need num_heads > 0 and head_dim a positive multiple of 32, "
                         f"got {num_heads} and {head_dim}")
    device = torch.device(device)
    if device.type != "cuda":
        return AttentionPlan(int(num_queries), int(num_heads), int(head_dim), device, "reference", 1, None)
    if not hasattr(_K, "attention_plan"):
        raise RuntimeError("attention_plan: dsv41 was built without CUDA")
    index = device.index if device.index is not None else torch.cuda.current_device()
    kid, n_splits, ws_floats, why = _K.attention_plan(int(num_queries), int(num_heads), int(head_dim),
                                                      int(swa_width), int(topk), _KERNEL_IDS[kernel], splits,
                                                      index)
    dev = torch.device("cuda", index)
    ws = torch.empty(ws_floats, dtype=torch.float32, device=dev) if ws_floats else None
    return AttentionPlan(int(num_queries), int(num_heads), int(head_dim), dev, _KERNEL_NAMES[kid], n_splits, ws,
                         why)


def _plan_args(plan: Optional[AttentionPlan], q: Tensor) -> tuple[Optional[Tensor], int, int]:
    """(workspace, kernel, splits) of the op for this call: a plan's, or (None, auto, 0)."""
    if plan is None:
        return None, _K.AUTO, 0
    T, H, D = q.shape
    if q.device != plan.device or T > plan.num_queries or H != plan.num_heads or D != plan.head_dim:
        raise ValueError(f"sparse_attention: q {tuple(q.shape)} on {q.device} does not fit the plan "
                         f"(up to {plan.num_queries} queries of {plan.num_heads} x {plan.head_dim} on "
                         f"{plan.device})")
    if plan.fallback:
        fallbacks.record("sparse_attention", plan.fallback)
    if plan.kernel == "reference":
        return None, _K.AUTO, 0
    return plan.workspace, plan.kernel_id, plan.num_splits


# ---- the ops ------------------------------------------------------------------------------

@torch.library.custom_op("dsv41::sparse_attention", mutates_args=())
def _sparse_attention(q: Tensor, swa_values: Tensor, swa_scales: Tensor, swa_idx: Tensor,
                      kv_codes: Tensor, kv_scales: Tensor, kv_idx: Tensor, sink: Tensor,
                      softmax_scale: float, workspace: Optional[Tensor] = None, kernel: int = 0,
                      splits: int = 0) -> tuple[Tensor, Tensor]:
    op = "sparse_attention"
    _checks.check_attention(op, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx,
                            sink, dense=False)
    _checks.check_plan_args(op, q, workspace, kernel, splits, tuple(_KERNEL_NAMES))
    _checks.check_indices(op, "swa_idx", swa_idx, swa_values.shape[0])
    _checks.check_indices(op, "kv_idx", kv_idx, kv_codes.shape[0])
    return reference.sparse_attention(q, swa_values, swa_scales.view(torch.uint8), swa_idx,
                                      kv_codes, kv_scales, kv_idx, sink, softmax_scale)


@torch.library.custom_op("dsv41::dense_attention", mutates_args=())
def _dense_attention(q: Tensor, swa_values: Tensor, swa_scales: Tensor, swa_idx: Tensor,
                     kv_codes: Tensor, kv_scales: Tensor, kv_visible: Tensor, sink: Tensor,
                     softmax_scale: float) -> tuple[Tensor, Tensor]:
    op = "dense_attention"
    _checks.check_attention(op, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales,
                            kv_visible, sink, dense=True)
    _checks.check_indices(op, "swa_idx", swa_idx, swa_values.shape[0])
    return reference.dense_attention(q, swa_values, swa_scales.view(torch.uint8), swa_idx,
                                     kv_codes, kv_scales, kv_visible, sink, softmax_scale)


if hasattr(_K, "sparse_attention"):  # built with CUDA
    @_sparse_attention.register_kernel("cuda")
    def _sparse_attention_cuda(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink,
                               softmax_scale, workspace=None, kernel=0, splits=0):
        # The same checks as the CPU path except the index values (reading them would
        # synchronize): on CUDA an index outside [0, rows) counts as empty.
        op = "sparse_attention"
        _checks.check_attention(op, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx,
                                sink, dense=False)
        _checks.check_plan_args(op, q, workspace, kernel, splits, tuple(_KERNEL_NAMES))
        out, lse, why = _K.sparse_attention(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx,
                                            sink, float(softmax_scale), workspace, int(kernel), int(splits))
        if why:
            fallbacks.record(op, why)
        return out, lse


@torch.library.register_fake("dsv41::sparse_attention")
def _sparse_attention_fake(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink,
                           softmax_scale, workspace=None, kernel=0, splits=0):
    op = "sparse_attention"
    _checks.check_attention(op, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx,
                            sink, dense=False)
    _checks.check_plan_args(op, q, workspace, kernel, splits, tuple(_KERNEL_NAMES))
    return _attention_outputs(q)


@torch.library.register_fake("dsv41::dense_attention")
def _dense_attention_fake(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_visible, sink,
                          softmax_scale):
    _checks.check_attention("dense_attention", q, swa_values, swa_scales, swa_idx, kv_codes,
                            kv_scales, kv_visible, sink, dense=True)
    return _attention_outputs(q)


def _attention_outputs(q: Tensor) -> tuple[Tensor, Tensor]:
    """out in q's dtype (float32 or bfloat16), lse always float32 (reference.py)."""
    T, H, D = q.shape
    return q.new_empty((T, H, D)), q.new_empty((T, H), dtype=torch.float32)


# ---- the Python API: keyword-friendly names for the ops above ---------------------------

@profiling.op("op.sparse_attention")
def sparse_attention(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx, sink,
                     softmax_scale: float, *, plan: Optional[AttentionPlan] = None) -> tuple[Tensor, Tensor]:
    """See `dsv41.ops.reference.sparse_attention` for the math and the conventions (shapes,
    -1 = empty, no valid key: out 0 and lse -inf); `attention_plan` for `plan`."""
    workspace, kernel, splits = _plan_args(plan, q)
    return torch.ops.dsv41.sparse_attention(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales,
                                            kv_idx, sink, float(softmax_scale), workspace, kernel, splits)


@profiling.op("op.dense_attention")
def dense_attention(q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_visible, sink,
                    softmax_scale: float) -> tuple[Tensor, Tensor]:
    """See `dsv41.ops.reference.dense_attention` (the dense baseline)."""
    return torch.ops.dsv41.dense_attention(q, swa_values, swa_scales, swa_idx, kv_codes,
                                           kv_scales, kv_visible, sink, float(softmax_scale))
