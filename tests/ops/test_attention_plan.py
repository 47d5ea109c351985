"""The attention plan (ops.attention_plan): its choice of kernel and split count per batch
shape, checked without a GPU through the plan's pure decision (dsv41._C.kernels.
plan_for_device, the code sparse_attention_plan runs on a device's facts); the Python plan
on the CPU; the fallback counter; and a planned call under torch.compile(fullgraph=True)."""
from __future__ import annotations

import logging

import pytest
import torch

import dsv41
from dsv41 import ops
from dsv41._ext import _C
from dsv41.config import PRESETS
from dsv41.ops.fallbacks import KernelFallbacks

from .kernel_cases import attention_inputs

K = _C.kernels
needs_cuda_build = pytest.mark.skipif(not dsv41.build_info()["cuda_compiled"], reason="built without CUDA")
H200 = dict(sms=132, major=9)  # the first GPU run's device
NAMES = {K.GENERIC: "generic", K.MMA: "mma", K.WGMMA: "wgmma"}


def _decide(T, H, D, W=128, Kt=512, kernel="auto", splits=0, **dev):
    ids = {"auto": K.AUTO, "generic": K.GENERIC, "mma": K.MMA, "wgmma": K.WGMMA}
    kid, s, ws, why = K.plan_for_device(T, H, D, W, Kt, ids[kernel], splits, **{**H200, **dev})
    return NAMES[kid], s, ws, why


@needs_cuda_build
@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("T", [1, 2, 64, 256])
def test_every_preset_gets_a_tensor_core_kernel(name, T):
    c = PRESETS[name]
    kernel, _, _, why = _decide(T, c.num_heads, c.head_dim, c.sliding_window, c.index_topk)
    assert kernel in ("mma", "wgmma") and why == "", (name, kernel, why)


@needs_cuda_build
def test_default_kernel_follows_the_measured_numbers():
    # From two CTAs on wgmma (23.5 vs 24.4 us at T = 2 ... 61.8 vs 68.1 us at T = 128 on the
    # H200); one CTA keeps mma.sync (22.7/25.9 us in one run, 23.3/22.0 in the other: a
    # tie, docs/kernels.md).
    assert _decide(1, 64, 512)[0] == "mma"
    assert _decide(2, 64, 512)[0] == "wgmma" and _decide(128, 64, 512)[0] == "wgmma"
    assert _decide(1, 128, 512)[0] == "wgmma"  # two head groups: two CTAs
    assert _decide(64, 64, 512, wgmma_unavailable="no sm_90a code")[0] == "mma"
    assert _decide(64, 8, 128)[0] == "mma" and _decide(64, 4, 64)[0] == "mma"


@needs_cuda_build
@pytest.mark.parametrize("shape,dev,reason", [
    ((4, 8, 96), {}, "head dim"),
    ((4, 64, 512, 128, 4000), {}, "W + K > 4096"),
    ((4, 64, 512), {"major": 7}, "compute capability"),
])
def test_auto_falls_back_to_the_generic_kernel_with_a_reason(shape, dev, reason):
    kernel, splits, ws, why = _decide(*shape, **dev)
    assert kernel == "generic" and reason in why and splits == 1 and ws == 0


@needs_cuda_build
def test_named_kernels_refuse_shapes_they_cannot_take():
    with pytest.raises(RuntimeError, match="wgmma kernel cannot take this shape.*D = 512"):
        _decide(4, 8, 128, kernel="wgmma")
    with pytest.raises(RuntimeError, match="H % 64"):
        _decide(4, 72, 512, kernel="wgmma")
    with pytest.raises(RuntimeError, match="mma.sync kernel cannot take this shape"):
        _decide(4, 8, 96, kernel="mma")
    assert _decide(4, 8, 96, kernel="generic")[3] == ""  # asked for: not a fallback


@needs_cuda_build
def test_split_count_and_workspace():
    # T = 1 on 132 SMs, 2 + 8 tiles: min(132, ceil(10 / 2)) = 5 splits.
    kernel, s, ws, _ = _decide(1, 64, 512)
    assert s == 5 and ws == 1 * 5 * 64 * 513
    assert _decide(132, 64, 512)[1] == 1  # the queries fill the GPU
    assert _decide(8, 8, 128, W=128, Kt=128, splits=3)[1:3] == (3, 8 * 3 * 8 * 129)
    assert _decide(8, 8, 128, splits=1)[1:3] == (1, 0)
    assert _decide(4, 8, 96)[1] == 1  # the generic kernel never splits


# ---- the Python plan (CPU) ------------------------------------------------------------------

def _args(gen, T=3, H=4, D=64):
    return attention_inputs(gen, T, H=H, D=D, W=8, K=12, Ns=20, Ng=30)


def test_cpu_plan_runs_the_reference_and_checks_the_call(gen):
    a = _args(gen)
    plan = ops.attention_plan(4, 4, 64, swa_width=8, topk=12, device="cpu")
    assert plan.kernel == "reference" and plan.workspace is None and plan.fallback == ""
    out, lse = ops.sparse_attention(*a.values(), plan=plan)
    want_out, want_lse = ops.sparse_attention(*a.values())
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    with pytest.raises(ValueError, match="does not fit the plan"):
        ops.sparse_attention(*_args(gen, T=5).values(), plan=plan)  # 5 queries, planned for 4
    with pytest.raises(ValueError, match="does not fit the plan"):
        ops.sparse_attention(*_args(gen, H=2).values(), plan=plan)


def test_plan_arguments_and_environment_overrides(monkeypatch):
    with pytest.raises(ValueError, match="kernel must be one of"):
        ops.attention_plan(1, 4, 64, swa_width=8, topk=8, device="cpu", kernel="fast")
    with pytest.raises(ValueError, match="head_dim"):
        ops.attention_plan(1, 4, 60, swa_width=8, topk=8, device="cpu")
    monkeypatch.setenv(ops.attention.ENV_KERNEL, "fast")
    with pytest.raises(ValueError, match="DSV41_ATTENTION_IMPL must be"):
        ops.attention_plan(1, 4, 64, swa_width=8, topk=8, device="cpu")
    monkeypatch.setenv(ops.attention.ENV_KERNEL, "wgmma")
    monkeypatch.setenv(ops.attention.ENV_SPLITS, "-2")
    with pytest.raises(ValueError, match="DSV41_ATTENTION_SPLITS must be"):
        ops.attention_plan(1, 4, 64, swa_width=8, topk=8, device="cpu")
    monkeypatch.setenv(ops.attention.ENV_SPLITS, "2")
    # the overrides are read when a plan is made, and only when kernel/splits are not given
    assert ops.attention_plan(1, 4, 64, swa_width=8, topk=8, device="cpu", kernel="auto", splits=0).kernel == "reference"


def test_op_rejects_bad_plan_arguments(gen):
    a = _args(gen)
    with pytest.raises(ValueError, match="kernel must be one of"):
        torch.ops.dsv41.sparse_attention(*a.values(), None, 9, 0)
    with pytest.raises(ValueError, match="splits must be >= 0"):
        torch.ops.dsv41.sparse_attention(*a.values(), None, 0, -1)
    with pytest.raises(TypeError, match="workspace must be torch.float32"):
        torch.ops.dsv41.sparse_attention(*a.values(), torch.zeros(4, dtype=torch.int32), 0, 0)


def test_planned_call_compiles_without_graph_breaks(gen):
    """What a captured decode step needs of the op: a planned call traces into one graph."""
    a = _args(gen)
    plan = ops.attention_plan(3, 4, 64, swa_width=8, topk=12, device="cpu")

    def step(q, idx):
        out, _ = ops.sparse_attention(q, a["swa_values"], a["swa_scales"], a["swa_idx"], a["kv_codes"],
                                      a["kv_scales"], idx, a["sink"], a["softmax_scale"], plan=plan)
        return out * 2

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(a["q"], a["kv_idx"]), step(a["q"], a["kv_idx"]), rtol=0, atol=0)


# ---- the fallback counter -------------------------------------------------------------------

def test_fallbacks_are_counted_and_logged_once(caplog):
    f = KernelFallbacks()
    with caplog.at_level(logging.WARNING, logger="dsv41.ops"):
        for _ in range(3):
            f.record("sparse_attention", "W + K > 4096 keys per query")
        f.record("indexer_scores", "the tensor-core indexer needs Di = 128")
    assert f.total() == 4
    assert f.counts() == {"indexer_scores: the tensor-core indexer needs Di = 128": 1,
                          "sparse_attention: W + K > 4096 keys per query": 3}
    assert len([r for r in caplog.records if "generic CUDA kernel" in r.getMessage()]) == 2
    f.clear()
    assert f.total() == 0 and f.counts() == {}
    assert isinstance(ops.fallbacks, KernelFallbacks)
