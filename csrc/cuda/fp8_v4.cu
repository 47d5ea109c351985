// CUDA kernels of the FP8 V4 main-KV codec. No torch headers: raw pointers and a stream.
//
// Mapping: one warp per part of an entry. An entry of `tiles` 64-value no-RoPE tiles has
// tiles + 1 parts: part t < tiles is tile t (lane l takes values l and l + 32, so a warp
// reads 128 contiguous bytes twice and writes 32 contiguous code bytes twice), and the
// last part is the RoPE dims and the pad bytes. A tile's lanes reduce amax and the finite
// flag with shuffles and then apply formats.h's scale rule and element encoder; max is
// exact and order-free, so the bits equal the CPU loop's (fmt::fp8_v4_encode_entry).
#include <cuda_runtime.h>

#include "dsv41/codec_ops.h"
#include "dsv41/formats.h"

namespace dsv41 {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

__global__ void __launch_bounds__(kThreads)
    fp8_v4_quantize_kernel(const float* __restrict__ x, int64_t n_entries, Fp8V4Shape shape,
                           float floor, uint8_t* __restrict__ out) {
  const int tiles = fmt::fp8_v4_tiles(shape.nope), parts = tiles + 1;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= n_entries * parts) return;  // whole warps leave together
  const int64_t e = warp / parts;
  const int part = static_cast<int>(warp % parts);
  const float* xe = x + e * (shape.nope + shape.rope);
  const int entry_bytes = fmt::fp8_v4_entry_bytes(shape.nope, shape.rope);
  const int scale_off = fmt::fp8_v4_scale_offset(shape.nope, shape.rope);
  uint8_t* oe = out + e * entry_bytes;

  if (part < tiles) {
    const float* xt = xe + part * fmt::kFp8V4Tile;
    const float v0 = xt[lane], v1 = xt[lane + 32];
    float amax = fmaxf(fabsf(v0), fabsf(v1));
    int bad = !(fmt::is_finite(v0) && fmt::is_finite(v1));
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
      bad |= __shfl_xor_sync(kFullMask, bad, off);
    }
    const uint8_t s = fmt::fp8_v4_scale_code(amax, !bad, floor);
    uint8_t* ot = oe + part * fmt::kFp8V4Tile;
    ot[lane] = fmt::fp8_v4_encode_elem(v0, s);
    ot[lane + 32] = fmt::fp8_v4_encode_elem(v1, s);
    if (lane == 0) oe[scale_off + part] = s;
    return;
  }
  for (int i = lane; i < shape.rope; i += 32) {
    const uint16_t h = fmt::fp8_v4_rope_encode(xe[shape.nope + i]);
    oe[shape.nope + 2 * i] = static_cast<uint8_t>(h & 0xFF);
    oe[shape.nope + 2 * i + 1] = static_cast<uint8_t>(h >> 8);
  }
  for (int b = scale_off + tiles + lane; b < entry_bytes; b += 32) oe[b] = 0;
}

__global__ void __launch_bounds__(kThreads)
    fp8_v4_dequantize_kernel(const uint8_t* __restrict__ in, int64_t n_entries,
                             Fp8V4Shape shape, float* __restrict__ y) {
  const int tiles = fmt::fp8_v4_tiles(shape.nope), parts = tiles + 1;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= n_entries * parts) return;
  const int64_t e = warp / parts;
  const int part = static_cast<int>(warp % parts);
  const uint8_t* ie = in + e * fmt::fp8_v4_entry_bytes(shape.nope, shape.rope);
  float* ye = y + e * (shape.nope + shape.rope);

  if (part < tiles) {
    const float s =
        fmt::ue8m0_to_float(ie[fmt::fp8_v4_scale_offset(shape.nope, shape.rope) + part]);
    const uint8_t* it = ie + part * fmt::kFp8V4Tile;
    float* yt = ye + part * fmt::kFp8V4Tile;
    yt[lane] = fmt::scaled_value(fmt::e4m3_decode(it[lane]), s);
    yt[lane + 32] = fmt::scaled_value(fmt::e4m3_decode(it[lane + 32]), s);
    return;
  }
  for (int i = lane; i < shape.rope; i += 32)
    ye[shape.nope + i] = fmt::fp8_v4_rope_decode(ie + shape.nope + 2 * i);
}

int64_t grid_for(int64_t n_entries, Fp8V4Shape shape) {
  const int64_t warps = n_entries * (fmt::fp8_v4_tiles(shape.nope) + 1);
  return (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
}

}  // namespace

int fp8_v4_quantize(const float* x, int64_t n_entries, Fp8V4Shape shape, float floor,
                    uint8_t* out, void* stream) {
  if (n_entries == 0) return 0;
  fp8_v4_quantize_kernel<<<grid_for(n_entries, shape), kThreads, 0,
                           static_cast<cudaStream_t>(stream)>>>(x, n_entries, shape, floor, out);
  return static_cast<int>(cudaGetLastError());
}

int fp8_v4_dequantize(const uint8_t* entries, int64_t n_entries, Fp8V4Shape shape, float* y,
                      void* stream) {
  if (n_entries == 0) return 0;
  fp8_v4_dequantize_kernel<<<grid_for(n_entries, shape), kThreads, 0,
                             static_cast<cudaStream_t>(stream)>>>(entries, n_entries, shape, y);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace dsv41
