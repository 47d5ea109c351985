// Quantize-on-write: new tokens' FP8 SWA / NVFP4 / MXFP4 rows straight into their slots of
// a pool (ring slots, paged rows), and the device twin of the decoder self-check.
//
// Mapping as in codecs.cu: one thread per 4 consecutive values (a 16-byte load), a scale
// block spans 4 (NVFP4) or 8 lanes that reduce amax and the finite flag with shuffles and
// then call the scale rule and element encoders of formats.h, so the bits equal the
// contiguous quantize_* ops. D % block == 0, so a block never straddles two rows.
#include <cuda_runtime.h>

#include "dsv41/dequant.h"
#include "dsv41/formats.h"
#include "dsv41/kernels.h"

namespace dsv41 {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <KvFormat F>
struct Rule {
  static constexpr int kBlock = F == KvFormat::kNvfp4 ? fmt::kNvfp4Block : fmt::kMxfp4Block;
  __device__ static uint8_t scale(float amax, bool finite) {
    if constexpr (F == KvFormat::kNvfp4) return fmt::nvfp4_scale_code(amax, finite);
    if constexpr (F == KvFormat::kMxfp4) return fmt::mxfp4_scale_code(amax, finite);
    return fmt::fp8_swa_scale_code(amax, finite);
  }
  __device__ static uint8_t encode(float x, uint8_t s) {
    if constexpr (F == KvFormat::kNvfp4) return fmt::nvfp4_encode_elem(x, s);
    if constexpr (F == KvFormat::kMxfp4) return fmt::mxfp4_encode_elem(x, s);
    return fmt::fp8_swa_encode_elem(x, s);
  }
};

template <KvFormat F>
__global__ void __launch_bounds__(kThreads)
    quantize_scatter_kernel(const float4* __restrict__ x, int64_t n_vec4, int64_t vec4_per_row,
                            const int64_t* __restrict__ rows, uint8_t* __restrict__ codes,
                            int64_t code_stride, uint8_t* __restrict__ scales, int64_t scale_stride) {
  constexpr int kGroup = Rule<F>::kBlock / 4;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool valid = idx < n_vec4;
  const float4 v = valid ? x[idx] : make_float4(0.f, 0.f, 0.f, 0.f);
  float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
  int bad = !(fmt::is_finite(v.x) && fmt::is_finite(v.y) && fmt::is_finite(v.z) && fmt::is_finite(v.w));
#pragma unroll
  for (int off = kGroup / 2; off >= 1; off /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    bad |= __shfl_xor_sync(0xFFFFFFFFu, bad, off);
  }
  if (!valid) return;
  const int64_t i = idx / vec4_per_row, j = idx - i * vec4_per_row;
  const int64_t row = rows[i];
  if (row < 0) return;
  const uint8_t s = Rule<F>::scale(amax, !bad);
  if (j % kGroup == 0) scales[row * scale_stride + j / kGroup] = s;
  const uint8_t c0 = Rule<F>::encode(v.x, s), c1 = Rule<F>::encode(v.y, s);
  const uint8_t c2 = Rule<F>::encode(v.z, s), c3 = Rule<F>::encode(v.w, s);
  uint8_t* dst = codes + row * code_stride;
  if constexpr (F == KvFormat::kFp8Swa) {
    reinterpret_cast<uint32_t*>(dst)[j] =
        c0 | (uint32_t(c1) << 8) | (uint32_t(c2) << 16) | (uint32_t(c3) << 24);
  } else {
    reinterpret_cast<uint16_t*>(dst)[j] = fmt::pack_e2m1(c0, c1) | (uint16_t(fmt::pack_e2m1(c2, c3)) << 8);
  }
}

__global__ void dequant_tricks_kernel(int f, const uint8_t* __restrict__ codes,
                                      const uint8_t* __restrict__ scales, int64_t n, int64_t D,
                                      float* __restrict__ y) {
  const int64_t groups = D / 8;
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u >= n * groups) return;
  const int64_t r = u / groups, g = u - r * groups;
  const int64_t code_bytes = f == static_cast<int>(KvFormat::kFp8Swa) ? D : D / 2;
  const int64_t scale_bytes = D / (f == static_cast<int>(KvFormat::kNvfp4) ? fmt::kNvfp4Block : fmt::kMxfp4Block);
  float out[8];
  dq::decode_group_natural(f, codes + r * code_bytes, scales + r * scale_bytes, static_cast<int>(g), out);
#pragma unroll
  for (int k = 0; k < 8; ++k) y[r * D + 8 * g + k] = out[k];
}

template <KvFormat F>
int launch_scatter(const float* x, int64_t n, int64_t D, const int64_t* rows, uint8_t* codes,
                   int64_t code_stride, uint8_t* scales, int64_t scale_stride, cudaStream_t s) {
  const int64_t n_vec4 = n * D / 4;
  const int64_t grid = (n_vec4 + kThreads - 1) / kThreads;
  quantize_scatter_kernel<F><<<static_cast<unsigned>(grid), kThreads, 0, s>>>(
      reinterpret_cast<const float4*>(x), n_vec4, D / 4, rows, codes, code_stride, scales, scale_stride);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int quantize_scatter(KvFormat f, const float* x, int64_t n, int64_t D, const int64_t* rows,
                     uint8_t* codes, int64_t code_stride, uint8_t* scales, int64_t scale_stride,
                     void* stream) {
  clear_launch_error();
  const int block = f == KvFormat::kNvfp4 ? fmt::kNvfp4Block : fmt::kMxfp4Block;
  if (n < 0 || D <= 0 || D % block) return launch_fail("quantize_scatter: D=%lld must be a positive multiple of %d", (long long)D, block);
  if (n == 0) return 0;
  if (reinterpret_cast<uintptr_t>(x) % 16) return launch_fail("quantize_scatter: x must be 16-byte aligned");
  const int align = f == KvFormat::kFp8Swa ? 4 : 2;
  if (reinterpret_cast<uintptr_t>(codes) % align || code_stride % align)
    return launch_fail("quantize_scatter: code rows must be %d-byte aligned", align);
  auto s = static_cast<cudaStream_t>(stream);
  switch (f) {
    case KvFormat::kNvfp4: return launch_scatter<KvFormat::kNvfp4>(x, n, D, rows, codes, code_stride, scales, scale_stride, s);
    case KvFormat::kMxfp4: return launch_scatter<KvFormat::kMxfp4>(x, n, D, rows, codes, code_stride, scales, scale_stride, s);
    case KvFormat::kFp8Swa: return launch_scatter<KvFormat::kFp8Swa>(x, n, D, rows, codes, code_stride, scales, scale_stride, s);
  }
  return launch_fail("quantize_scatter: unknown format");
}

int dequant_tricks(KvFormat f, const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t D,
                   float* y, void* stream) {
  clear_launch_error();
  if (n < 0 || D <= 0 || D % 32) return launch_fail("dequant_tricks: D must be a positive multiple of 32");
  const int64_t work = n * (D / 8);
  if (work == 0) return 0;
  dequant_tricks_kernel<<<static_cast<unsigned>((work + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<int>(f), codes, scales, n, D, y);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace dsv41
