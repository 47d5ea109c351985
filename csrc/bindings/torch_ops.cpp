// The torch ops: argument checks, output allocation and dispatch to the framework-free
// CPU loops and CUDA launchers. Ops live in the `dsv41` torch.library
// namespace (CPU and CUDA kernels here; fake/meta kernels in python/dsv41/ops/_fake.py),
// so they work from Python, from C++ (torch::Dispatcher) and under torch.compile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <tuple>

#include "dsv41/codec_ops.h"

#ifdef DSV41_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace dsv41 {
namespace {

struct CodecInfo {
  Codec codec;
  const char* name;           // format name used in error messages
  c10::ScalarType code_type;  // dtype of the codes / values tensor
  c10::ScalarType scale_type; // dtype of the scales tensor
  int64_t values_per_code;    // elements per code byte: 2 for FP4, 1 for FP8
};

constexpr CodecInfo kNvfp4{Codec::kNvfp4, "nvfp4", at::kByte, at::kFloat8_e4m3fn, 2};
constexpr CodecInfo kMxfp4{Codec::kMxfp4, "mxfp4", at::kByte, at::kByte, 2};
constexpr CodecInfo kFp8Swa{Codec::kFp8Swa, "fp8_swa", at::kFloat8_e4m3fn, at::kByte, 1};

bool scale_dtype_ok(const CodecInfo& ci, c10::ScalarType t) {
  // UE8M0 scales may come as raw bytes or as torch's float8_e8m0fnu (same bits).
  return t == ci.scale_type || (ci.scale_type == at::kByte && t == at::kFloat8_e8m0fnu);
}

// Block count of x, after checking what every quantizer needs.
int64_t check_quantize_input(const CodecInfo& ci, const at::Tensor& x) {
  const int block = codec_block(ci.codec);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quantize_", ci.name,
              ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "quantize_", ci.name, ": x must have at least one dimension");
  TORCH_CHECK(x.size(-1) % block == 0, "quantize_", ci.name, ": last dimension (",
              x.size(-1), ") must be a multiple of the ", block, "-value block");
  return x.numel() / block;
}

// Contiguous and 16-byte aligned (the CUDA kernels load float4); copies only if needed.
at::Tensor as_aligned_contiguous(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

std::vector<int64_t> with_last(at::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out(sizes.begin(), sizes.end());
  out.back() = last;
  return out;
}

void check_codes_scales(const CodecInfo& ci, const at::Tensor& codes, const at::Tensor& scales,
                        const char* op) {
  const int block = codec_block(ci.codec);
  TORCH_CHECK(codes.scalar_type() == ci.code_type, op, ": codes must be ", ci.code_type,
              ", got ", codes.scalar_type());
  TORCH_CHECK(scale_dtype_ok(ci, scales.scalar_type()), op, ": scales must be ",
              ci.scale_type, ", got ", scales.scalar_type());
  TORCH_CHECK(codes.dim() >= 1 && codes.dim() == scales.dim(), op,
              ": codes and scales must have the same number of dimensions (got ", codes.dim(),
              " and ", scales.dim(), ")");
  TORCH_CHECK(codes.sizes().slice(0, codes.dim() - 1) == scales.sizes().slice(0, scales.dim() - 1),
              op, ": codes ", codes.sizes(), " and scales ", scales.sizes(),
              " disagree on the leading dimensions");
  const int64_t d = codes.size(-1) * ci.values_per_code;
  TORCH_CHECK(d % block == 0 && scales.size(-1) * block == d, op, ": codes ", codes.sizes(),
              " hold ", d, " values per row, which needs ", d / block, " scales of ", block,
              " (a row length that is a multiple of ", block, "), but scales has ",
              scales.size(-1));
  TORCH_CHECK(codes.device() == scales.device(), op, ": codes on ", codes.device(),
              " but scales on ", scales.device());
}

#ifdef DSV41_WITH_CUDA
void check_cuda(int err, const char* op) {
  TORCH_CHECK(err == 0, op, ": CUDA launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}
#endif

void run_quantize(const CodecInfo& ci, const at::Tensor& x, at::Tensor& codes,
                  at::Tensor& scales, int64_t n_blocks) {
  const float* xp = x.const_data_ptr<float>();
  auto* cp = static_cast<uint8_t*>(codes.data_ptr());
  auto* sp = static_cast<uint8_t*>(scales.data_ptr());
  if (x.is_cuda()) {
#ifdef DSV41_WITH_CUDA
    c10::cuda::CUDAGuard guard(x.device());
    check_cuda(cuda::quantize(ci.codec, xp, n_blocks, cp, sp,
                              c10::cuda::getCurrentCUDAStream().stream()),
               "quantize");
    return;
#else
    TORCH_CHECK(false, "quantize_", ci.name, ": dsv41 was built without CUDA");
#endif
  }
  const int64_t code_bytes = codec_code_bytes(ci.codec), block = codec_block(ci.codec);
  at::parallel_for(0, n_blocks, 2048, [&](int64_t b, int64_t e) {
    cpu::quantize(ci.codec, xp + b * block, e - b, cp + b * code_bytes, sp + b);
  });
}

std::tuple<at::Tensor, at::Tensor> quantize(const CodecInfo& ci, const at::Tensor& x_in) {
  const int64_t n_blocks = check_quantize_input(ci, x_in);
  const at::Tensor x = as_aligned_contiguous(x_in);
  const int64_t d = x.size(-1);
  at::Tensor codes = at::empty(with_last(x.sizes(), d / ci.values_per_code),
                               x.options().dtype(ci.code_type));
  at::Tensor scales = at::empty(with_last(x.sizes(), d / codec_block(ci.codec)),
                                x.options().dtype(ci.scale_type));
  run_quantize(ci, x, codes, scales, n_blocks);
  return {codes, scales};
}

// Writes into caller-owned buffers (slices of a KV cache, for instance): these must be
// contiguous, aligned for the kernels' wide stores, and exactly the right shape.
void quantize_into(const CodecInfo& ci, const at::Tensor& x_in, at::Tensor codes,
                   at::Tensor scales) {
  const int64_t n_blocks = check_quantize_input(ci, x_in);
  check_codes_scales(ci, codes, scales, "quantize_into");
  const int64_t d = x_in.size(-1);
  TORCH_CHECK(codes.sizes() == at::IntArrayRef(with_last(x_in.sizes(), d / ci.values_per_code)),
              "quantize_", ci.name, "_into: codes has shape ", codes.sizes(), ", expected ",
              with_last(x_in.sizes(), d / ci.values_per_code));
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "quantize_", ci.name,
              "_into: codes and scales must be contiguous");
  TORCH_CHECK(codes.device() == x_in.device(), "quantize_", ci.name, "_into: x on ",
              x_in.device(), " but codes on ", codes.device());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(codes.data_ptr()) % (ci.values_per_code == 2 ? 2 : 4) == 0,
              "quantize_", ci.name, "_into: codes must be aligned to ",
              (ci.values_per_code == 2 ? 2 : 4), " bytes");
  const at::Tensor x = as_aligned_contiguous(x_in);
  run_quantize(ci, x, codes, scales, n_blocks);
}

at::Tensor dequantize(const CodecInfo& ci, const at::Tensor& codes_in, const at::Tensor& scales_in) {
  check_codes_scales(ci, codes_in, scales_in, (std::string("dequantize_") + ci.name).c_str());
  at::Tensor codes = codes_in.contiguous();
  if (reinterpret_cast<uintptr_t>(codes.data_ptr()) % 4 != 0) codes = codes.clone();
  const at::Tensor scales = scales_in.contiguous();
  const int block = codec_block(ci.codec);
  const int64_t d = codes.size(-1) * ci.values_per_code;
  at::Tensor y = at::empty(with_last(codes.sizes(), d), codes.options().dtype(at::kFloat));
  const int64_t n_blocks = y.numel() / block;
  const auto* cp = static_cast<const uint8_t*>(codes.const_data_ptr());
  const auto* sp = static_cast<const uint8_t*>(scales.const_data_ptr());
  float* yp = y.data_ptr<float>();
  if (codes.is_cuda()) {
#ifdef DSV41_WITH_CUDA
    c10::cuda::CUDAGuard guard(codes.device());
    check_cuda(cuda::dequantize(ci.codec, cp, sp, n_blocks, yp,
                                c10::cuda::getCurrentCUDAStream().stream()),
               "dequantize");
    return y;
#else
    TORCH_CHECK(false, "dequantize_", ci.name, ": dsv41 was built without CUDA");
#endif
  }
  const int64_t code_bytes = codec_code_bytes(ci.codec);
  at::parallel_for(0, n_blocks, 2048, [&](int64_t b, int64_t e) {
    cpu::dequantize(ci.codec, cp + b * code_bytes, sp + b, e - b, yp + b * block);
  });
  return y;
}

// One named function per op: the dispatcher wants plain function pointers.
#define DSV41_CODEC_OPS(NAME, INFO)                                                          \
  std::tuple<at::Tensor, at::Tensor> quantize_##NAME(const at::Tensor& x) {                 \
    return quantize(INFO, x);                                                                \
  }                                                                                          \
  void quantize_##NAME##_into(const at::Tensor& x, at::Tensor codes, at::Tensor scales) {   \
    quantize_into(INFO, x, codes, scales);                                                   \
  }                                                                                          \
  at::Tensor dequantize_##NAME(const at::Tensor& codes, const at::Tensor& scales) {         \
    return dequantize(INFO, codes, scales);                                                  \
  }

DSV41_CODEC_OPS(nvfp4, kNvfp4)
DSV41_CODEC_OPS(mxfp4, kMxfp4)
DSV41_CODEC_OPS(fp8_swa, kFp8Swa)
#undef DSV41_CODEC_OPS

// ---- FP8 V4 main KV (packed entries, formats.h) --------------------------------------

// The no-RoPE / RoPE split of a head_dim, after checking the format can hold it.
Fp8V4Shape fp8_v4_shape(int64_t head_dim, int64_t rope_dim, const char* op) {
  TORCH_CHECK(rope_dim >= 0 && rope_dim < head_dim, op, ": rope_dim must be in [0, head_dim=",
              head_dim, "), got ", rope_dim);
  const int64_t nope = head_dim - rope_dim;
  TORCH_CHECK(nope % fmt::kFp8V4Tile == 0, op, ": the no-RoPE dims (head_dim ", head_dim,
              " - rope_dim ", rope_dim, " = ", nope, ") must be a multiple of the ",
              fmt::kFp8V4Tile, "-value scale tile");
  TORCH_CHECK(head_dim <= (1 << 24), op, ": head_dim ", head_dim, " is too large");
  return {static_cast<int>(nope), static_cast<int>(rope_dim)};
}

Fp8V4Shape check_fp8_v4_input(const at::Tensor& x, int64_t rope_dim, double floor,
                              const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension");
  TORCH_CHECK(std::isfinite(floor) && floor >= 0, op,
              ": amax_floor must be finite and >= 0, got ", floor);
  return fp8_v4_shape(x.size(-1), rope_dim, op);
}

void run_fp8_v4_quantize(const at::Tensor& x, Fp8V4Shape shape, double floor, at::Tensor& out,
                         const char* op) {
  const int64_t n = x.numel() / (shape.nope + shape.rope);
  const float* xp = x.const_data_ptr<float>();
  auto* op_ = static_cast<uint8_t*>(out.data_ptr());
  const float f = static_cast<float>(floor);
  if (x.is_cuda()) {
#ifdef DSV41_WITH_CUDA
    c10::cuda::CUDAGuard guard(x.device());
    check_cuda(cuda::fp8_v4_quantize(xp, n, shape, f, op_,
                                     c10::cuda::getCurrentCUDAStream().stream()),
               op);
    return;
#else
    TORCH_CHECK(false, op, ": dsv41 was built without CUDA");
#endif
  }
  const int64_t in_stride = shape.nope + shape.rope;
  const int64_t out_stride = fmt::fp8_v4_entry_bytes(shape.nope, shape.rope);
  at::parallel_for(0, n, 256, [&](int64_t b, int64_t e) {
    cpu::fp8_v4_quantize(xp + b * in_stride, e - b, shape, f, op_ + b * out_stride);
  });
}

at::Tensor quantize_fp8_v4(const at::Tensor& x_in, int64_t rope_dim, double amax_floor) {
  const Fp8V4Shape shape = check_fp8_v4_input(x_in, rope_dim, amax_floor, "quantize_fp8_v4");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(with_last(x.sizes(), fmt::fp8_v4_entry_bytes(shape.nope, shape.rope)),
                             x.options().dtype(at::kByte));
  run_fp8_v4_quantize(x, shape, amax_floor, out, "quantize_fp8_v4");
  return out;
}

void quantize_fp8_v4_into(const at::Tensor& x_in, int64_t rope_dim, double amax_floor,
                          at::Tensor entries) {
  const char* op = "quantize_fp8_v4_into";
  const Fp8V4Shape shape = check_fp8_v4_input(x_in, rope_dim, amax_floor, op);
  const auto want = with_last(x_in.sizes(), fmt::fp8_v4_entry_bytes(shape.nope, shape.rope));
  TORCH_CHECK(entries.scalar_type() == at::kByte, op, ": entries must be uint8, got ",
              entries.scalar_type());
  TORCH_CHECK(entries.sizes() == at::IntArrayRef(want), op, ": entries has shape ",
              entries.sizes(), ", expected ", at::IntArrayRef(want));
  TORCH_CHECK(entries.is_contiguous(), op, ": entries must be contiguous");
  TORCH_CHECK(entries.device() == x_in.device(), op, ": x on ", x_in.device(),
              " but entries on ", entries.device());
  const at::Tensor x = x_in.contiguous();
  run_fp8_v4_quantize(x, shape, amax_floor, entries, op);
}

at::Tensor dequantize_fp8_v4(const at::Tensor& entries_in, int64_t head_dim, int64_t rope_dim) {
  const char* op = "dequantize_fp8_v4";
  const Fp8V4Shape shape = fp8_v4_shape(head_dim, rope_dim, op);
  const int64_t entry_bytes = fmt::fp8_v4_entry_bytes(shape.nope, shape.rope);
  TORCH_CHECK(entries_in.scalar_type() == at::kByte, op, ": entries must be uint8, got ",
              entries_in.scalar_type());
  TORCH_CHECK(entries_in.dim() >= 1 && entries_in.size(-1) == entry_bytes, op, ": entries ",
              entries_in.sizes(), " must have a last dimension of ", entry_bytes,
              " bytes (head_dim ", head_dim, ", rope_dim ", rope_dim, ")");
  const at::Tensor entries = entries_in.contiguous();
  at::Tensor y = at::empty(with_last(entries.sizes(), head_dim), entries.options().dtype(at::kFloat));
  const int64_t n = entries.numel() / entry_bytes;
  const auto* ip = static_cast<const uint8_t*>(entries.const_data_ptr());
  float* yp = y.data_ptr<float>();
  if (entries.is_cuda()) {
#ifdef DSV41_WITH_CUDA
    c10::cuda::CUDAGuard guard(entries.device());
    check_cuda(cuda::fp8_v4_dequantize(ip, n, shape, yp,
                                       c10::cuda::getCurrentCUDAStream().stream()),
               op);
    return y;
#else
    TORCH_CHECK(false, op, ": dsv41 was built without CUDA");
#endif
  }
  at::parallel_for(0, n, 256, [&](int64_t b, int64_t e) {
    cpu::fp8_v4_dequantize(ip + b * entry_bytes, e - b, shape, yp + b * head_dim);
  });
  return y;
}

}  // namespace
}  // namespace dsv41

// Schemas are string literals (the dispatcher parses them at load time).
#define DSV41_DEF_CODEC_OPS(m, NAME)                                                       \
  m.def("quantize_" #NAME "(Tensor x) -> (Tensor codes, Tensor scales)");                 \
  m.def("quantize_" #NAME "_into(Tensor x, Tensor(a!) codes, Tensor(b!) scales) -> ()");  \
  m.def("dequantize_" #NAME "(Tensor codes, Tensor scales) -> Tensor");

TORCH_LIBRARY(dsv41, m) {
  DSV41_DEF_CODEC_OPS(m, nvfp4)
  DSV41_DEF_CODEC_OPS(m, mxfp4)
  DSV41_DEF_CODEC_OPS(m, fp8_swa)
  m.def("quantize_fp8_v4(Tensor x, int rope_dim, float amax_floor) -> Tensor");
  m.def("quantize_fp8_v4_into(Tensor x, int rope_dim, float amax_floor, Tensor(a!) entries) -> ()");
  m.def("dequantize_fp8_v4(Tensor entries, int head_dim, int rope_dim) -> Tensor");
}

#define DSV41_IMPL_FP8_V4_OPS(m)                                      \
  m.impl("quantize_fp8_v4", &dsv41::quantize_fp8_v4);                 \
  m.impl("quantize_fp8_v4_into", &dsv41::quantize_fp8_v4_into);       \
  m.impl("dequantize_fp8_v4", &dsv41::dequantize_fp8_v4);

#define DSV41_IMPL_CODEC_OPS(m, NAME)                               \
  m.impl("quantize_" #NAME, &dsv41::quantize_##NAME);               \
  m.impl("quantize_" #NAME "_into", &dsv41::quantize_##NAME##_into); \
  m.impl("dequantize_" #NAME, &dsv41::dequantize_##NAME);

TORCH_LIBRARY_IMPL(dsv41, CPU, m) {
  DSV41_IMPL_CODEC_OPS(m, nvfp4)
  DSV41_IMPL_CODEC_OPS(m, mxfp4)
  DSV41_IMPL_CODEC_OPS(m, fp8_swa)
  DSV41_IMPL_FP8_V4_OPS(m)
}

#ifdef DSV41_WITH_CUDA
TORCH_LIBRARY_IMPL(dsv41, CUDA, m) {
  DSV41_IMPL_CODEC_OPS(m, nvfp4)
  DSV41_IMPL_CODEC_OPS(m, mxfp4)
  DSV41_IMPL_CODEC_OPS(m, fp8_swa)
  DSV41_IMPL_FP8_V4_OPS(m)
}
#endif
