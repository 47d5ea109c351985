// Exact top-k over the visible prefix of each score row (topk_visible), and the
// hierarchical candidate selection over block maxima (candidate_blocks).
//
// Algorithm (one row per thread-block cluster of C CTAs, C = 1..8 by row length):
//   * Keys: each score becomes an order-preserving uint32 (sign-magnitude flip; -0 is
//     folded into +0 so that the two tie, as float comparison says; NaN ranks above +inf,
//     as in torch.topk). In block mode the key of block b is the max of its visible scores,
//     +inf for the newest block (the one holding position visible-1).
//   * Each CTA owns a contiguous slice of the row and caches its keys in shared memory
//     (up to 16K keys; longer slices are re-read from global/L2 each pass).
//   * Radix select, most significant digit first, digits of 11, 11 and 10 bits: each CTA
//     builds a 2048-bin histogram of the digit over the keys that match the prefix chosen
//     so far; the cluster sums the C histograms through distributed shared memory; every
//     CTA then finds the same bin b* holding the k-th largest (count above < need <=
//     count above + count(b*)), extends the prefix and subtracts the count above from
//     need. It stops early when count(b*) == need (the whole bin is taken).
//   * Selection: key prefix > chosen prefix (all taken), or == (ties: the `need` of them
//     with the lowest indices). Output in ascending index order: an element's slot is
//     (#greater before it) + min(need, #ties before it), from per-CTA totals exchanged
//     through distributed shared memory, per-warp totals, and warp ballots.
// Rows with at most k visible entries skip all that: the answer is 0..visible-1.
// Histograms are double-buffered so one cluster barrier per pass suffices.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "dsv41/cuda/ptx.h"
#include "dsv41/kernels.h"

namespace cg = cooperative_groups;

namespace dsv41 {
namespace cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 2048;
constexpr int kCacheCap = 16384;  // keys per CTA kept in shared memory (64 KiB)
constexpr int kMaxCluster = 8;     // portable cluster size
constexpr int kSliceMin = 8192;    // below this a CTA alone handles a row
constexpr int kMiscInts = 64;

struct Args {
  TopkParams p;
  int cluster;
  bool cached;
};

__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(x == 0.f ? 0.f : x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ uint32_t element_key(const TopkParams& p, const float* __restrict__ row, int64_t j,
                                                int64_t vis, int64_t n_eff) {
  if (p.block == 1) return order_key(row[j]);
  if (j == n_eff - 1) return order_key(INFINITY);  // the newest block is always kept
  float m = -INFINITY;
  const int64_t s = j * p.block, e = min(s + p.block, vis);
  for (int64_t x = s; x < e; ++x) m = fmaxf(m, row[x]);
  return order_key(m);
}

// Sum of v over the threads with a higher index (exclusive suffix sum).
__device__ uint32_t block_suffix_exclusive(uint32_t v, uint32_t* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_down_sync(0xFFFFFFFFu, x, o);
    if (lane + o < 32) x += y;
  }
  if (lane == 0) s_warp[warp] = x;
  __syncthreads();
  uint32_t later = 0;
  for (int w = warp + 1; w < kWarps; ++w) later += s_warp[w];
  __syncthreads();
  return x - v + later;
}

__global__ void __launch_bounds__(kThreads, 1) topk_kernel(const __grid_constant__ Args a) {
  const TopkParams& p = a.p;
  const int C = a.cluster;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rank = C > 1 ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  const int64_t row_id = blockIdx.x / C;

  extern __shared__ __align__(16) uint32_t sm[];
  uint32_t* s_hist = sm;                          // [2][kBins]
  uint32_t* s_scan = s_hist + 2 * kBins;          // [32]
  int64_t* s_misc = reinterpret_cast<int64_t*>(s_scan + 32);  // [kMiscInts / 2]
  uint32_t* s_keys = reinterpret_cast<uint32_t*>(s_misc + kMiscInts / 2);  // [cache] (if cached)

  const float* row = p.scores + row_id * p.scores_stride;
  int32_t* out = p.out + row_id * p.out_stride;
  const int64_t vis = min(max(static_cast<int64_t>(p.visible[row_id]), int64_t{0}), p.N);
  const int64_t n_eff = p.block == 1 ? vis : (vis + p.block - 1) / p.block;
  const int64_t k = p.k;
  const int64_t out_len = k * p.block;

  // The histograms and totals are written with ordinary shared-memory stores and read by
  // other CTAs through distributed shared memory. barrier.cluster.arrive.release orders
  // every memory access of the arriving thread before the arrive at cluster scope, and
  // wait.acquire orders the waiting thread's later accesses after it (PTX ISA, memory
  // consistency model: the arrive/wait pair is a release/acquire pattern at cluster scope),
  // which is exactly what a read of another CTA's histogram needs; no separate
  // fence.acq_rel.cluster (a full fence) is needed. Spelled out rather than left to cg's
  // defaults (every thread, aligned).
  auto cluster_sync = [&]() {
    if (C > 1) {
      asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    } else {
      __syncthreads();
    }
  };

  if (n_eff <= k) {  // everything visible is selected: 0..vis-1, then -1
    for (int64_t j = static_cast<int64_t>(rank) * kThreads + tid; j < out_len; j += static_cast<int64_t>(C) * kThreads)
      out[j] = j < vis ? static_cast<int32_t>(j) : -1;
    return;  // the whole cluster takes this branch (same row)
  }

  const int64_t per = (n_eff + C - 1) / C;
  const int64_t c0 = min(n_eff, rank * per), c1 = min(n_eff, c0 + per);
  const int64_t len = c1 - c0;
  const bool cached = a.cached;
  if (cached)
    for (int64_t j = tid; j < len; j += kThreads) s_keys[j] = element_key(p, row, c0 + j, vis, n_eff);
  auto key_at = [&](int64_t j) -> uint32_t { return cached ? s_keys[j] : element_key(p, row, c0 + j, vis, n_eff); };

  uint32_t prefix = 0;
  int nbits = 0;
  int64_t need = k;
  bool whole_bin = false;
  for (int pass = 0; pass < 3 && !whole_bin; ++pass) {
    const int bits = pass < 2 ? 11 : 10;
    const int shift = 32 - nbits - bits;
    const uint32_t mask = (1u << bits) - 1u;
    uint32_t* hist = s_hist + (pass & 1) * kBins;
    for (int b = tid; b < kBins; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (int64_t j = tid; j < len; j += kThreads) {
      const uint32_t u = key_at(j);
      if (nbits == 0 || (u >> (32 - nbits)) == prefix) atomicAdd(&hist[(u >> shift) & mask], 1u);
    }
    cluster_sync();  // every CTA's histogram is complete
    uint32_t cnt[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) cnt[e] = 0;
    for (int r = 0; r < C; ++r) {
      const uint32_t* h = C > 1 ? cg::this_cluster().map_shared_rank(hist, r) : hist;
#pragma unroll
      for (int e = 0; e < 4; ++e) cnt[e] += h[4 * tid + e];
    }
    const uint32_t mine = cnt[0] + cnt[1] + cnt[2] + cnt[3];
    const int64_t above = block_suffix_exclusive(mine, s_scan);
    if (above < need && above + mine >= need) {  // exactly one thread
      int64_t acc = above;
#pragma unroll
      for (int e = 3; e >= 0; --e) {
        if (acc + cnt[e] >= need) {
          s_misc[0] = 4 * tid + e;
          s_misc[1] = acc;
          s_misc[2] = cnt[e];
          break;
        }
        acc += cnt[e];
      }
    }
    __syncthreads();
    const uint32_t bstar = static_cast<uint32_t>(s_misc[0]);
    need -= s_misc[1];
    whole_bin = s_misc[2] == need;
    prefix = (prefix << bits) | bstar;
    nbits += bits;
    __syncthreads();  // s_misc is rewritten by the next pass
  }

  // ---- selection and ascending-order output ----
  auto top = [&](uint32_t u) -> uint32_t { return nbits >= 32 ? u : (u >> (32 - nbits)); };
  const int64_t seg = ((len + kWarps - 1) / kWarps + 31) / 32 * 32;  // warp slice, whole rounds
  const int64_t w0 = min(len, warp * seg), w1 = min(len, w0 + seg);
  uint32_t n_gt = 0, n_tie = 0;
  for (int64_t j = w0 + lane; j < w1; j += 32) {
    const uint32_t t = top(key_at(j));
    n_gt += t > prefix;
    n_tie += t == prefix;
  }
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) {
    n_gt += __shfl_xor_sync(0xFFFFFFFFu, n_gt, o);
    n_tie += __shfl_xor_sync(0xFFFFFFFFu, n_tie, o);
  }
  if (lane == 0) {
    s_scan[warp] = n_gt;
    s_scan[kWarps + warp] = n_tie;
  }
  __syncthreads();
  if (tid == 0) {
    int64_t g = 0, t = 0;
    for (int w = 0; w < kWarps; ++w) {
      g += s_scan[w];
      t += s_scan[kWarps + w];
    }
    s_misc[4] = g;  // this CTA's totals, read by the higher ranks
    s_misc[5] = t;
  }
  cluster_sync();
  int64_t gt_run = 0, tie_run = 0;
  for (int r = 0; r < rank; ++r) {
    const int64_t* m = cg::this_cluster().map_shared_rank(s_misc, r);
    gt_run += m[4];
    tie_run += m[5];
  }
  for (int w = 0; w < warp; ++w) {
    gt_run += s_scan[w];
    tie_run += s_scan[kWarps + w];
  }
  const uint32_t lt = ptx::lanemask_lt();
  for (int64_t base = w0; base < w1; base += 32) {
    const int64_t j = base + lane;
    const bool in = j < w1;
    const uint32_t t = in ? top(key_at(j)) : 0u;
    const bool is_gt = in && t > prefix, is_tie = in && t == prefix;
    const uint32_t bg = __ballot_sync(0xFFFFFFFFu, is_gt), bt = __ballot_sync(0xFFFFFFFFu, is_tie);
    const int64_t gt_before = gt_run + __popc(bg & lt), tie_before = tie_run + __popc(bt & lt);
    int64_t slot = -1;
    if (is_gt) slot = gt_before + min(need, tie_before);
    else if (is_tie && tie_before < need) slot = gt_before + tie_before;
    if (slot >= 0) {
      const int64_t e = c0 + j;  // element index (position, or block)
      if (p.block == 1) {
        out[slot] = static_cast<int32_t>(e);
      } else {
        for (int x = 0; x < p.block; ++x) {
          const int64_t pos = e * p.block + x;
          out[slot * p.block + x] = pos < vis ? static_cast<int32_t>(pos) : -1;
        }
      }
    }
    gt_run += __popc(bg);
    tie_run += __popc(bt);
  }
  cluster_sync();  // keep shared memory alive until every rank has read the totals
}

}  // namespace

int topk(const TopkParams& p, void* stream) {
  clear_launch_error();
  if (p.T < 0 || p.k < 0 || p.N < 0 || p.block < 1)
    return launch_fail("topk: bad sizes (T=%d k=%d block=%d)", p.T, p.k, p.block);
  if (p.N > 0x7FFFFFFFLL) return launch_fail("topk: rows longer than 2^31 - 1");
  if (p.T == 0 || p.k == 0) return 0;
  if (static_cast<int64_t>(p.k) * p.block > 0x7FFFFFFFLL) return launch_fail("topk: k * block too large");
  const int64_t n_eff_max = p.block == 1 ? p.N : (p.N + p.block - 1) / p.block;
  int C = static_cast<int>(std::min<int64_t>(kMaxCluster, std::max<int64_t>(1, (n_eff_max + kSliceMin - 1) / kSliceMin)));
  int dev = 0, major = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (major < 9) C = 1;  // clusters need sm_90
  const int64_t per_max = (n_eff_max + C - 1) / C;
  Args a;
  a.p = p;
  a.cluster = C;
  a.cached = per_max <= kCacheCap;
  const size_t smem = (2 * kBins + 32) * sizeof(uint32_t) + kMiscInts / 2 * sizeof(int64_t) +
                      (a.cached ? static_cast<size_t>(std::max<int64_t>(per_max, 1)) * sizeof(uint32_t) : 0);
  const int64_t blocks = static_cast<int64_t>(p.T) * C;
  if (blocks > 0x7FFFFFFFLL) return launch_fail("topk: too many rows");
  // The limit is set once per device to the largest size any call can ask for (also keeps
  // the call free of attribute changes under CUDA-graph capture after the first use).
  static bool attr_set[64] = {};
  cudaError_t e = cudaSuccess;
  if (dev >= 64 || !attr_set[dev]) {
    const int max_smem = static_cast<int>((2 * kBins + 32) * sizeof(uint32_t) + kMiscInts / 2 * sizeof(int64_t) +
                                          kCacheCap * sizeof(uint32_t));
    e = cudaFuncSetAttribute(reinterpret_cast<const void*>(&topk_kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                             max_smem);
    if (e != cudaSuccess) return static_cast<int>(e);
    if (dev < 64) attr_set[dev] = true;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(C);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = C > 1 ? 1 : 0;
  e = cudaLaunchKernelEx(&cfg, topk_kernel, a);
  if (e != cudaSuccess) return static_cast<int>(e);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace dsv41
