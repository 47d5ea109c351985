"""CUDA sparse attention (csrc/cuda/attention*.cu) against the model's float64 reference.

The kernel runs first (before the reference allocates), every case draws fresh inputs,
and the checks are: error <= 2x the bf16-in-torch error + a small absolute term, exact
inf/NaN masks, and exact outputs where the contract fixes them (no valid key: out = 0,
lse = -inf). Every test runs on both tensor-core kernels: the mma.sync kernel (the
default) and the wgmma kernel (DSV41_ATTENTION_IMPL=wgmma, read by the op at each call)."""
from __future__ import annotations

import math

import pytest
import torch

from .kernel_cases import (DEVICE, assert_within_bf16_error, attention_inputs, bf16_attention,
                           reference, replay_window_idx, to_device)

pytestmark = pytest.mark.gpu(cpu_dry_run=True)
ATOL = 2e-4


@pytest.fixture(autouse=True, params=["mma", "wgmma"])
def attention_impl(request, monkeypatch):
    monkeypatch.setenv("DSV41_ATTENTION_IMPL", request.param)
    return request.param


def _run(args):
    dev = to_device(args)
    return [t.cpu() for t in torch.ops.dsv41.sparse_attention(*dev.values())]


def _check(args, what="", atol=ATOL):
    out, lse = _run(args)  # the kernel first
    ref_out, ref_lse = reference().sparse_attention(*args.values())
    base_out, base_lse = bf16_attention(args)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert_within_bf16_error(out, ref_out, base_out, atol, f"out {what}")
    assert_within_bf16_error(lse, ref_lse, base_lse, atol, f"lse {what}")
    return out, lse


@pytest.mark.parametrize("T", [1, 3, 64, 130])
def test_decode_real_shape(T, gen):
    _check(attention_inputs(gen, T), f"T={T}")


def test_several_head_groups(gen):
    _check(attention_inputs(gen, 5, H=128))


@pytest.mark.parametrize("W,K", [(128, 0), (0, 512), (100, 300), (1, 1), (64, 64), (65, 700)])
def test_odd_key_counts(W, K, gen):
    _check(attention_inputs(gen, 4, W=W, K=K, Ns=37, Ng=1001), f"W={W} K={K}")


def test_all_indices_invalid(gen):
    args = attention_inputs(gen, 6)
    args["swa_idx"][2:4] = -1
    args["kv_idx"][2:4] = -1
    args["swa_idx"][5] = -1
    out, lse = _check(args)
    assert torch.equal(out[2:4], torch.zeros_like(out[2:4]))
    assert torch.equal(lse[2:4], torch.full_like(lse[2:4], -math.inf))
    assert torch.isfinite(lse[5]).all()  # only its global entries remain


def test_fewer_visible_than_k(gen):
    args = attention_inputs(gen, 4, p_empty=0.0)
    for t, n in enumerate([0, 1, 37, 511]):
        args["kv_idx"][t, n:] = -1  # top-k padding: fewer visible entries than k
    _check(args)


def test_empty_inputs(gen):
    args = attention_inputs(gen, 0)
    out, lse = _run(args)
    assert out.shape == (0, 64, 512) and lse.shape == (0, 64)
    args = attention_inputs(gen, 3, W=0, K=0)
    out, lse = _run(args)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    args = attention_inputs(gen, 2, Ns=0, Ng=0)  # empty pools: every index is -1
    args["swa_idx"].fill_(-1)
    args["kv_idx"].fill_(-1)
    out, lse = _run(args)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("replay_start", [0, 150, 199])
def test_prefill_window_cut_by_replay_start(replay_start, gen):
    # 200 queries at positions 100..299 over a 256-slot SWA ring; replay from s.
    positions = torch.arange(100, 300)
    args = attention_inputs(gen, 200, Ns=256, K=64)
    args["swa_idx"] = replay_window_idx(positions, replay_start, 128, 256)
    _check(args, f"s={replay_start}")


def test_large_and_tiny_magnitudes(gen):
    # SWA scales above 2^7 take the two-multiply decode; tiny keys exercise subnormal codes.
    _check(attention_inputs(gen, 3, key_scale=3e4, q_scale=1e-4), "large keys")
    _check(attention_inputs(gen, 3, key_scale=1e-3, q_scale=30.0), "tiny keys")


def test_poisoned_block_propagates_nan(gen):
    args = attention_inputs(gen, 3, p_empty=0.0)
    row = int(args["kv_idx"][1, 5])
    args["kv_scales"].view(torch.uint8)[row, 3] = 0x7F  # NaN scale: the whole block decodes to NaN
    out, lse = _check(args)
    # As the reference: a NaN key makes the query's output NaN and its lse -inf.
    assert torch.isnan(out[1]).all() and torch.isneginf(lse[1]).all()
    assert torch.isfinite(out[[0, 2]]).all()


def test_split_counts_agree(gen, monkeypatch):
    args = attention_inputs(gen, 2)
    results = []
    for splits in ("1", "2", "5", "0"):
        monkeypatch.setenv("DSV41_ATTENTION_SPLITS", splits)
        results.append(_check(args, f"splits={splits}"))
    for out, _ in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-3, atol=1e-4)


def test_one_split_is_batch_invariant(gen, monkeypatch):
    # With one split a query's bits do not depend on the batch (chunked == one-shot prefill).
    monkeypatch.setenv("DSV41_ATTENTION_SPLITS", "1")
    args = attention_inputs(gen, 9)
    out_all, lse_all = _run(args)
    part = {k: (v[3:5] if k in ("q", "swa_idx", "kv_idx") else v) for k, v in args.items()}
    out_part, lse_part = _run(part)
    assert torch.equal(out_all[3:5], out_part) and torch.equal(lse_all[3:5], lse_part)


def test_generic_kernel(gen, monkeypatch, attention_impl):
    # Shapes the tensor-core kernel does not take (small models) and the forced fp32 path.
    if attention_impl == "wgmma":
        pytest.skip("the fp32 kernel's test (runs once, under the default)")
    _check(attention_inputs(gen, 5, H=4, D=64, W=16, K=24), "H=4 D=64")
    monkeypatch.setenv("DSV41_ATTENTION_IMPL", "generic")
    _check(attention_inputs(gen, 2), "generic, real shape")


def test_bf16_q_gives_bf16_out(gen):
    """bf16 q at the op: bf16 out = the float32-q result rounded once, lse float32."""
    args = attention_inputs(gen, 5, W=70, K=300, Ns=90, Ng=400)
    args["q"] = args["q"].to(torch.bfloat16)
    out, lse = _run(args)
    args32 = dict(args, q=args["q"].float())
    out32, lse32 = _run(args32)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(out, out32.to(torch.bfloat16)) and torch.equal(lse, lse32)
    ref_out, _ = reference().sparse_attention(*args32.values())
    torch.testing.assert_close(out.float(), ref_out, rtol=2e-2, atol=2e-3)


def test_rejects_bad_arguments(gen):
    if DEVICE == "cpu":
        pytest.skip("argument checks of the CUDA binding")
    args = to_device(attention_inputs(gen, 2))
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.dsv41.sparse_attention(*{**args, "kv_idx": args["kv_idx"].long()}.values())
    with pytest.raises(RuntimeError, match="sink"):
        torch.ops.dsv41.sparse_attention(*{**args, "sink": args["sink"][:3]}.values())


def test_wgmma_refuses_shapes_it_cannot_take(gen, attention_impl):
    if DEVICE == "cpu" or attention_impl != "wgmma":
        pytest.skip("the CUDA binding's kernel choice, under DSV41_ATTENTION_IMPL=wgmma")
    args = to_device(attention_inputs(gen, 2, H=4, D=64, W=16, K=24))
    with pytest.raises(RuntimeError, match="wgmma"):  # an error, never a silent fallback
        torch.ops.dsv41.sparse_attention(*args.values())
