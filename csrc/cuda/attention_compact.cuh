// Device helper shared by the tensor-core attention kernels (attention_mma.cu,
// attention_wgmma.cu): the per-query key list. Not a public header.
#pragma once

#include <cstdint>

#include "dsv41/attention/config.h"
#include "dsv41/cuda/ptx.h"

namespace dsv41 {
namespace attn {

// Stable compaction of the valid entries of src[0..n) (0 <= v < limit) into dst; returns
// the count (the same value in every thread). Run by all kNThreads threads of the CTA (the
// block size); uses s_warp[kNThreads / 32] and two barriers per kNThreads entries.
template <int kNThreads = kThreads>
__device__ __forceinline__ int compact_indices(const int32_t* __restrict__ src, int n, int64_t limit, int* dst,
                               int* s_warp) {
  constexpr int kNWarps = kNThreads / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int base = 0;
  for (int start = 0; start < n; start += kNThreads) {
    const int i = start + tid;
    const int v = i < n ? src[i] : -1;
    const bool ok = v >= 0 && static_cast<int64_t>(v) < limit;
    const uint32_t bal = __ballot_sync(0xFFFFFFFFu, ok);
    if (lane == 0) s_warp[warp] = __popc(bal);
    __syncthreads();
    int before = 0, total = 0;
#pragma unroll
    for (int w = 0; w < kNWarps; ++w) {
      const int c = s_warp[w];
      before += w < warp ? c : 0;
      total += c;
    }
    if (ok) dst[base + before + __popc(bal & ptx::lanemask_lt())] = v;
    base += total;
    __syncthreads();
  }
  return base;
}

}  // namespace attn
}  // namespace dsv41
