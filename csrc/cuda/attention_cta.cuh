// What the two tensor-core attention kernels (attention_mma.cuh, attention_wgmma.cu) share,
// device side and launch side: the per-query key list and its split range, the row-wise
// softmax steps of an S fragment, the epilogue's lse and scale per head row, the shuffle
// store of an output row pair and the launch of either kernel's two variants. Not a public
// header. The CPU emulators (tests/ops/attention_*emulator.py) transcribe these expressions.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_internal.h"
#include "dsv41/attention/config.h"
#include "dsv41/cuda/ptx.h"

namespace dsv41 {
namespace attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Stable compaction of the valid entries of src[0..n) (0 <= v < limit) into dst; returns
// the count (the same value in every thread). Run by all kNThreads threads of the CTA (the
// block size); uses s_warp[kNThreads / 32] and two barriers per kNThreads entries.
template <int kNThreads>
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

struct Tile {
  int first;  // position in the compacted key list
  int rows;   // valid rows (1..64)
  bool kv;    // NVFP4 global entries (else FP8 SWA)
};

// The compacted key list of one query (SWA keys first, then global keys, in tiles of 64
// that never mix formats) and the tiles [tb, te) of this CTA's split.
struct KeyList {
  int n_swa, n_kv, swa_tiles, tb, te;
  __device__ __forceinline__ Tile tile(int i) const {
    if (i < swa_tiles) return {kTileKeys * i, min(kTileKeys, n_swa - kTileKeys * i), false};
    const int j = i - swa_tiles;
    return {n_swa + kTileKeys * j, min(kTileKeys, n_kv - kTileKeys * j), true};
  }
};

template <int kNThreads>
__device__ __forceinline__ KeyList build_key_list(const SparseAttentionParams& p, int t, int S, int split,
                                                  int* s_idx, int* s_misc) {
  KeyList kl;
  kl.n_swa = compact_indices<kNThreads>(p.swa_idx + static_cast<int64_t>(t) * p.swa_idx_stride, p.W,
                                        p.n_swa_rows, s_idx, s_misc);
  kl.n_kv = compact_indices<kNThreads>(p.kv_idx + static_cast<int64_t>(t) * p.kv_idx_stride, p.K,
                                       p.n_kv_rows, s_idx + kl.n_swa, s_misc);
  kl.swa_tiles = (kl.n_swa + kTileKeys - 1) / kTileKeys;
  const int n_tiles = kl.swa_tiles + (kl.n_kv + kTileKeys - 1) / kTileKeys;
  const int per = (n_tiles + S - 1) / S;
  kl.tb = min(n_tiles, split * per);
  kl.te = min(n_tiles, kl.tb + per);
  return kl;
}

// One thread's S fragment of a tile: s[4j + 2h + e] = S[row g + 8h][key skey0 + 8j + 2qd + e]
// (the m16n8 accumulator layout of mma.sync and of wgmma alike). Scales by c_tile, masks
// keys past the tile's count to -inf and returns the row maxima over the 4 lanes of a row.
__device__ __forceinline__ void scale_mask_rowmax(float (&s)[16], int skey0, int qd, int rows, float c_tile,
                                                  float (&mx)[2]) {
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool valid = skey0 + 8 * j + 2 * qd + e < rows;
      s[4 * j + e] = valid ? s[4 * j + e] * c_tile : -INFINITY;
      s[4 * j + 2 + e] = valid ? s[4 * j + 2 + e] * c_tile : -INFINITY;
      mx[0] = fmaxf(mx[0], s[4 * j + e]);
      mx[1] = fmaxf(mx[1], s[4 * j + 2 + e]);
    }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xFFFFFFFFu, mx[rr], 1));
    mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xFFFFFFFFu, mx[rr], 2));
  }
}

// The online-softmax step of a row pair once both key halves' maxima are known: the new
// running max, alpha = 2^(m_old - m_new) (0 while no key was valid) and the m used for p.
__device__ __forceinline__ void update_row_max(float (&m_run)[2], const float (&mx)[2], const float (&other)[2],
                                               float (&alpha)[2], float (&m_use)[2]) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const float m_new = fmaxf(m_run[rr], fmaxf(mx[rr], other[rr]));  // same in both key halves
    m_use[rr] = m_new == -INFINITY ? 0.f : m_new;  // no valid key yet: p = 0, alpha = 0
    alpha[rr] = ptx::ex2(m_run[rr] - m_use[rr]);
    m_run[rr] = m_new;
  }
}

// The epilogue of one head row: lse and the factor applied to O (1/l, times the sink
// factor sigmoid(lse - sink) with one split; partials keep the NaN so that the combine step
// sees it). No valid key: out = 0, lse = -inf. A NaN key: out = NaN, lse = -inf.
template <bool kSplit>
__device__ __forceinline__ void row_lse_scale(float lt, float m, float sink, float& lse, float& scale) {
  if (lt == 0.f) {
    lse = -INFINITY;
    scale = 0.f;
  } else if (lt != lt) {
    lse = kSplit ? NAN : -INFINITY;
    scale = NAN;
  } else {
    lse = (m + log2f(lt)) * kLn2;
    scale = 1.f / lt;
    if (!kSplit) scale *= 1.f / (1.f + expf(sink - lse));
  }
}

// Stores one row's two accumulator values x0, x1 (stored positions 2qd, 2qd+1 of a group of
// 8 dims = dims qd, qd+4 of the permuted pair order). Four shuffles among the row's 4 lanes
// give lane qd dims 2qd, 2qd+1: one 8-byte store per lane, 32 contiguous bytes per row per
// instruction. dim = 8 * group + 2 * qd. Every lane of the warp calls it (the shuffles);
// live = false (a padding head row, the same for the row's 4 lanes) skips the store.
__device__ __forceinline__ void store_row_pair(float* dst, int dim, int qd, float x0, float x1, bool live = true) {
  const int src0 = (2 * qd) & 3, src1 = (2 * qd + 1) & 3, hi = qd >> 1;
  const float a0 = __shfl_sync(0xFFFFFFFFu, x0, src0, 4), a1 = __shfl_sync(0xFFFFFFFFu, x1, src0, 4);
  const float b0 = __shfl_sync(0xFFFFFFFFu, x0, src1, 4), b1 = __shfl_sync(0xFFFFFFFFu, x1, src1, 4);
  if (live) *reinterpret_cast<float2*>(dst + dim) = make_float2(hi ? a1 : a0, hi ? b1 : b0);
}

// Where head row `row` of this CTA writes: its output row (one split) or its partial.
template <bool kSplit>
__device__ __forceinline__ float* out_row(const KernelArgs& a, int t, int split, int h) {
  const SparseAttentionParams& p = a.p;
  if (kSplit) return a.ws_o + ((static_cast<int64_t>(t) * a.num_splits + split) * p.H + h) * p.D;
  return p.out + static_cast<int64_t>(t) * p.out_stride_t + static_cast<int64_t>(h) * p.out_stride_h;
}
template <bool kSplit>
__device__ __forceinline__ float* lse_slot(const KernelArgs& a, int t, int split, int h) {
  if (kSplit) return a.ws_lse + (static_cast<int64_t>(t) * a.num_splits + split) * a.p.H + h;
  return a.p.lse + static_cast<int64_t>(t) * a.p.lse_stride_t + h;
}

// Sets both variants' shared-memory limit on the current device (a plan does this once, so
// that a launch, captured in a CUDA graph or not, only checks a flag).
template <typename Kernel>
cudaError_t prepare_tensor_core(Kernel split_kernel, Kernel whole_kernel, int smem, int slot) {
  cudaError_t e = ensure_smem_attribute(reinterpret_cast<const void*>(split_kernel), smem, slot);
  if (e != cudaSuccess) return e;
  return ensure_smem_attribute(reinterpret_cast<const void*>(whole_kernel), smem, slot + 1);
}

// Grid: (T x splits, head groups); the one-split variant writes the output, the split
// variant its partials for attention_combine.cu. slot: the ensure_smem_attribute slot of
// the pair (two consecutive slots).
template <typename Kernel>
cudaError_t launch_tensor_core(Kernel split_kernel, Kernel whole_kernel, int threads, int smem, int slot,
                               const KernelArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.p.T) * static_cast<unsigned>(a.num_splits),
                  static_cast<unsigned>((a.p.H + kHeadsPerCta - 1) / kHeadsPerCta));
  const bool split = a.num_splits > 1;
  Kernel k = split ? split_kernel : whole_kernel;
  cudaError_t e = ensure_smem_attribute(reinterpret_cast<const void*>(k), smem, slot + (split ? 0 : 1));
  if (e != cudaSuccess) return e;
  k<<<grid, threads, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace attn
}  // namespace dsv41
