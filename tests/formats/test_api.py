"""dsv41.formats argument checks, the ops as torch custom ops, and torch.compile."""
from __future__ import annotations

import pytest
import torch

import dsv41
from dsv41 import formats


@pytest.mark.parametrize("reference", [False, True])
def test_bad_inputs_get_clear_errors(reference):
    with pytest.raises(TypeError, match="x must be float32, got torch.bfloat16"):
        formats.quantize_nvfp4(torch.zeros(4, 16, dtype=torch.bfloat16), reference=reference)
    with pytest.raises(ValueError, match=r"last dimension \(24\) must be a multiple of the 16"):
        formats.quantize_nvfp4(torch.zeros(4, 24), reference=reference)
    with pytest.raises(ValueError, match="multiple of the 32"):
        formats.quantize_mxfp4(torch.zeros(2, 48), reference=reference)
    with pytest.raises(ValueError, match="at least one dimension"):
        formats.quantize_fp8_swa(torch.tensor(1.0), reference=reference)
    codes, scales = formats.quantize_nvfp4(torch.zeros(4, 32))
    with pytest.raises(ValueError, match="disagree on the leading dimensions"):
        formats.dequantize_nvfp4(codes, scales[:3], reference=reference)
    with pytest.raises(ValueError, match="needs 2 scales of 16, but scales has 1"):
        formats.dequantize_nvfp4(codes, scales[:, :1], reference=reference)
    with pytest.raises(TypeError, match="scales must be torch.float8_e4m3fn, got torch.uint8"):
        formats.dequantize_nvfp4(codes, scales.view(torch.uint8), reference=reference)
    with pytest.raises(TypeError, match="codes must be torch.float8_e4m3fn"):
        formats.dequantize_fp8_swa(codes, torch.zeros(4, 1, dtype=torch.uint8), reference=reference)


def test_into_rejects_non_contiguous_and_misshaped_buffers():
    x = torch.randn(4, 64)
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    scales = torch.zeros(4, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="must be contiguous"):
        formats.quantize_mxfp4_into(x, codes[:, ::2], scales)
    with pytest.raises(ValueError, match=r"codes has shape \(4, 64\), expected \(4, 32\)"):
        formats.quantize_mxfp4_into(x, codes, torch.zeros(4, 4, dtype=torch.uint8))


def test_the_cpp_op_checks_too():
    # C++ callers reach the op without the Python checks: it must refuse bad input itself.
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.dsv41.quantize_nvfp4(torch.zeros(2, 16, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="multiple of the 32-value block"):
        torch.ops.dsv41.quantize_fp8_swa(torch.zeros(2, 16))
    codes = torch.zeros(2, 8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="needs 1 scales of 16"):
        torch.ops.dsv41.dequantize_nvfp4(codes, torch.zeros(2, 3, dtype=torch.float8_e4m3fn))
    with pytest.raises(RuntimeError, match="must be contiguous"):
        torch.ops.dsv41.quantize_mxfp4_into(torch.zeros(2, 32), torch.zeros(2, 32, dtype=torch.uint8)[:, ::2],
                                            torch.zeros(2, 1, dtype=torch.uint8))


def test_ops_are_registered_custom_ops_with_fake_kernels():
    x = torch.randn(3, 64)
    for name in ("nvfp4", "mxfp4", "fp8_swa"):
        # opcheck's schema test does arithmetic on the outputs, which torch lacks for
        # float8 on the CPU: run it only where every tensor is plain bytes or float32.
        tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic") if name == "mxfp4" \
            else ("test_faketensor", "test_aot_dispatch_dynamic")
        quant = getattr(torch.ops.dsv41, f"quantize_{name}")
        torch.library.opcheck(quant, (x,), test_utils=tests)
        codes, scales = quant(x)
        torch.library.opcheck(getattr(torch.ops.dsv41, f"dequantize_{name}"), (codes, scales),
                              test_utils=tests)
        into = getattr(torch.ops.dsv41, f"quantize_{name}_into")
        torch.library.opcheck(into, (x, torch.empty_like(codes), torch.empty_like(scales)),
                              test_utils=tests)


def test_ops_run_under_torch_compile():
    def roundtrip(x):
        c, s = torch.ops.dsv41.quantize_nvfp4(x * 2)
        return torch.ops.dsv41.dequantize_nvfp4(c, s) + 1

    x = torch.randn(5, 32)
    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), roundtrip(x))


def test_build_info_reports_the_build():
    info = dsv41.build_info()
    for key in ("cuda_compiled", "cuda_arch_list", "torch_version", "cuda_version"):
        assert key in info
    assert info["torch_version"] == torch.__version__
    if info["cuda_compiled"]:
        assert info["cuda_arch_list"] and info["cuda_version"]
