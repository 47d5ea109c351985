"""What was compiled into dsv41._C, and what the running process sees."""
from __future__ import annotations

import torch


def build_info() -> dict:
    """Facts about the build and the runtime, for `dsv41 info` and bug reports.

    Keys: cuda_compiled, cuda_arch_list, cuda_version (toolkit the kernels were built
    with, or None), torch_version, built_with_torch, torch_cuda_version, cuda_available,
    devices, host_compiler, libstdcxx_loaded (the libstdc++ this process mapped; setup.py
    links against the one torch loads), extension, io_backend ("gds" or "posix": the
    persistent cache's I/O path), io_detail, crc32c.
    """
    from . import __version__
    from ._ext import _C
    from .toolchain import loaded_libstdcxx

    compiled = dict(_C._compiled_config())
    rt = compiled.pop("cuda_runtime_version")
    info = {
        "version": __version__,
        "cuda_compiled": compiled["cuda_compiled"],
        "cuda_arch_list": compiled["cuda_arch_list"].split() if compiled["cuda_compiled"] else [],
        "cuda_version": f"{rt // 1000}.{rt % 1000 // 10}" if rt else None,
        "torch_version": torch.__version__,
        "built_with_torch": compiled["built_with_torch"],
        "torch_cuda_version": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
        "host_compiler": compiled.get("host_compiler"),
        "libstdcxx_loaded": loaded_libstdcxx(),
        "extension": _C.__file__,
    }
    from .cache.io import io_info

    io = io_info()
    info["io_backend"] = io["backend"]
    info["io_detail"] = (f"GPUDirect Storage ({io['gds_detail']})" if io["gds_available"] else
                         f"{io['posix']}; GDS unavailable: {io['gds_detail']}")
    info["crc32c"] = io["crc32c"]
    if info["built_with_torch"] != info["torch_version"]:
        info["warning"] = (f"dsv41._C was built against torch {info['built_with_torch']} but torch "
                           f"{info['torch_version']} is running: rebuild the extension")
    return info
