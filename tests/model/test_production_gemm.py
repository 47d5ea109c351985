"""The production path's CUDA GEMM choices, tested on the CPU: the block-scaled FP8 GEMM
(model/fp8_gemm.py) and the grouped MoE (model/moe_grouped.py).

No GPU was lent while these were written, so the CUDA calls themselves have never run.
What runs here: every branch of the two path decisions (pure functions of explicit facts),
the layouts handed to torch, the CPU emulation of the FP8 product against the dequant path
within FP8 error bounds, and the MoE grouping/offsets against the per-expert loop - through
torch._grouped_mm's own CPU fallback and through an explicit loop emulation.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from dsv41 import Model
from dsv41.config import ModelConfig
from dsv41.model import fp8_gemm, gemm, moe_grouped, production
from dsv41.model.layers import Linear

# ---- FP8 block-scaled GEMM ---------------------------------------------------------------

_H100 = dict(device_type="cuda", capability=(9, 0), has_blockwise_scaled_mm=True,
             cuda_version=(13, 0), block=(128, 128), in_features=512, out_features=256)


@pytest.mark.parametrize("change,path,why", [
    ({}, "scaled_mm", "sm_90"),
    ({"device_type": "cpu", "capability": None}, "dequant", "device cpu"),
    ({"capability": (8, 0)}, "dequant", "sm_80"),
    ({"capability": (10, 0)}, "dequant", "only on sm_90"),
    ({"has_blockwise_scaled_mm": False}, "dequant", "no torch.nn.functional.scaled_mm"),
    ({"cuda_version": (12, 4)}, "dequant", "12.9"),
    ({"block": (1, 128)}, "dequant", "128x128 weight blocks"),
    ({"in_features": 200}, "dequant", "in_features % 128"),
    ({"out_features": 100}, "dequant", "out_features % 16"),
])
def test_fp8_gemm_path_decisions(change, path, why):
    got = fp8_gemm.fp8_gemm_path(**{**_H100, **change})
    assert got.path == path and why in got.reason, got


def test_this_torch_has_the_blockwise_api():
    """The installed torch offers what the CUDA path calls, with these argument names (an
    API change shows up here, on the CPU, not first on a GPU)."""
    assert hasattr(F.ScalingType, "BlockWise1x128") and hasattr(F.ScalingType,
                                                                "BlockWise128x128")
    a = torch.zeros(16, 128, dtype=torch.float8_e4m3fn)
    inspect.signature(F.scaled_mm).bind(
        a, a.t(), torch.ones(16, 1), F.ScalingType.BlockWise1x128, torch.ones(1, 1),
        F.ScalingType.BlockWise128x128, swizzle_a=F.SwizzleType.NO_SWIZZLE,
        swizzle_b=F.SwizzleType.NO_SWIZZLE, output_dtype=torch.bfloat16)
    facts = fp8_gemm._torch_facts(torch.device("cpu"))
    assert facts["has_blockwise_scaled_mm"]


def _fp8_linear(out_f, in_f, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * torch.linspace(0.01, 2.0, in_f)  # uneven blocks
    lin = Linear(in_f, out_f)
    codes, scale = production.quantize_fp8(w)
    production.set_weight(lin, codes, scale, (128, 128))
    return lin


def test_cpu_takes_the_dequant_path():
    lin = _fp8_linear(256, 256)
    p = fp8_gemm.fp8_path_for(lin)
    assert p.path == "dequant" and "cpu" in p.reason
    assert fp8_gemm.scaled_linear(torch.randn(3, 256).bfloat16(), lin) is None


def test_scale_layouts():
    """Weight scales: [in/128, out/128], a transposed view of rows padded to 4 floats (16
    bytes); activation scales: outer-dim-major (stride(0) == 1). Values unchanged."""
    s = torch.rand(3, 5)                                   # [out/128, in/128]
    b = fp8_gemm.weight_scales_layout(s)
    assert b.shape == (5, 3) and b.stride() == (1, 8) and torch.equal(b, s.t())
    a = torch.rand(32, 5)
    al = fp8_gemm.act_scales_layout(a)
    assert al.stride() == (1, 32) and torch.equal(al, a)


def test_activation_quantization_1x128():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 384, generator=g) * torch.logspace(-3, 2, 384)).bfloat16()
    x[2, 128:256] = 0                                       # an all-zero block
    codes, scale = fp8_gemm.quantize_act_1x128(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (7, 3)
    back = codes.float() * scale.repeat_interleave(128, 1)
    block_amax = x.float().abs().view(7, 3, 128).amax(-1).repeat_interleave(128, 1)
    # E4M3: 3 mantissa bits -> at most 2^-4 relative rounding of normal values; values far
    # below their block's maximum fall into subnormals (absolute step 2^-9 * scale)
    err = (back - x.float()).abs()
    assert (err <= 2 ** -4 * x.float().abs() + 2 ** -9 * block_amax / 448 * 1.01).all()
    assert torch.equal(back[2, 128:256], torch.zeros(128))


@pytest.mark.parametrize("M", [1, 37, 130])
def test_emulated_scaled_mm_matches_dequant_path(M):
    """The CUDA product's CPU emulation (activations quantized per 1x128 block, both sides
    dequantized, float32 product) against production.linear's dequant path (bf16 activations,
    weights dequantized tile by tile): the difference is the activation quantization, at most
    2^-4 relative per product term, plus the bf16 roundings of both outputs."""
    lin = _fp8_linear(272, 384)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 384, generator=g).bfloat16()
    want = gemm.linear(x, lin).float()
    codes, scale = fp8_gemm.quantize_act_1x128(x)
    got = fp8_gemm.scaled_mm_emulated(codes, scale, lin.weight, lin.weight_scale).float()
    w = gemm.dequantize_rows(lin, 0, 272).float()
    bound = 2 ** -4 * (x.float().abs() @ w.abs().T) + 2 ** -7 * want.abs() + 1e-3
    assert ((got - want).abs() <= bound).all()
    rel = (got - want).norm() / want.norm()
    assert rel < 0.03, rel       # typical: about 2^-5 of the signal


# ---- grouped MoE -------------------------------------------------------------------------

_GPU = dict(device_type="cuda", capability=(9, 0), has_grouped_mm=True,
            expert_dtypes={torch.bfloat16}, hidden=256, inter=128)


@pytest.mark.parametrize("change,path,why", [
    ({}, "grouped_mm", "torch._grouped_mm"),
    ({"capability": (10, 0)}, "grouped_mm", "sm_90+"),
    ({"capability": (8, 6)}, "loop", "sm_86"),
    ({"has_grouped_mm": False}, "loop", "no torch._grouped_mm"),
    ({"inter": 100}, "loop", "multiples of 8"),
    ({"expert_dtypes": {torch.float8_e4m3fn}}, "loop", "float8_e4m3fn"),
    ({"device_type": "cpu", "capability": None}, "padded_bmm", "CPU"),
    ({"device_type": "cpu", "capability": None, "expert_dtypes": {torch.int8}}, "loop",
     "int8"),
])
def test_moe_path_decisions(change, path, why):
    got = moe_grouped.moe_path(**{**_GPU, **change})
    assert got[0] == path and why in got[1], got


def test_grouped_mm_semantics_match_the_emulation():
    """torch._grouped_mm (its CPU fallback here) with end offsets, empty groups and a
    transposed (column-major) weight view equals the explicit loop: the offsets and layout
    the CUDA path passes mean what moe_grouped assumes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g).bfloat16()
    w = torch.randn(5, 48, 64, generator=g).bfloat16().transpose(1, 2)   # [E, K, N] view
    offs = moe_grouped.offsets(torch.tensor([7, 0, 20, 0, 13]))
    assert offs.dtype == torch.int32 and offs.tolist() == [7, 7, 27, 27, 40]
    got = torch._grouped_mm(x, w, offs=offs).float()
    want = moe_grouped.grouped_mm_emulated(x, w, offs).float()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def prod_model():
    c = ModelConfig.preset("v41-tiny")
    return c, Model.synthetic(c, seed=0, precision="bf16")


@pytest.mark.parametrize("T", [1, 3, 200])
@pytest.mark.parametrize("layer", [0, 1])   # a hash-routed layer and a scored one
def test_grouped_moe_matches_the_loop(prod_model, T, layer):
    """The grouped paths (torch._grouped_mm, its loop emulation, the padded bmm) against the
    per-expert loop on the same layer and inputs: the same bf16 GEMMs summed in other
    orders, so bf16 rounding apart."""
    c, m = prod_model
    moe = m.layers[layer].ffn
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, c.hidden_size, generator=g)
    tok = torch.randint(0, c.vocab_size, (T,), generator=g)
    want = production.moe_forward(moe, x, tok, path="loop")
    tol = dict(rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    for kw in ({"path": "grouped_mm"},
               {"path": "grouped_mm", "grouped_mm": moe_grouped.grouped_mm_emulated},
               {"path": "padded_bmm"}):
        torch.testing.assert_close(production.moe_forward(moe, x, tok, **kw), want, **tol,
                                   msg=lambda s, kw=kw: f"{kw}: {s}")
    assert production.moe_path(moe, x.device) == "padded_bmm"
    torch.testing.assert_close(moe(x, tok), want, **tol)


def test_padded_bmm_pads_small_calls_to_their_token_count_and_declines_sparse_ones(prod_model):
    """A decode-sized call pads every group to its token count (no count is read on the
    host) and equals each group's own GEMMs; a large call with sparse groups would be mostly
    padding, so it declines and the loop runs instead."""
    c, m = prod_model
    moe = m.layers[1].ffn
    w13, _ = moe_grouped.stacked_weights(moe)
    G = w13.shape[0]
    g = torch.Generator().manual_seed(3)
    groups = torch.sort(torch.randint(0, G, (6,), generator=g)).values
    starts = torch.searchsorted(groups, torch.arange(G))
    xs = torch.randn(6, c.hidden_size, generator=g).bfloat16()
    out = moe_grouped.run_routed(moe, "padded_bmm", xs, starts, groups_of_rows=groups, tokens=3)
    experts = list(moe.experts) + ([moe.shared_experts] if G > len(moe.experts) else [])
    want = torch.stack([production.expert_forward(experts[e], xs[i:i + 1])[0]
                        for i, e in enumerate(groups.tolist())])
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2,
                               atol=2e-2 * float(want.float().abs().max()))
    rows = torch.zeros(100, dtype=torch.int64)        # 100 rows, all in group 0
    starts = torch.searchsorted(rows, torch.arange(G))
    assert moe_grouped.run_routed(moe, "padded_bmm", torch.randn(100, c.hidden_size).bfloat16(),
                                  starts, groups_of_rows=rows, tokens=100) is None


def test_stacked_expert_weights_are_held_once(prod_model):
    """The stack the grouped paths read is the experts' own storage (views), built once."""
    c, m = prod_model
    moe = m.layers[1].ffn
    before = production.weight_bytes(m)
    w13, w2 = moe_grouped.stacked_weights(moe)
    assert moe_grouped.stacked_weights(moe)[0] is w13
    inter = c.moe_intermediate_size
    for i, e in enumerate(moe.experts):
        assert e.w1.weight.untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
        assert e.w2.weight.untyped_storage().data_ptr() == w2.untyped_storage().data_ptr()
        assert torch.equal(e.w3.weight, w13[i, inter:])
    assert production.weight_bytes(m) == before
