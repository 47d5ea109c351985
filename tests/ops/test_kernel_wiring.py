"""The CUDA kernels are wired to the ops by name: the attention, indexer and top-k ops by
their Python CUDA kernels (ops/attention.py, ops/selection.py: register_kernel("cuda")),
the cache ops by csrc/bindings/kernels.cpp. Checked without a GPU through the dispatcher's
registration table."""
from __future__ import annotations

import pytest
import torch

import dsv41

CUDA_OPS = ["sparse_attention", "indexer_scores", "indexer_scores_at", "topk_visible", "candidate_blocks",
            "copy_blocks", "quantize_nvfp4_scatter", "quantize_mxfp4_scatter", "quantize_fp8_swa_scatter",
            "_dequant_tricks"]
CPU_OPS = ["copy_blocks", "quantize_nvfp4_scatter", "quantize_mxfp4_scatter", "quantize_fp8_swa_scatter",
           "_dequant_tricks"]


def test_every_op_has_a_schema():
    # The attention/indexer/top-k schemas come from python/dsv41/ops/{attention,selection}.py,
    # the cache ops' from csrc/bindings/kernels.cpp.
    for name in CUDA_OPS:
        torch._C._dispatch_find_schema_or_throw(f"dsv41::{name}", "")


@pytest.mark.skipif(not dsv41.build_info()["cuda_compiled"], reason="built without CUDA")
def test_cuda_kernels_registered():
    for name in CUDA_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dsv41::{name}", "CUDA"), name


def test_cpu_kernels_registered():
    for name in CPU_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dsv41::{name}", "CPU"), name


def test_fake_kernels_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        s = torch.empty(3, 100)
        v = torch.empty(3, dtype=torch.int32)
        assert torch.ops.dsv41.topk_visible(s, v, 7).shape == (3, 7)
        assert torch.ops.dsv41.candidate_blocks(s, v, 8, 4).shape == (3, 32)
