// CSA2 indexer scores I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]) over MXFP4 q and k.
//
// Tensor-core kernel (Di == 128, Hi % 16 == 0, Hi <= 64): a CTA takes 128 keys (8 warps x
// 16) and a group of up to 8 queries. Each warp decodes its 16 keys straight from global
// memory into mma B fragments held in registers for the whole CTA (a lane of (g, q) needs
// pair q of every 8-dim group of key g: the permuted pair order of dsv41/dequant.h makes
// that one shift and two masks per group), so keys never touch shared memory. Queries are
// decoded once per CTA into shared memory (bf16, same pair order) and read as A fragments.
// Per query: S[Hi x 16 keys] per warp, then relu, times w, summed over heads in a fixed
// order (per thread over its head rows, then a butterfly over the 8 row lanes), so a
// query's scores do not depend on the batch it came with. MXFP4 values are exact in bf16
// and their products exact in fp32; only the fp32 accumulation rounds.
//
// Gathered form (indexer_scores_at): keys idx[t, c]; one query per CTA; -1 gives -inf.
// Generic kernel: fp32, one warp per (query, key), any Hi and Di % 32 == 0.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dsv41/cuda/ptx.h"
#include "dsv41/dequant.h"
#include "dsv41/formats.h"
#include "dsv41/kernels.h"

namespace dsv41 {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kKeysPerWarp = 16;
constexpr int kKeysPerCta = kWarps * kKeysPerWarp;  // 128
constexpr int kDi = 128;
constexpr int kGroups = kDi / 8;                      // 16 groups of 8 dims
constexpr int kMaxTokensPerCta = 8;
constexpr int kMaxHi = 64;

struct Args {
  IndexerParams p;
  int tokens_per_cta;
};

__global__ void __launch_bounds__(kThreads)
    indexer_mma_kernel(const __grid_constant__ Args a) {
  const IndexerParams& p = a.p;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, q = lane & 3;
  const bool gathered = p.idx != nullptr;
  // grid.x: query groups (consecutive CTAs share a key tile, which stays in L2), grid.y: keys
  const int t0 = static_cast<int>(blockIdx.x) * a.tokens_per_cta;
  const int nt = min(a.tokens_per_cta, p.T - t0);
  const int64_t key0 = static_cast<int64_t>(blockIdx.y) * kKeysPerCta + warp * kKeysPerWarp;
  const int64_t n_cols = gathered ? p.C : p.N;
  const int rows = nt * p.Hi;  // query rows in shared memory
  const uint32_t sQ = ptx::smem_addr(smem);
  float* s_w = reinterpret_cast<float*>(smem + static_cast<size_t>(a.tokens_per_cta) * p.Hi * kDi * 2);

  const uintptr_t q_base = reinterpret_cast<uintptr_t>(p.q_codes);
  const bool q_vec16 = (q_base & 15) == 0, q_words = (q_base & 3) == 0;
  // ---- queries -> bf16 [rows][128] (permuted pairs, 16 chunks per row, XOR swizzle) ----
  // One item = one 32-value block of a row: 16 code bytes (rows are 64 bytes, so a 16-byte
  // aligned base keeps every block aligned: one 16-byte load), one UE8M0 scale, four 8-value
  // groups. Four 4-byte loads for a 4-byte aligned base, byte loads only for a misaligned
  // one (a view at an odd storage offset).
  for (int u = tid; u < rows * (kGroups / 4); u += kThreads) {
    const int r = u / (kGroups / 4), blk = u - r * (kGroups / 4);
    const int64_t qrow = static_cast<int64_t>(t0) * p.Hi + r;  // row of q_codes [T*Hi, 64]
    const uint8_t* c = p.q_codes + qrow * (kDi / 2) + 16 * blk;
    uint32_t w[4];
    if (q_vec16) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(c));
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
#pragma unroll
      for (int x = 0; x < 4; ++x)
        w[x] = q_words ? __ldg(reinterpret_cast<const uint32_t*>(c + 4 * x))
                       : static_cast<uint32_t>(c[4 * x]) | (static_cast<uint32_t>(c[4 * x + 1]) << 8) |
                             (static_cast<uint32_t>(c[4 * x + 2]) << 16) | (static_cast<uint32_t>(c[4 * x + 3]) << 24);
    }
    const dq::Pow2Factor f = dq::ue8m0_factor(p.q_scales[qrow * (kDi / 32) + blk], dq::kE2M1PatternBias);
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int grp = 4 * blk + x;
      uint32_t o[4];
      dq::mxfp4_group8(w[x], f, o);
      ptx::st_shared_v4(sQ + r * 256 + ((grp ^ (r & 7)) << 4), o[0], o[1], o[2], o[3]);
    }
  }
  for (int u = tid; u < rows; u += kThreads) s_w[u] = p.weights[static_cast<int64_t>(t0) * p.Hi + u];

  // ---- this lane's B fragments: keys key0 + g (n-tile 0) and key0 + 8 + g (n-tile 1) ----
  uint32_t bk[2][kGroups];
  bool col_ok[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int64_t col = key0 + 8 * j + g;
    int64_t krow = -1;
    if (col < n_cols) {
      if (gathered) {
        const int32_t v = p.idx[static_cast<int64_t>(t0) * p.idx_stride + col];
        krow = (v >= 0 && v < p.N) ? v : -1;
      } else {
        krow = col;
      }
    }
    col_ok[j] = krow >= 0;
    uint4 c[4];
    uint32_t sc = 0;
    if (krow >= 0) {
      const uint4* src = reinterpret_cast<const uint4*>(p.k_codes + krow * p.k_codes_stride);
#pragma unroll
      for (int x = 0; x < 4; ++x) c[x] = __ldg(src + x);
      sc = __ldg(reinterpret_cast<const uint32_t*>(p.k_scales + krow * p.k_scales_stride));
    } else {
#pragma unroll
      for (int x = 0; x < 4; ++x) c[x] = make_uint4(0, 0, 0, 0);
    }
    const uint32_t words[16] = {c[0].x, c[0].y, c[0].z, c[0].w, c[1].x, c[1].y, c[1].z, c[1].w,
                                c[2].x, c[2].y, c[2].z, c[2].w, c[3].x, c[3].y, c[3].z, c[3].w};
#pragma unroll
    for (int blk = 0; blk < 4; ++blk) {  // 32-value block = groups 4*blk .. 4*blk+3
      const dq::Pow2Factor f = dq::ue8m0_factor(static_cast<uint8_t>(sc >> (8 * blk)), dq::kE2M1PatternBias);
#pragma unroll
      for (int x = 0; x < 4; ++x) bk[j][4 * blk + x] = dq::apply_factor(dq::e2m1_pair_pattern(words[4 * blk + x], q), f);
    }
  }
  __syncthreads();

  // ---- per query: S = Q K^T (Hi x 16 per warp), relu, weights, sum over heads ----
  const int a_r = lane & 15, a_hi = lane >> 4;
  for (int tt = 0; tt < nt; ++tt) {
    float part[2][2] = {{0.f, 0.f}, {0.f, 0.f}};  // [n-tile][col 2q+e]
    for (int mt = 0; mt < p.Hi / 16; ++mt) {
      const int rbase = tt * p.Hi + 16 * mt;
      const int r = rbase + a_r;
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int ks = 0; ks < kDi / 16; ++ks) {
        uint32_t af[4];
        ptx::ldmatrix_x4(af, sQ + r * 256 + (((2 * ks + a_hi) ^ (r & 7)) << 4));
        ptx::mma_bf16_16816(acc[0], af, bk[0][2 * ks], bk[0][2 * ks + 1]);
        ptx::mma_bf16_16816(acc[1], af, bk[1][2 * ks], bk[1][2 * ks + 1]);
      }
      const float w0 = s_w[rbase + g], w1 = s_w[rbase + g + 8];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          part[j][e] += w0 * fmaxf(acc[j][e], 0.f) + w1 * fmaxf(acc[j][2 + e], 0.f);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = part[j][e];
        v += __shfl_xor_sync(0xFFFFFFFFu, v, 4);
        v += __shfl_xor_sync(0xFFFFFFFFu, v, 8);
        v += __shfl_xor_sync(0xFFFFFFFFu, v, 16);
        part[j][e] = v;
      }
    // Lanes 0..3 now hold the sums of keys 8j + 2q + e. Column validity lives in the lane
    // that loaded the key (lane 4*key + *): fetch it.
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key_in_tile = 2 * q + e;  // n index within n-tile j
        const bool ok = __shfl_sync(0xFFFFFFFFu, col_ok[j] ? 1 : 0, 4 * key_in_tile) != 0;
        const int64_t col = key0 + 8 * j + key_in_tile;
        if (g == 0 && col < n_cols) {
          float* dst = p.scores + static_cast<int64_t>(t0 + tt) * p.scores_stride + col;
          *dst = (gathered && !ok) ? -INFINITY : part[j][e];
        }
      }
  }
}

// fp32 fallback: one warp per (query, column), heads in order, dims split over lanes.
__global__ void indexer_generic_kernel(const __grid_constant__ IndexerParams p) {
  const int lane = threadIdx.x & 31;
  const bool gathered = p.idx != nullptr;
  const int64_t n_cols = gathered ? p.C : p.N;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (item >= static_cast<int64_t>(p.T) * n_cols) return;
  const int t = static_cast<int>(item / n_cols);
  const int64_t col = item - static_cast<int64_t>(t) * n_cols;
  int64_t krow = col;
  if (gathered) {
    const int32_t v = p.idx[static_cast<int64_t>(t) * p.idx_stride + col];
    krow = (v >= 0 && v < p.N) ? v : -1;
  }
  float* dst = p.scores + static_cast<int64_t>(t) * p.scores_stride + col;
  if (krow < 0) {
    if (lane == 0) *dst = -INFINITY;
    return;
  }
  const int half = p.Di / 2;
  float total = 0.f;
  for (int h = 0; h < p.Hi; ++h) {
    const int64_t qrow = static_cast<int64_t>(t) * p.Hi + h;
    float dot = 0.f;
    for (int d = lane; d < p.Di; d += 32) {
      const uint8_t qc = p.q_codes[qrow * half + d / 2], kc = p.k_codes[krow * p.k_codes_stride + d / 2];
      const float qv = fmt::e2m1_decode((d & 1) ? (qc >> 4) : (qc & 0xF)) *
                       fmt::ue8m0_to_float(p.q_scales[qrow * (p.Di / 32) + d / 32]);
      const float kv = fmt::e2m1_decode((d & 1) ? (kc >> 4) : (kc & 0xF)) *
                       fmt::ue8m0_to_float(p.k_scales[krow * p.k_scales_stride + d / 32]);
      dot += qv * kv;
    }
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) dot += __shfl_xor_sync(0xFFFFFFFFu, dot, o);
    total += p.weights[static_cast<int64_t>(t) * p.Hi + h] * fmaxf(dot, 0.f);
  }
  if (lane == 0) *dst = total;
}

constexpr size_t kMaxMmaSmem = static_cast<size_t>(kMaxTokensPerCta) * kMaxHi * (kDi * 2 + sizeof(float));

}  // namespace

int indexer_scores(const IndexerParams& p, void* stream, const char** fallback) {
  clear_launch_error();
  if (fallback) *fallback = "";
  if (p.T < 0 || p.Hi <= 0 || p.Di <= 0 || p.N < 0 || p.C < 0)
    return launch_fail("indexer_scores: bad sizes (T=%d Hi=%d Di=%d)", p.T, p.Hi, p.Di);
  if (p.Di % 32) return launch_fail("indexer_scores: Di=%d is not a multiple of 32", p.Di);
  const bool gathered = p.idx != nullptr;
  const int64_t n_cols = gathered ? p.C : p.N;
  if (p.T == 0 || n_cols == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  int major = 0, dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  const bool keys_aligned = p.N == 0 || (reinterpret_cast<uintptr_t>(p.k_codes) % 16 == 0 && p.k_codes_stride % 16 == 0 &&
                                         reinterpret_cast<uintptr_t>(p.k_scales) % 4 == 0 && p.k_scales_stride % 4 == 0);
  const char* why = "";  // why the fp32 kernel runs ("" if the tensor-core one can)
  if (major < 8) why = "compute capability < 8.0";
  else if (p.Di != kDi || p.Hi % 16 || p.Hi > kMaxHi) why = "the tensor-core indexer needs Di = 128, Hi % 16 == 0 and Hi <= 64";
  else if (!keys_aligned) why = "key rows not aligned (codes: 16 bytes, scales: 4 bytes)";
  if (why[0]) {
    if (fallback) *fallback = why;
    const int64_t items = static_cast<int64_t>(p.T) * n_cols;
    const int64_t blocks = (items + 7) / 8;
    if (blocks > 0x7FFFFFFF) return launch_fail("indexer_scores: too much work for the generic kernel");
    indexer_generic_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(p);
    return static_cast<int>(cudaGetLastError());
  }
  Args a;
  a.p = p;
  a.tokens_per_cta = gathered ? 1 : std::min(kMaxTokensPerCta, p.T);
  const int64_t gx = (p.T + a.tokens_per_cta - 1) / a.tokens_per_cta;
  const int64_t gy = (n_cols + kKeysPerCta - 1) / kKeysPerCta;
  if (gy > 65535) return launch_fail("indexer_scores: %lld columns exceed the grid (max %d)", (long long)n_cols, 65535 * kKeysPerCta);
  const size_t smem = static_cast<size_t>(a.tokens_per_cta) * p.Hi * (kDi * 2 + sizeof(float));
  static bool attr_set[64] = {};
  if (dev < 64 && !attr_set[dev]) {
    cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(&indexer_mma_kernel),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kMaxMmaSmem));
    if (e != cudaSuccess) return static_cast<int>(e);
    attr_set[dev] = true;
  }
  indexer_mma_kernel<<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kThreads, smem, s>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace dsv41
