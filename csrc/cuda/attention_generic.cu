// The simple path of sparse attention: fp32 arithmetic, one warp per (query, head), keys
// decoded one at a time with the codecs of formats.h. Any H, D % 32 == 0 up to 1024, any
// number of keys, sm_70+. Used for shapes the tensor-core kernel does not take (small test
// models), when asked for (DSV41_ATTENTION_IMPL=generic) and as a cross-check on the GPU.
// Same conventions as the reference: out = softmax(scores) V * sigmoid(lse - sink),
// out = 0 and lse = -inf without a valid key, out = NaN and lse = -inf with a NaN key.
#include <cuda_runtime.h>

#include <cmath>

#include "attention_internal.h"
#include "dsv41/attention/config.h"
#include "dsv41/formats.h"

namespace dsv41 {
namespace attn {
namespace {

constexpr int kMaxPerLane = kGenericMaxDimPerLane;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Decoded value of dim d of SWA row `row` / global row `row`.
__device__ __forceinline__ float swa_value(const SparseAttentionParams& p, int64_t row, int d) {
  const uint8_t v = p.swa_values[row * p.swa_values_stride + d];
  const uint8_t s = p.swa_scales[row * p.swa_scales_stride + d / fmt::kFp8SwaBlock];
  return fmt::e4m3_decode(v) * fmt::ue8m0_to_float(s);
}
__device__ __forceinline__ float kv_value(const SparseAttentionParams& p, int64_t row, int d) {
  const uint8_t c = p.kv_codes[row * p.kv_codes_stride + d / 2];
  const uint8_t s = p.kv_scales[row * p.kv_scales_stride + d / fmt::kNvfp4Block];
  return fmt::e2m1_decode((d & 1) ? (c >> 4) : (c & 0xF)) * fmt::e4m3_decode(s);
}

__global__ void __launch_bounds__(kGenericThreads)
    generic_attention_kernel(const __grid_constant__ SparseAttentionParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * (kGenericThreads / 32) + (threadIdx.x >> 5);
  if (pair >= static_cast<int64_t>(p.T) * p.H) return;
  const int t = static_cast<int>(pair / p.H), h = static_cast<int>(pair % p.H);
  const int per_lane = p.D / 32;
  const float* q = p.q + t * p.q_stride_t + h * p.q_stride_h;
  float qv[kMaxPerLane], o[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    qv[i] = i < per_lane ? q[lane + 32 * i] * p.softmax_scale : 0.f;
    o[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const int n = p.W + p.K;
  for (int j = 0; j < n; ++j) {
    const bool swa = j < p.W;
    const int32_t row = swa ? p.swa_idx[t * p.swa_idx_stride + j] : p.kv_idx[t * p.kv_idx_stride + (j - p.W)];
    if (row < 0 || row >= (swa ? p.n_swa_rows : p.n_kv_rows)) continue;  // warp-uniform
    float kv[kMaxPerLane];
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      kv[i] = 0.f;
      if (i < per_lane) {
        kv[i] = swa ? swa_value(p, row, lane + 32 * i) : kv_value(p, row, lane + 32 * i);
        dot += qv[i] * kv[i];
      }
    }
    const float s = warp_sum(dot);
    const float m_new = fmaxf(m, s);
    const float alpha = m == -INFINITY ? 0.f : expf(m - m_new);
    const float pr = expf(s - m_new);
    l = l * alpha + pr;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) o[i] = o[i] * alpha + pr * kv[i];
    m = s != s ? m : m_new;  // a NaN score poisons l and o through pr; keep m finite
  }
  float lse, scale;
  if (l == 0.f) {
    lse = -INFINITY;
    scale = 0.f;
  } else if (l != l) {  // a NaN key: out = NaN, lse = -inf (as the reference)
    lse = -INFINITY;
    scale = NAN;
  } else {
    lse = m + logf(l);
    scale = (1.f / l) / (1.f + expf(p.sink[h] - lse));
  }
  float* out = p.out + t * p.out_stride_t + h * p.out_stride_h;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i)
    if (i < per_lane) out[lane + 32 * i] = o[i] * scale;
  if (lane == 0) p.lse[t * p.lse_stride_t + h] = lse;
}

}  // namespace

cudaError_t launch_generic(const SparseAttentionParams& p, cudaStream_t stream) {
  const int64_t pairs = static_cast<int64_t>(p.T) * p.H;
  const int64_t blocks = (pairs + kGenericThreads / 32 - 1) / (kGenericThreads / 32);
  generic_attention_kernel<<<static_cast<unsigned>(blocks), kGenericThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attn
}  // namespace dsv41
