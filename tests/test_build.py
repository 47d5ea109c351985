"""The build itself: CUDA kernels must be compiled wherever they can be (CI has nvcc and a
CUDA build of torch but no GPU), so a broken kernel cannot hide behind a CPU-only build."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import dsv41


def _toolkit_present() -> bool:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return bool(torch.version.cuda) and (os.path.exists(os.path.join(home, "bin", "nvcc"))
                                         or shutil.which("nvcc") is not None)


@pytest.mark.skipif(os.environ.get("DSV41_CUDA") == "0", reason="CUDA build disabled by DSV41_CUDA=0")
def test_cuda_kernels_were_compiled_when_a_toolkit_is_present():
    info = dsv41.build_info()
    if not _toolkit_present():
        pytest.skip("no CUDA toolkit or CPU-only torch: a CPU-only build is expected")
    assert info["cuda_compiled"], "nvcc and a CUDA torch are present but dsv41._C has no CUDA kernels"
    assert info["cuda_arch_list"], "no CUDA architectures recorded"


def test_extension_matches_the_running_torch():
    info = dsv41.build_info()
    assert "warning" not in info, info.get("warning")
