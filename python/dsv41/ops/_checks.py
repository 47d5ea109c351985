"""The argument checks of the attention, indexer and top-k ops: their only copy. The CPU,
CUDA and fake kernels of each op (ops/attention.py, ops/selection.py) call them first, so a
bad call fails the same way on every device, eagerly and under torch.compile, and the
C++ side (csrc/bindings/attention.cpp) repeats none of them."""
from __future__ import annotations

import torch

from ..formats.layout import FP8_SWA, MXFP4, NVFP4

_UE8M0 = (torch.uint8, torch.float8_e8m0fnu)


def _fail(op: str, msg: str, exc=ValueError):
    raise exc(f"{op}: {msg}")


def _tensor(op, name, t, dtypes, dim):
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        _fail(op, f"{name} must be {allowed}, got {t.dtype}", TypeError)
    if t.dim() != dim:
        _fail(op, f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")


def _same_device(op, **tensors):
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        _fail(op, f"tensors on different devices: {devices}")


def check_attention(op, q, swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_sel, sink,
                    *, dense: bool):
    _tensor(op, "q", q, (torch.float32, torch.bfloat16), 3)
    T, H, D = q.shape
    if D % FP8_SWA.block:
        _fail(op, f"head dim {D} must be a multiple of {FP8_SWA.block} (FP8 SWA blocks)")
    _tensor(op, "swa_values", swa_values, (FP8_SWA.code_dtype,), 2)
    _tensor(op, "swa_scales", swa_scales, _UE8M0, 2)
    _tensor(op, "swa_idx", swa_idx, (torch.int32,), 2)
    _tensor(op, "kv_codes", kv_codes, (NVFP4.code_dtype,), 2)
    _tensor(op, "kv_scales", kv_scales, (NVFP4.scale_dtype,), 2)
    if dense:
        _tensor(op, "kv_visible", kv_sel, (torch.int32, torch.int64), 1)
    else:
        _tensor(op, "kv_idx", kv_sel, (torch.int32,), 2)
    _tensor(op, "sink", sink, (torch.float32,), 1)
    sv, ss = FP8_SWA.row_shapes(D)
    if tuple(swa_values.shape[1:]) != (sv,) or tuple(swa_scales.shape) != (swa_values.shape[0], ss):
        _fail(op, f"swa_values {tuple(swa_values.shape)} / swa_scales {tuple(swa_scales.shape)} "
                  f"do not hold FP8 rows of head dim {D} (expected [Ns,{sv}] and [Ns,{ss}])")
    kc, ks = NVFP4.row_shapes(D)
    if tuple(kv_codes.shape[1:]) != (kc,) or tuple(kv_scales.shape) != (kv_codes.shape[0], ks):
        _fail(op, f"kv_codes {tuple(kv_codes.shape)} / kv_scales {tuple(kv_scales.shape)} do not "
                  f"hold NVFP4 rows of head dim {D} (expected [Ng,{kc}] and [Ng,{ks}])")
    if swa_idx.shape[0] != T or kv_sel.shape[0] != T:
        _fail(op, f"swa_idx {tuple(swa_idx.shape)} and kv index {tuple(kv_sel.shape)} must have "
                  f"one row per query (T={T})")
    if tuple(sink.shape) != (H,):
        _fail(op, f"sink must have shape ({H},), got {tuple(sink.shape)}")
    _same_device(op, q=q, swa_values=swa_values, swa_scales=swa_scales, swa_idx=swa_idx,
                 kv_codes=kv_codes, kv_scales=kv_scales, kv_index=kv_sel, sink=sink)


def check_plan_args(op, q, workspace, kernel: int, splits: int, kernels: tuple):
    """The plan's arguments of sparse_attention (ops/attention.py: attention_plan)."""
    if kernel not in kernels:
        _fail(op, f"kernel must be one of {kernels}, got {kernel}")
    if splits < 0:
        _fail(op, f"splits must be >= 0, got {splits}")
    if workspace is not None:
        _tensor(op, "workspace", workspace, (torch.float32,), 1)
        _same_device(op, q=q, workspace=workspace)


def check_indices(op, name, idx, n_rows):
    """Indices must be -1 (empty) or a valid row. Reads the values (eager only), so the
    reference implementations call it and the CUDA kernels' do not: reading would
    synchronize, and the kernels treat an index outside [0, rows) as empty."""
    if idx.numel() and not torch.compiler.is_compiling():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= n_rows:
            _fail(op, f"{name} holds {lo if lo < -1 else hi}, outside [-1, {n_rows}) "
                      f"({n_rows} rows)", IndexError)


def check_indexer(op, q_codes, q_scales, weights, k_codes, k_scales, idx=None):
    _tensor(op, "q_codes", q_codes, (torch.uint8,), 3)
    _tensor(op, "q_scales", q_scales, _UE8M0, 3)
    _tensor(op, "weights", weights, (torch.float32,), 2)
    _tensor(op, "k_codes", k_codes, (torch.uint8,), 2)
    _tensor(op, "k_scales", k_scales, _UE8M0, 2)
    T, Hi, half = q_codes.shape
    Di = half * MXFP4.values_per_code
    n_scales = MXFP4.scale_cols(Di)
    if Di % MXFP4.block or tuple(q_scales.shape) != (T, Hi, n_scales):
        _fail(op, f"q_codes {tuple(q_codes.shape)} / q_scales {tuple(q_scales.shape)} do not hold "
                  f"MXFP4 queries (expected scales [{T},{Hi},{n_scales}], Di a multiple of "
                  f"{MXFP4.block})")
    if tuple(k_codes.shape[1:]) != (half,) or tuple(k_scales.shape) != (k_codes.shape[0], n_scales):
        _fail(op, f"k_codes {tuple(k_codes.shape)} / k_scales {tuple(k_scales.shape)} do not hold "
                  f"MXFP4 keys of dim {Di}")
    if tuple(weights.shape) != (T, Hi):
        _fail(op, f"weights must have shape ({T}, {Hi}), got {tuple(weights.shape)}")
    tensors = dict(q_codes=q_codes, q_scales=q_scales, weights=weights, k_codes=k_codes,
                   k_scales=k_scales)
    if idx is not None:
        _tensor(op, "idx", idx, (torch.int32,), 2)
        if idx.shape[0] != T:
            _fail(op, f"idx must have one row per query (T={T}), got {tuple(idx.shape)}")
        tensors["idx"] = idx
    _same_device(op, **tensors)


def check_selection(op, scores, visible, k: int, *, name="k"):
    _tensor(op, "scores", scores, (torch.float32,), 2)
    _tensor(op, "visible", visible, (torch.int32, torch.int64), 1)
    if visible.shape[0] != scores.shape[0]:
        _fail(op, f"visible has {visible.shape[0]} rows, scores {scores.shape[0]}")
    if k < 0:
        _fail(op, f"{name} must be >= 0, got {k}")
    _same_device(op, scores=scores, visible=visible)
