// Merges the key splits of the tensor-core attention kernel: per (query, head),
// lse = log(sum_s exp(lse_s)), out = sum_s exp(lse_s - lse) * o_s, then the sink factor
// sigmoid(lse - sink[h]). Splits without a valid key have lse_s = -inf and weight 0; a
// query with none at all gets out = 0 and lse = -inf. A NaN lse_s (a NaN key) gives
// out = NaN and lse = -inf, as the reference does.
#include <cuda_runtime.h>

#include <cmath>

#include "attention_internal.h"
#include "dsv41/attention/config.h"

namespace dsv41 {
namespace attn {
namespace {

constexpr int kCombineThreads = 128;  // one (query, head) per CTA, a float4 of dims per thread

__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const __grid_constant__ KernelArgs a) {
  const SparseAttentionParams& p = a.p;
  const int S = a.num_splits;
  const int64_t th = blockIdx.x;  // t * H + h
  const int t = static_cast<int>(th / p.H), h = static_cast<int>(th % p.H);
  const float* lse_s = a.ws_lse + static_cast<int64_t>(t) * S * p.H + h;  // stride H per split
  float m = -INFINITY;
  bool nan = false;
  for (int s = 0; s < S; ++s) {
    const float v = lse_s[static_cast<int64_t>(s) * p.H];
    nan |= v != v;
    m = fmaxf(m, v);
  }
  float lse, factor;
  if (nan) {
    lse = -INFINITY;
    factor = NAN;
  } else if (m == -INFINITY) {
    lse = -INFINITY;
    factor = 0.f;
  } else {
    float sum = 0.f;
    for (int s = 0; s < S; ++s) sum += expf(lse_s[static_cast<int64_t>(s) * p.H] - m);
    lse = m + logf(sum);
    factor = 1.f / (1.f + expf(p.sink[h] - lse));
  }
  if (threadIdx.x == 0) p.lse[static_cast<int64_t>(t) * p.lse_stride_t + h] = lse;
  float* dst = p.out + static_cast<int64_t>(t) * p.out_stride_t + static_cast<int64_t>(h) * p.out_stride_h;
  for (int d4 = threadIdx.x; d4 < p.D / 4; d4 += kCombineThreads) {  // float4 index within the row
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (factor != 0.f) {
      for (int s = 0; s < S; ++s) {
        const float ls = lse_s[static_cast<int64_t>(s) * p.H];
        const float w = expf(ls - lse) * factor;
        if (w == 0.f) continue;  // -inf split (its partial is zeros anyway)
        const float4 v = reinterpret_cast<const float4*>(
            a.ws_o + ((static_cast<int64_t>(t) * S + s) * p.H + h) * p.D)[d4];
        acc.x += w * v.x;
        acc.y += w * v.y;
        acc.z += w * v.z;
        acc.w += w * v.w;
      }
    }
    if (nan) acc = make_float4(NAN, NAN, NAN, NAN);
    reinterpret_cast<float4*>(dst)[d4] = acc;
  }
}

}  // namespace

cudaError_t launch_combine(const KernelArgs& a, cudaStream_t stream) {
  const int64_t blocks = static_cast<int64_t>(a.p.T) * a.p.H;
  combine_kernel<<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace attn
}  // namespace dsv41
