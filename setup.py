"""Build dsv41 and its extension dsv41._C.

What gets compiled:
  * always: the framework-free CPU ops (csrc/cpu) and the one torch binding file
    (csrc/bindings), with the headers in include/;
  * always: the I/O engine (csrc/io: thread pool, pread/pwrite with O_DIRECT, CRC-32C);
  * with CUDA: the kernels in csrc/cuda, for TORCH_CUDA_ARCH_LIST (default "9.0a", i.e.
    -gencode=arch=compute_90a,code=sm_90a), and the GPUDirect Storage path when cufile.h
    is found (the toolkit's or the nvidia-cufile wheel's; DSV41_CUFILE=0 leaves it out).
    libcufile itself is loaded with dlopen at run time, never linked.

libstdc++: the extension links against the very libstdc++ the running torch loaded (by full
path, ahead of the compiler driver's own -lstdc++), and the build fails if the linked
extension still defines libstdc++'s own symbols (dsv41/toolchain.py says why: a private
copy of libstdc++ crashes every error message that formats a number).

CUDA is used when torch is a CUDA build and nvcc is found (CUDA_HOME, else
/usr/local/cuda, else nvcc on PATH); DSV41_CUDA=0 or 1 forces either way (1 fails loudly
if CUDA cannot be used). No GPU is needed to compile. Install with
`pip install --no-build-isolation .` so the build uses the torch you run with.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCH_LIST = "9.0a"


def _load_toolchain():
    """python/dsv41/toolchain.py by path: the package itself is not importable yet."""
    spec = importlib.util.spec_from_file_location(
        "dsv41_toolchain", os.path.join(ROOT, "python", "dsv41", "toolchain.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


toolchain = _load_toolchain()


def _is_toolkit(home: str | None) -> bool:
    # An nvcc wrapper on PATH (e.g. /usr/local/bin/nvcc) does not make /usr/local a toolkit.
    return bool(home) and os.path.exists(os.path.join(home, "bin", "nvcc")) and \
        os.path.exists(os.path.join(home, "include", "cuda_runtime.h"))


def _find_cuda_home() -> str | None:
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                  os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None]
    return next((c for c in candidates if _is_toolkit(c)), None)


def _find_cufile_include(cuda_home: str | None) -> str | None:
    """The folder holding cufile.h (the toolkit's, else the nvidia-cufile wheel's), or None.
    Only the header is needed at build time: libcufile is loaded with dlopen at run time."""
    import site
    import sysconfig

    roots = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    candidates = [os.path.join(cuda_home, "include")] if cuda_home else []
    for root in roots:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "include")))
        candidates.append(os.path.join(root, "nvidia", "cufile", "include"))
    return next((c for c in candidates if os.path.exists(os.path.join(c, "cufile.h"))), None)


def _want_cuda(torch_cuda: str | None, cuda_home: str | None) -> bool:
    forced = os.environ.get("DSV41_CUDA")
    if forced not in (None, "", "0", "1"):
        sys.exit(f"DSV41_CUDA must be 0 or 1, got {forced!r}")
    if forced == "0":
        return False
    usable = bool(torch_cuda and cuda_home)
    if forced == "1" and not usable:
        why = "torch is a CPU-only build" if not torch_cuda else "nvcc was not found (set CUDA_HOME)"
        sys.exit(f"DSV41_CUDA=1 but CUDA cannot be used: {why}")
    return usable


def _extensions():
    if os.environ.get("DSV41_NO_EXT") == "1":
        return [], {}  # editable wiring only: the extension is built in place separately
    # cpp_extension reads CUDA_HOME when it is imported: settle it first.
    cuda_home = _find_cuda_home()
    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home
    import torch
    from torch.utils import cpp_extension as ext

    use_cuda = _want_cuda(torch.version.cuda, cuda_home)
    sources = (sorted(glob.glob("csrc/cpu/*.cpp")) + sorted(glob.glob("csrc/io/*.cpp"))
               + sorted(glob.glob("csrc/bindings/*.cpp")))
    # torch sets the C++ standard (C++20 for torch >= 2.10). Hidden visibility, as pybind11
    # asks, so classes bound with it do not export more than pybind11's own types.
    cxx = ["-O3", "-fvisibility=hidden"]
    nvcc = ["-O3", "-lineinfo"]
    compiler = toolchain.compiler_info()
    libstdcxx = toolchain.loaded_libstdcxx()
    macros = [("DSV41_BUILD_TORCH_VERSION", f'"{torch.__version__}"')]
    kwargs = dict(
        name="dsv41._C",
        include_dirs=[os.path.join(ROOT, "include")],
        define_macros=macros,
        # Listed before the driver's implicit -lstdc++, the runtime's libstdc++ resolves every
        # std:: reference, so no member of a libstdc++.a (a toolchain's -static-libstdc++, or
        # a lib folder without libstdc++.so) is ever pulled in.
        extra_link_args=[libstdcxx] if libstdcxx else [],
    )
    if use_cuda:
        arch_list = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        macros += [("DSV41_WITH_CUDA", "1"), ("DSV41_CUDA_ARCH_LIST", f'"{arch_list}"')]
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        cufile_include = _find_cufile_include(cuda_home)
        if cufile_include and os.environ.get("DSV41_CUFILE") != "0":
            # The header by full path, not its folder on the include path: a wheel's include
            # folder also holds CUDA headers that must not shadow the toolkit's.
            header = os.path.join(cufile_include, "cufile.h")
            macros += [("DSV41_WITH_CUFILE", "1"), ("DSV41_CUFILE_HEADER", f'"{header}"')]
        module = ext.CUDAExtension(sources=sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                                   **kwargs)
    else:
        module = ext.CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **kwargs)
    cufile = ("DSV41_WITH_CUFILE", "1") in macros
    print(f"dsv41: building with CUDA={'yes' if use_cuda else 'no'}"
          + (f" (CUDA_HOME={cuda_home}, arch={os.environ['TORCH_CUDA_ARCH_LIST']}, "
             f"cuFile={'yes' if cufile else 'no'})" if use_cuda else "")
          + f"; C++ compiler {compiler['path'] or compiler['cxx']} ({compiler['version']});"
          f" libstdc++ {libstdcxx or 'not found in this process: link not pinned'}")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    return [module], {"build_ext": _checked_build_ext(ext.BuildExtension.with_options(use_ninja=True),
                                                      libstdcxx)}


def _checked_build_ext(base, libstdcxx: str | None):
    """torch's build_ext, then the post-link check of toolchain.check_linked_extension: an
    extension that defines libstdc++'s own symbols is removed and the build fails."""

    class CheckedBuildExt(base):
        def build_extension(self, extension):
            super().build_extension(extension)
            if not libstdcxx:
                return
            path = self.get_ext_fullpath(extension.name)
            try:
                toolchain.check_linked_extension(path, libstdcxx)
            except toolchain.PrivateLibstdcxxError as e:
                sys.exit(f"dsv41: {e}")
            print(f"dsv41: {os.path.basename(path)} defines no libstdc++ symbols of its own "
                  f"(checked against {libstdcxx})")

    return CheckedBuildExt


ext_modules, cmdclass = _extensions()

setup(
    name="dsv41",
    version="0.1.0",
    description="A runtime for DeepSeek-V4.1-Flash-style models: FP4 global KV, SWA replay, tiered prefix cache",
    package_dir={"": "python"},
    packages=find_packages("python"),
    package_data={"dsv41.eval": ["defaults/*.yaml"],
                  "dsv41.checkpoints": ["*/*.json", "*/*.jsonl", "*/*.safetensors", "*/*.png", "*/*.md"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "numpy", "pyyaml"],
    extras_require={"test": ["pytest", "pytest-benchmark", "openai", "httpx"], "eval": ["matplotlib"],
                    "gpu": ["cupy-cuda13x", "nvtx"],
                    "serve": ["fastapi", "uvicorn", "pydantic>=2", "tokenizers", "jinja2"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["dsv41=dsv41.cli:main"]},
    zip_safe=False,
)
