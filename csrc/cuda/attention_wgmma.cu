// Sparse attention with dequantize-on-load on Hopper's warpgroup MMA (wgmma, sm_90a).
// Selected at run time with DSV41_ATTENTION_IMPL=wgmma; the mma.sync kernel stays the
// default until a GPU run shows this one correct and faster (docs/kernels.md).
//
// Same work split and math as attention_mma.cu: one CTA = (query token t, 64 heads, key
// split s); the valid keys compacted into one list (SWA, then global), tiles of 64 keys,
// online softmax in the log2 domain, NVFP4 tiles decoded as value * 2^-8 (the folded
// constant), V = K (MQA). What differs:
//
//   two warpgroups, not 8 independent warps; both MMAs are wgmma with A and B read from
//   shared memory through descriptors (128-byte swizzle, dsv41/cuda/wgmma.h):
//     S = Q K^T   m64n32k16 x 32 k-steps   warpgroup g: keys 32g..32g+31 of the tile
//     O += P V    m64n256k16 x 4 k-steps   warpgroup g: dims 256g..256g+255 (V = the K tile
//                                          read MN-major, i.e. transposed)
//   two K buffers; while the S wgmma of tile i runs (asynchronously), every thread loads
//   tile i+1's stored bytes from global memory into registers and dequantizes them into the
//   other buffer, so the FP8/NVFP4 decode overlaps the tensor cores instead of following
//   them (no raw staging buffers and no cp.async).
//
// Shared layout (config.h, kWg*): every [64 rows][512 dims] bf16 tile is 8 blocks of
// [64 rows][128 B] (64 dims), 16-byte chunk c of row r at chunk (c ^ (r & 7)) of its
// 128-byte line: the canonical 128-byte-swizzled K-major layout wgmma reads (8-row atoms of
// 1024 bytes). Dims are in the permuted pair order of dsv41/dequant.h inside a group of 8,
// in q and K alike (the dot products do not see it; the epilogue undoes it). The P tile
// [64 heads][64 keys] bf16 is one such block. Generic stores into any of these are
// followed by fence.proxy.async before the barrier that hands them to wgmma.
//
// Barriers per tile: B1 (row maxima of both warpgroups), B2 (P, alpha and the next K tile
// written and fenced), B3 (P V done: P and this K buffer free).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_compact.cuh"
#include "attention_internal.h"
#include "dsv41/attention/config.h"
#include "dsv41/cuda/ptx.h"
#include "dsv41/cuda/wgmma.h"
#include "dsv41/dequant.h"
#include "dsv41/formats.h"

namespace dsv41 {
namespace attn {
namespace {

using ptx::st_shared_b32;
using ptx::st_shared_v4;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Byte offset of 16-byte chunk c (dims 8c..8c+7) of row r in a 128-byte-swizzled tile.
__device__ __forceinline__ uint32_t wg_off(int r, int c) {
  return static_cast<uint32_t>((c >> 3) * kWgBlockBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

struct Tile {
  int first;  // position in the compacted key list
  int rows;   // valid rows (1..64)
  bool kv;    // NVFP4 global entries (else FP8 SWA)
};

// The stored bytes of one thread's share of a tile: row r = tid % 64, quarter qq = tid / 64
// (dims 128qq..128qq+127). Rows past the tile's count load zeros (they decode to zeros, so
// a V row never holds stale data; their logits are masked).
struct RawShare {
  uint4 v[8];   // FP8: 128 value bytes; NVFP4: v[0..3] = 64 code bytes
  uint2 sc;     // FP8: sc.x = 4 UE8M0 scales; NVFP4: 8 E4M3 scales
};

__device__ __forceinline__ void load_share(const SparseAttentionParams& p, const int* s_idx, const Tile& ti,
                                           int r, int qq, RawShare& raw) {
  const bool ok = r < ti.rows;
  const int64_t row = ok ? s_idx[ti.first + r] : 0;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  if (!ti.kv) {
    const uint4* v = reinterpret_cast<const uint4*>(p.swa_values + row * p.swa_values_stride + 128 * qq);
#pragma unroll
    for (int j = 0; j < 8; ++j) raw.v[j] = ok ? __ldg(v + j) : zero;
    raw.sc.x = ok ? __ldg(reinterpret_cast<const uint32_t*>(p.swa_scales + row * p.swa_scales_stride + 4 * qq)) : 0u;
    raw.sc.y = 0u;
  } else {
    const uint4* v = reinterpret_cast<const uint4*>(p.kv_codes + row * p.kv_codes_stride + 64 * qq);
#pragma unroll
    for (int j = 0; j < 4; ++j) raw.v[j] = ok ? __ldg(v + j) : zero;
    raw.sc = ok ? __ldg(reinterpret_cast<const uint2*>(p.kv_scales + row * p.kv_scales_stride + 8 * qq))
                : make_uint2(0u, 0u);
  }
}

// One thread's share -> bf16 K tile (the same decoders and groups as attention_mma.cu).
__device__ __forceinline__ void store_share(uint32_t sK, bool kv, int r, int qq, const RawShare& raw) {
  uint32_t o[4];
  if (!kv) {
#pragma unroll
    for (int jb = 0; jb < 4; ++jb) {  // 32-value block 4*qq + jb = 16-byte chunks 2jb, 2jb+1
      const dq::Pow2Factor f = dq::ue8m0_factor(static_cast<uint8_t>(raw.sc.x >> (8 * jb)), dq::kE4M3PatternBias);
#pragma unroll
      for (int jc = 0; jc < 2; ++jc) {
        const int c = 8 * qq + 2 * jb + jc;  // 16-value chunk of the row
        const uint4 v = raw.v[2 * jb + jc];
        dq::fp8_group8(v.x, v.y, f, o);
        st_shared_v4(sK + wg_off(r, 2 * c), o[0], o[1], o[2], o[3]);
        dq::fp8_group8(v.z, v.w, f, o);
        st_shared_v4(sK + wg_off(r, 2 * c + 1), o[0], o[1], o[2], o[3]);
      }
    }
  } else {
#pragma unroll
    for (int jc = 0; jc < 4; ++jc) {  // 16 code bytes = 32 values = NVFP4 blocks 2c, 2c+1
      const int c = 4 * qq + jc;
      const uint4 v = raw.v[jc];
      const uint32_t sw = jc < 2 ? raw.sc.x : raw.sc.y;
      const uint32_t f0 = dq::nvfp4_factor(static_cast<uint8_t>(sw >> (16 * (jc & 1))));
      const uint32_t f1 = dq::nvfp4_factor(static_cast<uint8_t>(sw >> (16 * (jc & 1) + 8)));
      dq::nvfp4_group8(v.x, f0, o);
      st_shared_v4(sK + wg_off(r, 4 * c + 0), o[0], o[1], o[2], o[3]);
      dq::nvfp4_group8(v.y, f0, o);
      st_shared_v4(sK + wg_off(r, 4 * c + 1), o[0], o[1], o[2], o[3]);
      dq::nvfp4_group8(v.z, f1, o);
      st_shared_v4(sK + wg_off(r, 4 * c + 2), o[0], o[1], o[2], o[3]);
      dq::nvfp4_group8(v.w, f1, o);
      st_shared_v4(sK + wg_off(r, 4 * c + 3), o[0], o[1], o[2], o[3]);
    }
  }
}

template <bool kSplit>
__global__ void __launch_bounds__(kWgThreads, 1)
    sparse_attention_wgmma_kernel(const __grid_constant__ KernelArgs args) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Built for a target without wgmma (not sm_90a): never launched (wgmma_unavailable).
  __trap();
#else
  const SparseAttentionParams& p = args.p;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // The 128-byte swizzle is a function of address bits 4-9: align the base to 1024.
  uint8_t* smem = smem_raw + ((1024 - (ptx::smem_addr(smem_raw) & 1023)) & 1023);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wl = warp & 3;  // warpgroup, warp within it
  const int S = kSplit ? args.num_splits : 1;
  const int t = kSplit ? static_cast<int>(blockIdx.x) / S : static_cast<int>(blockIdx.x);
  const int split = kSplit ? static_cast<int>(blockIdx.x) % S : 0;
  const int h0 = static_cast<int>(blockIdx.y) * kHeadsPerCta;

  const uint32_t sQ = ptx::smem_addr(smem + kWgOffQ);
  const uint32_t sK0 = ptx::smem_addr(smem + kWgOffK0);  // buffer b at sK0 + b * kKBytes
  static_assert(kWgOffK1 == kWgOffK0 + kKBytes, "K buffers are adjacent");
  const uint32_t sP = ptx::smem_addr(smem + kWgOffP);
  float* s_red = reinterpret_cast<float*>(smem + kWgOffStats);  // [2][64] row max per warpgroup
  float* s_alpha = s_red + 2 * 64;                              // [64]
  float* s_l = s_alpha + 64;                                    // [2][64]
  float* s_scale = s_l + 2 * 64;                                // [64]
  int* s_idx = reinterpret_cast<int*>(smem + kWgOffIdx);
  int* s_misc = reinterpret_cast<int*>(smem + kWgOffMisc);

  // ---- q -> bf16, permuted pairs, swizzled K-major ----
  {
    const float* qt = p.q + static_cast<int64_t>(t) * p.q_stride_t + static_cast<int64_t>(h0) * p.q_stride_h;
    for (int u = tid; u < kHeadsPerCta * (kHeadDim / 8); u += kWgThreads) {
      const int h = u >> 6, g = u & 63;
      const float4* src = reinterpret_cast<const float4*>(qt + h * p.q_stride_h + 8 * g);
      const float4 lo = __ldg(src), hi = __ldg(src + 1);
      st_shared_v4(sQ + wg_off(h, g), dq::floats_to_bf16x2(lo.x, hi.x), dq::floats_to_bf16x2(lo.y, hi.y),
                   dq::floats_to_bf16x2(lo.z, hi.z), dq::floats_to_bf16x2(lo.w, hi.w));
    }
  }

  // ---- the key list of this query ----
  const int n_swa = compact_indices(p.swa_idx + static_cast<int64_t>(t) * p.swa_idx_stride, p.W,
                                    p.n_swa_rows, s_idx, s_misc);
  const int n_kv = compact_indices(p.kv_idx + static_cast<int64_t>(t) * p.kv_idx_stride, p.K,
                                   p.n_kv_rows, s_idx + n_swa, s_misc);
  const int swa_tiles = (n_swa + kTileKeys - 1) / kTileKeys;
  const int n_tiles = swa_tiles + (n_kv + kTileKeys - 1) / kTileKeys;
  int tb = 0, te = n_tiles;
  if (kSplit) {
    const int per = (n_tiles + S - 1) / S;
    tb = min(n_tiles, split * per);
    te = min(n_tiles, tb + per);
  }
  auto tile = [&](int i) -> Tile {
    if (i < swa_tiles) return {kTileKeys * i, min(kTileKeys, n_swa - kTileKeys * i), false};
    const int j = i - swa_tiles;
    return {n_swa + kTileKeys * j, min(kTileKeys, n_kv - kTileKeys * j), true};
  };

  // ---- per-thread state ----
  const int g = lane >> 2, qd = lane & 3;
  const int srow0 = 16 * wl;   // this warp's 16 head rows (S and O alike)
  const int skey0 = 32 * wg;   // this warpgroup's keys in S
  const int r_ld = tid & 63, qq_ld = tid >> 6;  // this thread's share of a tile's decode
  float m_run[2] = {-INFINITY, -INFINITY};  // rows srow0+g, srow0+g+8
  float l_run[2] = {0.f, 0.f};              // this thread's share of the row sums
  float o_acc[128];                         // O[64 heads x dims 256wg..]: wgmma fragment
#pragma unroll
  for (int e = 0; e < 128; ++e) o_acc[e] = 0.f;

  // ---- prologue: tile tb decoded into K buffer 0 ----
  if (tb < te) {
    RawShare raw;
    const Tile t0 = tile(tb);
    load_share(p, s_idx, t0, r_ld, qq_ld, raw);
    store_share(sK0, t0.kv, r_ld, qq_ld, raw);
  }
  wgmma::fence_proxy_async();
  __syncthreads();

  for (int i = tb; i < te; ++i) {
    const uint32_t sK = sK0 + ((i - tb) & 1) * kKBytes;
    const uint32_t sK_next = sK0 + (((i - tb) & 1) ^ 1) * kKBytes;
    const Tile ti = tile(i);

    // ---- S = Q K^T (asynchronous): 64 heads x this warpgroup's 32 keys ----
    float s_acc[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) s_acc[e] = 0.f;
    wgmma::fence_operands(s_acc);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      const uint32_t kofs = (ks >> 2) * kWgBlockBytes + (ks & 3) * 32;
      wgmma::m64n32k16_ss(s_acc, wgmma::desc_sw128(sQ + kofs, 16, 1024),
                          wgmma::desc_sw128(sK + skey0 * 128 + kofs, 16, 1024), 1);
    }
    wgmma::commit();

    // ---- meanwhile: tile i+1 from global memory into the other K buffer ----
    if (i + 1 < te) {
      RawShare raw;
      const Tile tn = tile(i + 1);
      load_share(p, s_idx, tn, r_ld, qq_ld, raw);
      store_share(sK_next, tn.kv, r_ld, qq_ld, raw);
    }
    wgmma::fence_proxy_async();  // before B2 publishes the next tile to wgmma

    wgmma::wait<0>();
    wgmma::fence_operands(s_acc);

    // ---- online softmax (log2 domain); s_acc[4j + 2h + e] = S[srow0 + g + 8h][skey0 + 8j + 2qd + e] ----
    const float c_tile = p.softmax_scale * kLog2e * (ti.kv ? 256.f : 1.f);
    const float pshift = ti.kv ? 8.f : 0.f;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = skey0 + 8 * j + 2 * qd + e < ti.rows;
        s_acc[4 * j + e] = valid ? s_acc[4 * j + e] * c_tile : -INFINITY;
        s_acc[4 * j + 2 + e] = valid ? s_acc[4 * j + 2 + e] * c_tile : -INFINITY;
        mx[0] = fmaxf(mx[0], s_acc[4 * j + e]);
        mx[1] = fmaxf(mx[1], s_acc[4 * j + 2 + e]);
      }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xFFFFFFFFu, mx[rr], 1));
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xFFFFFFFFu, mx[rr], 2));
    }
    if (qd == 0) {
      s_red[wg * 64 + srow0 + g] = mx[0];
      s_red[wg * 64 + srow0 + g + 8] = mx[1];
    }
    __syncthreads();  // B1
    float alpha[2], m_use[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const float other = s_red[(wg ^ 1) * 64 + srow0 + g + 8 * rr];
      const float m_new = fmaxf(m_run[rr], fmaxf(mx[rr], other));  // same in both warpgroups
      m_use[rr] = m_new == -INFINITY ? 0.f : m_new;  // no valid key yet: p = 0, alpha = 0
      alpha[rr] = ptx::ex2(m_run[rr] - m_use[rr]);
      m_run[rr] = m_new;
    }
    float lsum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p00 = ptx::ex2(s_acc[4 * j + 0] - (m_use[0] - pshift));
      const float p01 = ptx::ex2(s_acc[4 * j + 1] - (m_use[0] - pshift));
      const float p10 = ptx::ex2(s_acc[4 * j + 2] - (m_use[1] - pshift));
      const float p11 = ptx::ex2(s_acc[4 * j + 3] - (m_use[1] - pshift));
      lsum[0] += p00 + p01;
      lsum[1] += p10 + p11;
      const int chunk = (skey0 >> 3) + j;  // P: [64 heads][64 keys], 8 keys per chunk
      st_shared_b32(sP + wg_off(srow0 + g, chunk) + 4 * qd, dq::floats_to_bf16x2(p00, p01));
      st_shared_b32(sP + wg_off(srow0 + g + 8, chunk) + 4 * qd, dq::floats_to_bf16x2(p10, p11));
    }
    const float lscale = ti.kv ? (1.f / 256.f) : 1.f;
    l_run[0] = l_run[0] * alpha[0] + lsum[0] * lscale;
    l_run[1] = l_run[1] * alpha[1] + lsum[1] * lscale;
    // Both warpgroups hold the same alpha for a row; each rescales its own O columns.
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o_acc[4 * j + 0] *= alpha[0];
      o_acc[4 * j + 1] *= alpha[0];
      o_acc[4 * j + 2] *= alpha[1];
      o_acc[4 * j + 3] *= alpha[1];
    }
    wgmma::fence_proxy_async();  // P (generic stores) -> wgmma
    __syncthreads();             // B2: P of both warpgroups and the next K tile ready

    // ---- O += P V: 64 heads x this warpgroup's 256 dims, 4 k-steps of 16 keys ----
    wgmma::fence_operands(o_acc);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < kTileKeys / 16; ++ks) {
      wgmma::m64n256k16_ss_tb(o_acc, wgmma::desc_sw128(sP + ks * 32, 16, 1024),
                              wgmma::desc_sw128(sK + (4 * wg) * kWgBlockBytes + ks * 2048, kWgBlockBytes, 1024), 1);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operands(o_acc);
    __syncthreads();  // B3: P and this K buffer free
  }

  // ---- epilogue: l, lse, 1/l and the sink factor per head row ----
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l_run[rr] += __shfl_xor_sync(0xFFFFFFFFu, l_run[rr], 1);
    l_run[rr] += __shfl_xor_sync(0xFFFFFFFFu, l_run[rr], 2);
  }
  if (qd == 0) {
    s_l[wg * 64 + srow0 + g] = l_run[0];
    s_l[wg * 64 + srow0 + g + 8] = l_run[1];
  }
  __syncthreads();
  if (wg == 0 && qd == 0) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = srow0 + g + 8 * rr;
      const float lt = s_l[row] + s_l[64 + row];
      float lse, scale;
      if (lt == 0.f) {  // no valid key: out = 0, lse = -inf
        lse = -INFINITY;
        scale = 0.f;
      } else if (lt != lt) {  // a NaN key: out = NaN; lse as in attention_mma.cu
        lse = kSplit ? NAN : -INFINITY;
        scale = NAN;
      } else {
        lse = (m_run[rr] + log2f(lt)) * kLn2;
        scale = 1.f / lt;
        if (!kSplit) scale *= 1.f / (1.f + expf(p.sink[h0 + row] - lse));
      }
      s_scale[row] = scale;
      if (kSplit)
        args.ws_lse[(static_cast<int64_t>(t) * S + split) * p.H + h0 + row] = lse;
      else
        p.lse[static_cast<int64_t>(t) * p.lse_stride_t + h0 + row] = lse;
    }
  }
  __syncthreads();
  // o_acc[4j + 2rr + e] = O[srow0 + g + 8rr][stored position 256wg + 8j + 2qd + e]; stored
  // positions 2qd, 2qd+1 of group 32wg+j are dims qd, qd+4: the shuffles of attention_mma.cu
  // give lane qd dims 2qd, 2qd+1 for one 8-byte store.
  const int src0 = (2 * qd) & 3, src1 = (2 * qd + 1) & 3, hi = qd >> 1;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = srow0 + g + 8 * rr;
    const float sc = s_scale[row];
    float* dst = kSplit ? args.ws_o + ((static_cast<int64_t>(t) * S + split) * p.H + h0 + row) * kHeadDim
                        : p.out + static_cast<int64_t>(t) * p.out_stride_t + static_cast<int64_t>(h0 + row) * p.out_stride_h;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const float x0 = o_acc[4 * j + 2 * rr] * sc, x1 = o_acc[4 * j + 2 * rr + 1] * sc;
      const float a0 = __shfl_sync(0xFFFFFFFFu, x0, src0, 4), a1 = __shfl_sync(0xFFFFFFFFu, x1, src0, 4);
      const float b0 = __shfl_sync(0xFFFFFFFFu, x0, src1, 4), b1 = __shfl_sync(0xFFFFFFFFu, x1, src1, 4);
      const int dim = 8 * (32 * wg + j) + 2 * qd;
      *reinterpret_cast<float2*>(dst + dim) = make_float2(hi ? a1 : a0, hi ? b1 : b0);
    }
  }
#endif
}

}  // namespace

const char* wgmma_unavailable(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return "no device";
  }
  if (major != 9 || minor != 0) return "wgmma needs compute capability 9.0 (sm_90a)";
  cudaFuncAttributes fa{};
  if (cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(&sparse_attention_wgmma_kernel<false>)) !=
      cudaSuccess) {
    cudaGetLastError();
    return "the wgmma kernel has no code for this device in this build";
  }
  // sm_90a machine code reports binary version 90; PTX-only or other targets cannot run it.
  if (fa.binaryVersion != 90) return "this build has no sm_90a machine code (TORCH_CUDA_ARCH_LIST=9.0a)";
  return "";
}

cudaError_t launch_wgmma(const KernelArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.p.T) * static_cast<unsigned>(a.num_splits),
                  static_cast<unsigned>(a.p.H / kHeadsPerCta));
  if (a.num_splits > 1) {
    const void* f = reinterpret_cast<const void*>(&sparse_attention_wgmma_kernel<true>);
    cudaError_t e = ensure_smem_attribute(f, kWgSmemBytes, 2);
    if (e != cudaSuccess) return e;
    sparse_attention_wgmma_kernel<true><<<grid, kWgThreads, kWgSmemBytes, stream>>>(a);
  } else {
    const void* f = reinterpret_cast<const void*>(&sparse_attention_wgmma_kernel<false>);
    cudaError_t e = ensure_smem_attribute(f, kWgSmemBytes, 3);
    if (e != cudaSuccess) return e;
    sparse_attention_wgmma_kernel<false><<<grid, kWgThreads, kWgSmemBytes, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace attn
}  // namespace dsv41
