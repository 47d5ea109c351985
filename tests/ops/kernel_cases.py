"""Shared inputs and yardsticks of the CUDA kernel tests (tests/ops/test_cuda_*.py).

The oracle is the model's float64 reference (dsv41.ops.reference). Low-precision
tolerance follows flash-attention's idiom: the kernel's error against the reference must
be at most 2x the error of the same math done in bf16 in torch, plus a small absolute term.

DSV41_KERNEL_TEST_DEVICE=cpu runs the same tests on the CPU, where the ops dispatch to the
reference itself: that checks the harness (inputs, baselines, comparisons), not a kernel
(the test files are marked gpu(cpu_dry_run=True): tests/conftest.py).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from dsv41 import formats

DEVICE = os.environ.get("DSV41_KERNEL_TEST_DEVICE", "cuda")


def reference():
    return pytest.importorskip("dsv41.ops.reference", reason="the model's reference ops are not merged yet")


# ---- attention ---------------------------------------------------------------------------

def attention_inputs(gen, T, H=64, D=512, W=128, K=512, Ns=None, Ng=None, p_empty=0.1,
                     key_scale=1.0, q_scale=1.0):
    Ns = Ns if Ns is not None else max(1, T * W // 2 + 3)
    Ng = Ng if Ng is not None else max(1, 4 * K + 5)
    swa_x = torch.randn(Ns, D, generator=gen) * key_scale
    kv_x = torch.randn(Ng, D, generator=gen) * key_scale
    swa_values, swa_scales = formats.quantize_fp8_swa(swa_x)
    kv_codes, kv_scales = formats.quantize_nvfp4(kv_x)
    swa_idx = torch.randint(0, max(Ns, 1), (T, W), generator=gen, dtype=torch.int32)
    kv_idx = torch.randint(0, max(Ng, 1), (T, K), generator=gen, dtype=torch.int32)
    swa_idx[torch.rand(T, W, generator=gen) < p_empty] = -1
    kv_idx[torch.rand(T, K, generator=gen) < p_empty] = -1
    q = torch.randn(T, H, D, generator=gen) * q_scale
    sink = torch.randn(H, generator=gen)
    return dict(q=q, swa_values=swa_values, swa_scales=swa_scales, swa_idx=swa_idx, kv_codes=kv_codes,
                kv_scales=kv_scales, kv_idx=kv_idx, sink=sink, softmax_scale=D ** -0.5)


def replay_window_idx(positions, replay_start: int, W: int, ring: int) -> torch.Tensor:
    """SWA slots of a ring buffer: query at position i sees keys [max(s, i-W+1), i]
    (docs/design.md#replay), slot = position % ring, -1 outside the window."""
    pos = torch.as_tensor(positions, dtype=torch.int64)[:, None] - (W - 1) + torch.arange(W)[None, :]
    lo = torch.clamp(pos.new_tensor(replay_start), min=0)
    ok = (pos >= lo) & (pos <= torch.as_tensor(positions)[:, None])
    return torch.where(ok, pos % ring, -1).to(torch.int32)


def to_device(args: dict) -> dict:
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def _gathered_keys(args: dict):
    """Each query's keys [T, L, D] (SWA slots, then global entries; dequantized, exact in
    bf16) and which are valid [T, L]."""
    swa = formats.dequantize_fp8_swa(args["swa_values"], args["swa_scales"])
    kv = formats.dequantize_nvfp4(args["kv_codes"], args["kv_scales"])
    si, ki = args["swa_idx"].long(), args["kv_idx"].long()
    keys = torch.cat((swa[si.clamp(min=0)], kv[ki.clamp(min=0)]), 1)
    return keys, torch.cat((si >= 0, ki >= 0), 1)


def bf16_attention(args: dict):
    """The same math in bf16 torch ops: gather + dequantize (exact), bf16 q and keys, bf16
    matmuls (fp32 accumulation, bf16 results), fp32 softmax."""
    q, sink, scale = args["q"], args["sink"], args["softmax_scale"]
    keys, valid = _gathered_keys(args)
    kb = keys.bfloat16()
    s = torch.bmm(q.bfloat16(), kb.transpose(1, 2)).float() * scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
    o = torch.bmm(p.bfloat16(), kb).float()
    out = o * torch.sigmoid(lse - sink)[..., None]
    return out, lse


def attention_of_magnitudes(args: dict) -> torch.Tensor:
    """sigmoid(lse - sink[h]) * sum_j p_j |v_j| per (t, h, d), float64: the attention output
    with every value replaced by its magnitude (p the softmax weights of bf16 q against the
    bf16 keys, as the kernels compute them). It bounds what a relative error of each p_j can
    move out[t, h, d]: sum_j p_j e_j v_j <= max|e_j| * this. 0 for a query without keys."""
    q, sink, scale = args["q"], args["sink"], args["softmax_scale"]
    keys, valid = _gathered_keys(args)
    kb = keys.bfloat16().double()
    s = torch.bmm(q.bfloat16().double(), kb.transpose(1, 2)) * scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
    return torch.bmm(p, kb.abs()) * torch.sigmoid(lse - sink.double())[..., None]


def assert_within_bf16_error(got, ref, base, atol: float, what: str):
    """|got - ref| <= 2 |base - ref| + atol (max over the tensor), exact inf/NaN masks."""
    got, ref, base = got.double().cpu(), ref.double().cpu(), base.double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{what}: NaN mask differs"
    assert torch.equal(torch.isinf(got), torch.isinf(ref)), f"{what}: inf mask differs"
    assert torch.equal(got[torch.isinf(got)], ref[torch.isinf(ref)]), f"{what}: inf signs differ"
    fin = torch.isfinite(ref)
    if not fin.any():
        return
    err = (got[fin] - ref[fin]).abs().max().item()
    base_fin = fin & torch.isfinite(base)
    base_err = (base[base_fin] - ref[base_fin]).abs().max().item() if base_fin.any() else 0.0
    assert err <= 2 * base_err + atol, f"{what}: error {err:.3e} > 2 x bf16 error {base_err:.3e} + {atol:g}"


# ---- selection ---------------------------------------------------------------------------

def distinct_scores(gen, T, N):
    """Rows of distinct floats in random order (no ties), mixed signs."""
    rows = [(torch.randperm(N, generator=gen).float() - N / 3) * 0.37 for _ in range(T)]
    return torch.stack(rows) if rows else torch.empty(0, N)


def tied_scores(gen, T, N, levels=7):
    s = torch.randint(-levels, levels + 1, (T, N), generator=gen).float() * 0.5
    s[s == 0] = -0.0  # signed zeros tie with +0 by float comparison
    return s
