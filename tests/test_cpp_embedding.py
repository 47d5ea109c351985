"""dsv41's ops called from C++ through the torch dispatcher (examples/cpp/call_dsv41_ops.cpp),
the way a C++ server embeds them. Compiles a small library once per machine (cached)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch.utils import cpp_extension

import dsv41
from dsv41 import formats

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpp" / "call_dsv41_ops.cpp"


def test_cpp_caller_gets_the_same_bits_as_python(tmp_path):
    assert dsv41.build_info()["cuda_compiled"] in (True, False)  # the ops library is loaded
    cpp_extension.load(name="dsv41_cpp_example", sources=[str(EXAMPLE)], is_python_module=False,
                       extra_cflags=["-O1"], verbose=False)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    from_cpp = torch.ops.dsv41_cpp_example.nvfp4_roundtrip(x)
    from_python = formats.dequantize_nvfp4(*formats.quantize_nvfp4(x, reference=True), reference=True)
    assert torch.equal(from_cpp.view(torch.int32), from_python.view(torch.int32))
