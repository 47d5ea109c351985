// CUDA codec kernels. No torch headers: the binding layer passes raw pointers and a stream.
//
// Mapping: one thread per 4 consecutive values (one 16-byte float4 load), so a warp reads
// 512 contiguous bytes; a scale block of 16 (NVFP4) or 32 (MXFP4, FP8) values spans a
// group of 4 or 8 adjacent lanes, which reduce amax and the finite flag with shuffles and
// then apply the shared scale rule and element encoders from formats.h. max is exact and
// order-free, so the lane reduction gives the same amax as the CPU's serial loop.
#include <cuda_runtime.h>

#include "dsv41/codec_ops.h"
#include "dsv41/formats.h"

namespace dsv41 {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

template <Codec C>
__device__ __forceinline__ uint8_t scale_code(float amax, bool finite) {
  if constexpr (C == Codec::kNvfp4) return fmt::nvfp4_scale_code(amax, finite);
  if constexpr (C == Codec::kMxfp4) return fmt::mxfp4_scale_code(amax, finite);
  return fmt::fp8_swa_scale_code(amax, finite);
}

template <Codec C>
__device__ __forceinline__ uint8_t encode_elem(float x, uint8_t s) {
  if constexpr (C == Codec::kNvfp4) return fmt::nvfp4_encode_elem(x, s);
  if constexpr (C == Codec::kMxfp4) return fmt::mxfp4_encode_elem(x, s);
  return fmt::fp8_swa_encode_elem(x, s);
}

template <Codec C>
__device__ __forceinline__ float decode_scale(uint8_t s) {
  if constexpr (C == Codec::kNvfp4) return fmt::e4m3_decode(s);
  return fmt::ue8m0_to_float(s);
}

template <Codec C>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const float4* __restrict__ x, int64_t n_vec4, uint8_t* __restrict__ codes,
                    uint8_t* __restrict__ scales) {
  constexpr int kGroup = codec_block(C) / 4;  // lanes per scale block
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool valid = idx < n_vec4;
  // Every lane takes part in the shuffles; lanes past the end carry zeros.
  const float4 v = valid ? x[idx] : make_float4(0.f, 0.f, 0.f, 0.f);

  float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
  int bad = !(fmt::is_finite(v.x) && fmt::is_finite(v.y) && fmt::is_finite(v.z) &&
              fmt::is_finite(v.w));
#pragma unroll
  for (int off = kGroup / 2; off >= 1; off /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
    bad |= __shfl_xor_sync(kFullMask, bad, off);
  }
  if (!valid) return;

  const uint8_t s = scale_code<C>(amax, !bad);
  if (idx % kGroup == 0) scales[idx / kGroup] = s;

  const uint8_t c0 = encode_elem<C>(v.x, s), c1 = encode_elem<C>(v.y, s);
  const uint8_t c2 = encode_elem<C>(v.z, s), c3 = encode_elem<C>(v.w, s);
  if constexpr (C == Codec::kFp8Swa) {
    reinterpret_cast<uint32_t*>(codes)[idx] =
        c0 | (uint32_t(c1) << 8) | (uint32_t(c2) << 16) | (uint32_t(c3) << 24);
  } else {
    reinterpret_cast<uint16_t*>(codes)[idx] =
        fmt::pack_e2m1(c0, c1) | (uint16_t(fmt::pack_e2m1(c2, c3)) << 8);
  }
}

template <Codec C>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                      int64_t n_vec4, float4* __restrict__ y) {
  constexpr int kGroup = codec_block(C) / 4;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= n_vec4) return;
  const float s = decode_scale<C>(scales[idx / kGroup]);
  float4 out;
  if constexpr (C == Codec::kFp8Swa) {
    const uint32_t q = reinterpret_cast<const uint32_t*>(codes)[idx];
    out.x = fmt::scaled_value(fmt::e4m3_decode(q & 0xFF), s);
    out.y = fmt::scaled_value(fmt::e4m3_decode((q >> 8) & 0xFF), s);
    out.z = fmt::scaled_value(fmt::e4m3_decode((q >> 16) & 0xFF), s);
    out.w = fmt::scaled_value(fmt::e4m3_decode(q >> 24), s);
  } else {
    const uint16_t q = reinterpret_cast<const uint16_t*>(codes)[idx];
    out.x = fmt::scaled_value(fmt::e2m1_decode(q & 0xF), s);
    out.y = fmt::scaled_value(fmt::e2m1_decode((q >> 4) & 0xF), s);
    out.z = fmt::scaled_value(fmt::e2m1_decode((q >> 8) & 0xF), s);
    out.w = fmt::scaled_value(fmt::e2m1_decode(q >> 12), s);
  }
  y[idx] = out;
}

int64_t grid_for(int64_t n_vec4) { return (n_vec4 + kThreads - 1) / kThreads; }

template <Codec C>
int launch_quantize(const float* x, int64_t n_blocks, uint8_t* codes, uint8_t* scales,
                    cudaStream_t stream) {
  const int64_t n_vec4 = n_blocks * codec_block(C) / 4;
  quantize_kernel<C><<<grid_for(n_vec4), kThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(x), n_vec4, codes, scales);
  return static_cast<int>(cudaGetLastError());
}

template <Codec C>
int launch_dequantize(const uint8_t* codes, const uint8_t* scales, int64_t n_blocks, float* y,
                      cudaStream_t stream) {
  const int64_t n_vec4 = n_blocks * codec_block(C) / 4;
  dequantize_kernel<C><<<grid_for(n_vec4), kThreads, 0, stream>>>(
      codes, scales, n_vec4, reinterpret_cast<float4*>(y));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int quantize(Codec codec, const float* x, int64_t n_blocks, uint8_t* codes, uint8_t* scales,
             void* stream) {
  if (n_blocks == 0) return 0;
  auto st = static_cast<cudaStream_t>(stream);
  switch (codec) {
    case Codec::kNvfp4: return launch_quantize<Codec::kNvfp4>(x, n_blocks, codes, scales, st);
    case Codec::kMxfp4: return launch_quantize<Codec::kMxfp4>(x, n_blocks, codes, scales, st);
    case Codec::kFp8Swa: return launch_quantize<Codec::kFp8Swa>(x, n_blocks, codes, scales, st);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int dequantize(Codec codec, const uint8_t* codes, const uint8_t* scales, int64_t n_blocks,
               float* y, void* stream) {
  if (n_blocks == 0) return 0;
  auto st = static_cast<cudaStream_t>(stream);
  switch (codec) {
    case Codec::kNvfp4: return launch_dequantize<Codec::kNvfp4>(codes, scales, n_blocks, y, st);
    case Codec::kMxfp4: return launch_dequantize<Codec::kMxfp4>(codes, scales, n_blocks, y, st);
    case Codec::kFp8Swa: return launch_dequantize<Codec::kFp8Swa>(codes, scales, n_blocks, y, st);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace cuda
}  // namespace dsv41
