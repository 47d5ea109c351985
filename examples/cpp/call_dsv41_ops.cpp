// Calling dsv41's ops from C++ (a server embedding dsv41): load the library that holds the
// ops (dsv41/_C*.so, e.g. with dlopen or torch::dynamic_library), then look the ops up in
// the torch dispatcher by name. CPU and CUDA tensors both work; the dispatcher picks the
// kernel. This file is compiled and run by tests/test_cpp_embedding.py.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

namespace {

std::tuple<at::Tensor, at::Tensor> quantize_nvfp4(const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dsv41::quantize_nvfp4", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)>();
  return op.call(x);
}

at::Tensor dequantize_nvfp4(const at::Tensor& codes, const at::Tensor& scales) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dsv41::dequantize_nvfp4", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(codes, scales);
}

// Example use: the NVFP4 round trip of a tensor, as a server would store and read KV.
at::Tensor nvfp4_roundtrip(const at::Tensor& x) {
  auto [codes, scales] = quantize_nvfp4(x);
  return dequantize_nvfp4(codes, scales);
}

}  // namespace

TORCH_LIBRARY(dsv41_cpp_example, m) { m.def("nvfp4_roundtrip(Tensor x) -> Tensor", &nvfp4_roundtrip); }
