// Hooks through which binding files add plain Python functions and classes to dsv41._C:
// each file defines one `void bind_<area>(pybind11::module_&)`, declared here and called
// from PYBIND11_MODULE in module.cpp. (Torch ops need no hook: TORCH_LIBRARY blocks
// register themselves when the library loads.)
#pragma once

#include <pybind11/pybind11.h>

namespace dsv41 {

// csrc/bindings/io.cpp: the I/O engine as the submodule dsv41._C.io.
void bind_io(pybind11::module_& m);

// csrc/bindings/remote.cpp: the remote tier's values as the submodule dsv41._C.remote.
void bind_remote(pybind11::module_& m);

// csrc/bindings/attention.cpp: the attention, indexer and top-k kernels as the submodule
// dsv41._C.kernels (what the ops in python/dsv41/ops call on CUDA tensors).
void bind_kernels(pybind11::module_& m);

}  // namespace dsv41
