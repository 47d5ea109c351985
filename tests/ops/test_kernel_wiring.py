"""The CUDA kernels are wired to the ops by name (csrc/bindings/kernels.cpp): checked
without a GPU through the dispatcher's registration table."""
from __future__ import annotations

import pytest
import torch

import dsv41
from dsv41.ops import _kernel_schemas

CUDA_OPS = ["sparse_attention", "indexer_scores", "indexer_scores_at", "topk_visible", "candidate_blocks",
            "copy_blocks", "quantize_nvfp4_scatter", "quantize_mxfp4_scatter", "quantize_fp8_swa_scatter",
            "_dequant_tricks"]
CPU_OPS = ["copy_blocks", "quantize_nvfp4_scatter", "quantize_mxfp4_scatter", "quantize_fp8_swa_scatter",
           "_dequant_tricks"]


def test_every_op_has_a_schema():
    for name in CUDA_OPS:
        assert _kernel_schemas.is_defined(name), name


@pytest.mark.skipif(not dsv41.build_info()["cuda_compiled"], reason="built without CUDA")
def test_cuda_kernels_registered():
    for name in CUDA_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dsv41::{name}", "CUDA"), name


def test_cpu_kernels_registered():
    for name in CPU_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dsv41::{name}", "CPU"), name


def test_fallback_schemas_match_the_contract():
    # Where this module defined a schema (the model's definition absent), it must be the
    # contract's; where the model defined it, the argument lists must agree.
    for name, text in _kernel_schemas.SCHEMAS.items():
        schema = getattr(torch.ops.dsv41, name).default._schema
        assert [a.name for a in schema.arguments] == [
            a.split()[-1] for a in text[text.index("(") + 1:text.index(")")].split(", ")], name


def test_fake_kernels_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        s = torch.empty(3, 100)
        v = torch.empty(3, dtype=torch.int32)
        assert torch.ops.dsv41.topk_visible(s, v, 7).shape == (3, 7)
        assert torch.ops.dsv41.candidate_blocks(s, v, 8, 4).shape == (3, 32)
