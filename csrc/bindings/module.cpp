// The Python module dsv41._C. Loading it also registers the torch ops defined in the
// other files of this folder (their TORCH_LIBRARY blocks run at load time). Each binding
// file that exposes plain Python functions or classes adds a bind_* hook in bindings.h.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings.h"  // IWYU pragma: keep (the bind_* hooks)

#ifdef DSV41_WITH_CUDA
#include <cuda_runtime_api.h>
#endif
#ifndef DSV41_CUDA_ARCH_LIST
#define DSV41_CUDA_ARCH_LIST ""
#endif
#ifndef DSV41_BUILD_TORCH_VERSION
#define DSV41_BUILD_TORCH_VERSION ""
#endif

PYBIND11_MODULE(_C, m) {
  // Compile-time facts; python/dsv41/_build.py adds the run-time ones.
  m.def("_compiled_config", []() {
    pybind11::dict d;
#ifdef DSV41_WITH_CUDA
    d["cuda_compiled"] = true;
    d["cuda_runtime_version"] = CUDART_VERSION;
#else
    d["cuda_compiled"] = false;
    d["cuda_runtime_version"] = pybind11::none();
#endif
    d["cuda_arch_list"] = std::string(DSV41_CUDA_ARCH_LIST);
    d["built_with_torch"] = std::string(DSV41_BUILD_TORCH_VERSION);
#if defined(__clang__)
    d["host_compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    d["host_compiler"] = std::string("gcc ") + __VERSION__;
#endif
    return d;
  });
  // Each binding file's hook (declared in bindings.h) is called here.
  dsv41::bind_io(m);
  dsv41::bind_remote(m);
  dsv41::bind_kernels(m);
}
