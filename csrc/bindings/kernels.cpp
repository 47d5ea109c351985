// Torch ops of the cache kernels (include/dsv41/kernels.h): copy_blocks, quantize_*_scatter
// and the decoder self-check _dequant_tricks, defined here with CPU and CUDA kernels. (The
// attention, indexer and top-k ops are defined in python/dsv41/ops; their kernels are
// reached through csrc/bindings/attention.cpp.)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "dsv41/kernels.h"

#ifdef DSV41_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace dsv41 {
namespace {

bool is_ue8m0(c10::ScalarType t) { return t == at::kByte || t == at::kFloat8_e8m0fnu; }

const uint8_t* bytes(const at::Tensor& t) { return static_cast<const uint8_t*>(t.const_data_ptr()); }
uint8_t* mbytes(at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

#ifdef DSV41_WITH_CUDA
void check_launch(int err, const char* op) {
  if (err == 0) return;
  if (err == kInvalidValue && last_launch_error()[0]) TORCH_CHECK(false, op, ": ", last_launch_error());
  TORCH_CHECK(false, op, ": CUDA error: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void* current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

#endif  // DSV41_WITH_CUDA

// ---- cache ops (CPU and CUDA) ---------------------------------------------------------------

struct FormatInfo {
  KvFormat f;
  const char* name;
  int block;
  int values_per_code;
  c10::ScalarType code_type;
  bool scale_ue8m0;  // else E4M3 (float8_e4m3fn)
};
constexpr FormatInfo kNvfp4{KvFormat::kNvfp4, "nvfp4", 16, 2, at::kByte, false};
constexpr FormatInfo kMxfp4{KvFormat::kMxfp4, "mxfp4", 32, 2, at::kByte, true};
constexpr FormatInfo kFp8Swa{KvFormat::kFp8Swa, "fp8_swa", 32, 1, at::kFloat8_e4m3fn, true};

at::Tensor index_as_long(const at::Tensor& idx, const c10::Device& device, const char* op, const char* name) {
  TORCH_CHECK(idx.dim() == 1 && (idx.scalar_type() == at::kLong || idx.scalar_type() == at::kInt), op, ": ", name,
              " must be a 1-D int64/int32 tensor");
  return idx.to(device, at::kLong).contiguous();
}

// Range check of indices that live on the CPU (device indices are checked by the kernels,
// which skip out-of-range entries rather than read or write out of bounds).
void check_range(const at::Tensor& idx, int64_t lo, int64_t hi, const char* op, const char* name) {
  if (!idx.is_cpu() || idx.numel() == 0) return;
  const at::Tensor l = idx.to(at::kLong);
  const int64_t* v = l.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < l.numel(); ++i)
    TORCH_CHECK(v[i] >= lo && v[i] < hi, op, ": ", name, "[", i, "] = ", v[i], " is outside [", lo, ", ", hi, ")");
}

void quantize_scatter(const FormatInfo& fi, const at::Tensor& x_in, at::Tensor codes, at::Tensor scales,
                      const at::Tensor& rows_in) {
  std::string opname = std::string("quantize_") + fi.name + "_scatter";
  const char* op = opname.c_str();
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1, op, ": x must be float32 [..., D]");
  const int64_t D = x_in.size(-1);
  TORCH_CHECK(D % fi.block == 0, op, ": D=", D, " must be a multiple of ", fi.block);
  const int64_t n = D ? x_in.numel() / D : 0;
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == fi.code_type && codes.size(1) == D / fi.values_per_code, op,
              ": codes must be ", fi.code_type, " [rows,", D / fi.values_per_code, "], got ", codes.scalar_type(), " ",
              codes.sizes());
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == codes.size(0) && scales.size(1) == D / fi.block &&
                  (fi.scale_ue8m0 ? is_ue8m0(scales.scalar_type()) : scales.scalar_type() == at::kFloat8_e4m3fn),
              op, ": scales must be ", (fi.scale_ue8m0 ? "UE8M0 (uint8)" : "float8_e4m3fn"), " [rows,", D / fi.block,
              "], got ", scales.sizes());
  TORCH_CHECK(codes.stride(1) == 1 && scales.stride(1) == 1, op, ": codes and scales rows must be contiguous");
  TORCH_CHECK(codes.device() == x_in.device() && scales.device() == x_in.device(), op,
              ": x, codes and scales must be on one device");
  TORCH_CHECK(rows_in.dim() == 1 && rows_in.size(0) == n, op, ": rows must be [", n, "] (one per row of x)");
  check_range(rows_in, -1, codes.size(0), op, "rows");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor rows = index_as_long(rows_in, x.device(), op, "rows");
  if (n == 0) return;
  if (x.is_cuda()) {
#ifdef DSV41_WITH_CUDA
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor xa = reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 ? x.clone() : x;
    // Rows out of [0, pool) are skipped by the kernel: pass the pool size through -1 rows.
    at::Tensor r = rows.clone();
    r.masked_fill_(r.ge(codes.size(0)), -1);
    check_launch(cuda::quantize_scatter(fi.f, xa.const_data_ptr<float>(), n, D, r.const_data_ptr<int64_t>(),
                                        mbytes(codes), codes.stride(0), mbytes(scales), scales.stride(0),
                                        current_stream()),
                 op);
    return;
#else
    TORCH_CHECK(false, op, ": dsv41 was built without CUDA");
#endif
  }
  cpu::quantize_scatter(fi.f, x.const_data_ptr<float>(), n, D, rows.const_data_ptr<int64_t>(), mbytes(codes),
                        codes.stride(0), mbytes(scales), scales.stride(0));
}

#define DSV41_SCATTER_OP(NAME, INFO)                                                                   \
  void quantize_##NAME##_scatter(const at::Tensor& x, at::Tensor codes, at::Tensor scales,          \
                                 const at::Tensor& rows) {                                           \
    quantize_scatter(INFO, x, codes, scales, rows);                                                  \
  }
DSV41_SCATTER_OP(nvfp4, kNvfp4)
DSV41_SCATTER_OP(mxfp4, kMxfp4)
DSV41_SCATTER_OP(fp8_swa, kFp8Swa)
#undef DSV41_SCATTER_OP

// engine: "kernel" (one SM kernel for all pairs), "copy_engine" (cudaMemcpyBatchAsync of
// the merged runs; needs CPU indices) or "auto" (the copy engines for blocks of 1 MiB and
// more when the indices are on the CPU, the kernel otherwise). Which is faster for which
// block size has not been measured yet: bench/bench_copy.py times both.
void copy_blocks(const at::Tensor& src, const at::Tensor& src_idx_in, at::Tensor dst, const at::Tensor& dst_idx_in,
                 c10::string_view engine_in) {
  const char* op = "copy_blocks";
  const std::string engine(engine_in.data(), engine_in.size());
  TORCH_CHECK(engine == "auto" || engine == "kernel" || engine == "copy_engine", op,
              ": engine must be 'auto', 'kernel' or 'copy_engine', got '", engine, "'");
  TORCH_CHECK(src.dim() == 2 && dst.dim() == 2, op, ": src and dst must be 2-D pools [n_blocks, block]");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), op, ": src and dst dtypes differ");
  TORCH_CHECK(src.size(1) == dst.size(1), op, ": block sizes differ (", src.size(1), " vs ", dst.size(1), ")");
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), op, ": pools must be contiguous");
  TORCH_CHECK(src_idx_in.dim() == 1 && dst_idx_in.dim() == 1 && src_idx_in.size(0) == dst_idx_in.size(0), op,
              ": src_idx and dst_idx must be 1-D of one length");
  check_range(src_idx_in, 0, src.size(0), op, "src_idx");
  check_range(dst_idx_in, 0, dst.size(0), op, "dst_idx");
  const int64_t n = src_idx_in.size(0), block_bytes = src.size(1) * src.element_size();
  if (src.is_cpu() && dst.is_cpu()) {
    const at::Tensor si = index_as_long(src_idx_in, src.device(), op, "src_idx");
    const at::Tensor di = index_as_long(dst_idx_in, src.device(), op, "dst_idx");
    cpu::copy_blocks(bytes(src), si.const_data_ptr<int64_t>(), mbytes(dst), di.const_data_ptr<int64_t>(), n,
                     block_bytes);
    return;
  }
#ifdef DSV41_WITH_CUDA
  const at::Tensor& gpu = src.is_cuda() ? src : dst;
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&src, &dst})
    TORCH_CHECK(t->is_cuda() ? t->device() == gpu.device() : t->is_pinned(), op,
                ": each pool must be on ", gpu.device(), " or in pinned host memory (pin_memory())");
  c10::cuda::CUDAGuard guard(gpu.device());
  const bool host_idx = src_idx_in.is_cpu() && dst_idx_in.is_cpu();
  TORCH_CHECK(engine != "copy_engine" || host_idx, op, ": engine='copy_engine' needs the indices on the CPU");
  if (engine == "copy_engine" || (engine == "auto" && host_idx && block_bytes >= (int64_t{1} << 20))) {
    const at::Tensor si = index_as_long(src_idx_in, src_idx_in.device(), op, "src_idx");
    const at::Tensor di = index_as_long(dst_idx_in, dst_idx_in.device(), op, "dst_idx");
    check_launch(cuda::copy_blocks_engine(bytes(src), si.const_data_ptr<int64_t>(), mbytes(dst),
                                          di.const_data_ptr<int64_t>(), n, block_bytes, current_stream()),
                 op);
    return;
  }
  at::Tensor si = index_as_long(src_idx_in, gpu.device(), op, "src_idx");
  at::Tensor di = index_as_long(dst_idx_in, gpu.device(), op, "dst_idx");
  if (!src_idx_in.is_cpu() || !dst_idx_in.is_cpu()) {
    // Device indices were not range-checked: turn out-of-range pairs into no-ops.
    const at::Tensor bad = si.lt(0).logical_or(si.ge(src.size(0))).logical_or(di.lt(0)).logical_or(di.ge(dst.size(0)));
    si = si.masked_fill(bad, -1);
    di = di.masked_fill(bad, -1);
  }
  if (n == 0 || block_bytes == 0) return;
  check_launch(cuda::copy_blocks(bytes(src), si.const_data_ptr<int64_t>(), mbytes(dst), di.const_data_ptr<int64_t>(),
                                 n, block_bytes, current_stream()),
               op);
#else
  TORCH_CHECK(false, op, ": dsv41 was built without CUDA");
#endif
}

at::Tensor dequant_tricks(const at::Tensor& codes_in, const at::Tensor& scales_in, int64_t fmt) {
  const char* op = "_dequant_tricks";
  TORCH_CHECK(fmt >= 0 && fmt <= 2, op, ": fmt must be 0 (nvfp4), 1 (mxfp4) or 2 (fp8_swa)");
  const FormatInfo& fi = fmt == 0 ? kNvfp4 : fmt == 1 ? kMxfp4 : kFp8Swa;
  TORCH_CHECK(codes_in.dim() == 2 && scales_in.dim() == 2 && codes_in.size(0) == scales_in.size(0), op,
              ": codes and scales must be 2-D with one row per vector");
  TORCH_CHECK(codes_in.element_size() == 1 && scales_in.element_size() == 1, op, ": byte tensors expected");
  const int64_t D = codes_in.size(1) * fi.values_per_code;
  TORCH_CHECK(D % 32 == 0 && scales_in.size(1) * fi.block == D, op, ": shapes do not match format ", fi.name);
  const at::Tensor codes = codes_in.contiguous(), scales = scales_in.contiguous();
  at::Tensor y = at::empty({codes.size(0), D}, codes.options().dtype(at::kFloat));
  if (codes.is_cuda()) {
#ifdef DSV41_WITH_CUDA
    c10::cuda::CUDAGuard guard(codes.device());
    check_launch(cuda::dequant_tricks(fi.f, bytes(codes), bytes(scales), codes.size(0), D, y.data_ptr<float>(),
                                      current_stream()),
                 op);
    return y;
#else
    TORCH_CHECK(false, op, ": dsv41 was built without CUDA");
#endif
  }
  cpu::dequant_tricks(fi.f, bytes(codes), bytes(scales), codes.size(0), D, y.data_ptr<float>());
  return y;
}

}  // namespace
}  // namespace dsv41

TORCH_LIBRARY_FRAGMENT(dsv41, m) {
  m.def("copy_blocks(Tensor src, Tensor src_idx, Tensor(a!) dst, Tensor dst_idx, str engine=\"auto\") -> ()");
  m.def("quantize_nvfp4_scatter(Tensor x, Tensor(a!) codes, Tensor(b!) scales, Tensor rows) -> ()");
  m.def("quantize_mxfp4_scatter(Tensor x, Tensor(a!) codes, Tensor(b!) scales, Tensor rows) -> ()");
  m.def("quantize_fp8_swa_scatter(Tensor x, Tensor(a!) codes, Tensor(b!) scales, Tensor rows) -> ()");
  m.def("_dequant_tricks(Tensor codes, Tensor scales, int fmt) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsv41, CPU, m) {
  m.impl("copy_blocks", &dsv41::copy_blocks);
  m.impl("quantize_nvfp4_scatter", &dsv41::quantize_nvfp4_scatter);
  m.impl("quantize_mxfp4_scatter", &dsv41::quantize_mxfp4_scatter);
  m.impl("quantize_fp8_swa_scatter", &dsv41::quantize_fp8_swa_scatter);
  m.impl("_dequant_tricks", &dsv41::dequant_tricks);
}

#ifdef DSV41_WITH_CUDA
TORCH_LIBRARY_IMPL(dsv41, CUDA, m) {
  m.impl("copy_blocks", &dsv41::copy_blocks);
  m.impl("quantize_nvfp4_scatter", &dsv41::quantize_nvfp4_scatter);
  m.impl("quantize_mxfp4_scatter", &dsv41::quantize_mxfp4_scatter);
  m.impl("quantize_fp8_swa_scatter", &dsv41::quantize_fp8_swa_scatter);
  m.impl("_dequant_tricks", &dsv41::dequant_tricks);
}
#endif
