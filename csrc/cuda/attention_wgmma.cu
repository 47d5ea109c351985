// Sparse attention with dequantize-on-load on Hopper's warpgroup MMA (wgmma, sm_90a).
// The default at D = 512 on sm_90a for batches of two or more queries (the plan in
// attention.cu; the first GPU run's numbers are in docs/kernels.md).
//
// Same work split and math as attention_mma.cuh: one CTA = (query token t, 64 heads, key
// split s); the valid keys compacted into one list (SWA, then global), tiles of 64 keys,
// online softmax in the log2 domain, NVFP4 tiles decoded as value * 2^-8 (the folded
// constant), V = K (MQA). What differs: three warpgroups with fixed roles.
//
//   consumers (warpgroups 0, 1): both MMAs are wgmma with A and B read from shared memory
//   through descriptors (128-byte swizzle, dsv41/cuda/wgmma.h):
//     S = Q K^T   m64n32k16 x 32 k-steps   warpgroup g: keys 32g..32g+31 of the tile
//     O += P V    m64n256k16 x 4 k-steps   warpgroup g: dims 256g..256g+255 (V = the K tile
//                                          read MN-major, i.e. transposed)
//   producer (warpgroup 2): while the consumers work on tile j-1 in one K buffer, it gathers
//   tile j's stored bytes (the rows the compacted top-k / SWA indices name) with cp.async
//   and dequantizes them into the other K buffer.
//
// Why cp.async, not TMA: the 64 rows of a tile sit at 64 unrelated pool rows. A TMA tensor
// map describes boxes of a strided tensor, so a gathered tile would be 64 one-row TMA
// copies (plus one per scale row) issued by one elected thread (sm_90 has no TMA gather
// mode), whereas cp.async lets each of the 128 producer threads copy 16-byte pieces of any
// row, and zero-fills the rows past a tile's count (src-size 0) for free.
//
// Why the producer dequantizes (not the consumers from a staging buffer): the consumers
// hold 144 accumulator registers per thread and run the softmax; the FP8/NVFP4 decode is
// ALU work. Done by a separate warpgroup it overlaps the consumers' wgmma (the warp
// schedulers interleave it with the MMA waits), which is what the mma.sync kernel cannot
// do; done by the consumers it would sit between two tiles' MMAs. setmaxnreg moves registers
// from the producer to the consumers (config.h).
//
// Shared layout (config.h, kWg*): every [64 rows][512 dims] bf16 tile is 8 blocks of
// [64 rows][128 B] (64 dims), 16-byte chunk c of row r at chunk (c ^ (r & 7)) of its
// 128-byte line: the canonical 128-byte-swizzled K-major layout wgmma reads (8-row atoms of
// 1024 bytes). Dims are in the permuted pair order of dsv41/dequant.h inside a group of 8,
// in q and K alike (the dot products do not see it; the epilogue undoes it). The P tile
// [64 heads][64 keys] bf16 is one such block. There is no room for a separate raw tile
// (config.h): tile j's raw values are staged in the upper half of its own K buffer and its
// scales in a small scale buffer; the producer decodes dims 0..255 (written below the
// stage), then holds its share of dims 256..511 in registers across a producer-only barrier
// before writing over the stage. Generic stores into anything wgmma reads are followed by
// fence.proxy.async before the barrier that hands them over.
//
// Handoff (named barriers, config.h kWgBar*): K buffer b = (j - tb) & 1 holds tile j.
//   producer, tile j: [j - tb >= 2: bar.sync EMPTY[b]] cp.async -> wait_group 0 ->
//     bar.sync PRODUCER -> decode -> fence.proxy.async -> bar.arrive FULL[b]
//   consumers, tile i: bar.sync FULL[b] -> S -> B1 (row maxima) -> P, alpha -> B2 (P of both
//     warpgroups written) -> P V -> wait -> [i + 2 < te: bar.arrive EMPTY[b]]
// Every arrive is matched by exactly one sync of the other side, so no barrier is left
// half-arrived at exit. P and s_red are reused safely across tiles because a warpgroup
// reaches B1 of tile i+1 only after its own P V of tile i has completed.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_cta.cuh"
#include "attention_internal.h"
#include "dsv41/attention/config.h"
#include "dsv41/cuda/ptx.h"
#include "dsv41/cuda/wgmma.h"
#include "dsv41/dequant.h"
#include "dsv41/formats.h"

namespace dsv41 {
namespace attn {
namespace {

using ptx::ld_shared_b32;
using ptx::ld_shared_v2;
using ptx::ld_shared_v4;
using ptx::st_shared_b32;
using ptx::st_shared_v4;

// Byte offset of 16-byte chunk c (dims 8c..8c+7) of row r in a 128-byte-swizzled tile.
__device__ __forceinline__ uint32_t wg_off(int r, int c) {
  return static_cast<uint32_t>((c >> 3) * kWgBlockBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// Producer thread ptid's cp.async share of tile ti: its raw values into the stage (row r at
// r * 512 (FP8) or r * 256 (NVFP4) bytes, 16-byte chunk c at (c ^ (r & 7)), as in
// attention_mma.cuh's raw buffers) and its scale rows into sSc (r * 16 or r * 32 bytes).
// Rows past the tile's count are zero-filled (they decode to zeros, so a V row never holds
// stale data; their logits are masked).
__device__ __forceinline__ void stage_tile(const SparseAttentionParams& p, const int* s_idx, const Tile& ti,
                                           uint32_t stage, uint32_t sSc, int ptid) {
  if (!ti.kv) {
    for (int u = ptid; u < kTileKeys * 33; u += kWgProducerThreads) {
      const int r = u / 33, c = u - r * 33;
      const bool ok = r < ti.rows;
      const int64_t row = ok ? s_idx[ti.first + r] : 0;
      const uint8_t* src;
      uint32_t dst;
      if (c < 32) {
        src = p.swa_values + row * p.swa_values_stride + 16 * c;
        dst = stage + r * 512 + ((c ^ (r & 7)) << 4);
      } else {
        src = p.swa_scales + row * p.swa_scales_stride;
        dst = sSc + r * 16;
      }
      ptx::cp_async_16(dst, src, ok ? 16u : 0u);
    }
  } else {
    for (int u = ptid; u < kTileKeys * 18; u += kWgProducerThreads) {
      const int r = u / 18, c = u - r * 18;
      const bool ok = r < ti.rows;
      const int64_t row = ok ? s_idx[ti.first + r] : 0;
      const uint8_t* src;
      uint32_t dst;
      if (c < 16) {
        src = p.kv_codes + row * p.kv_codes_stride + 16 * c;
        dst = stage + r * 256 + ((c ^ (r & 7)) << 4);
      } else {
        src = p.kv_scales + row * p.kv_scales_stride + 16 * (c - 16);
        dst = sSc + r * 32 + 16 * (c - 16);
      }
      ptx::cp_async_16(dst, src, ok ? 16u : 0u);
    }
  }
}

// The stored bytes of one decode share, read back from the stage: row r, quarter qq (dims
// 128qq..128qq+127). A warp covers 32 rows at one quarter: the row-XOR swizzle spreads each
// 8-thread phase of its 16-byte loads over the 8 bank groups.
struct RawShare {
  uint4 v[8];   // FP8: 128 value bytes; NVFP4: v[0..3] = 64 code bytes
  uint2 sc;     // FP8: sc.x = 4 UE8M0 scales; NVFP4: 8 E4M3 scales
};

__device__ __forceinline__ void read_share(uint32_t stage, uint32_t sSc, bool kv, int r, int qq, RawShare& raw) {
  if (!kv) {
#pragma unroll
    for (int j = 0; j < 8; ++j) raw.v[j] = ld_shared_v4(stage + r * 512 + (((8 * qq + j) ^ (r & 7)) << 4));
    raw.sc = make_uint2(ld_shared_b32(sSc + r * 16 + 4 * qq), 0u);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) raw.v[j] = ld_shared_v4(stage + r * 256 + (((4 * qq + j) ^ (r & 7)) << 4));
    raw.sc = ld_shared_v2(sSc + r * 32 + 8 * qq);
  }
}

// One thread's share -> bf16 K tile (the same decoders and groups as attention_mma.cuh).
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
  const uint32_t sScales0 = ptx::smem_addr(smem + kWgOffScales0);  // buffer b at + b * kWgScaleBytes
  float* s_red = reinterpret_cast<float*>(smem + kWgOffStats);  // [2][64] row max per warpgroup
  float* s_alpha = s_red + 2 * 64;                              // [64]
  float* s_l = s_alpha + 64;                                    // [2][64]
  float* s_scale = s_l + 2 * 64;                                // [64]
  int* s_idx = reinterpret_cast<int*>(smem + kWgOffIdx);
  int* s_misc = reinterpret_cast<int*>(smem + kWgOffMisc);

  // ---- q -> bf16, permuted pairs, swizzled K-major ----
  {
    const float* qt = p.q + static_cast<int64_t>(t) * p.q_stride_t + static_cast<int64_t>(h0) * p.q_stride_h;
    for (int u = tid; u < kHeadsPerCta * (kHeadDim / 8); u += kWgThreads) {  // all three warpgroups
      const int h = u >> 6, g = u & 63;
      const float4* src = reinterpret_cast<const float4*>(qt + h * p.q_stride_h + 8 * g);
      const float4 lo = __ldg(src), hi = __ldg(src + 1);
      st_shared_v4(sQ + wg_off(h, g), dq::floats_to_bf16x2(lo.x, hi.x), dq::floats_to_bf16x2(lo.y, hi.y),
                   dq::floats_to_bf16x2(lo.z, hi.z), dq::floats_to_bf16x2(lo.w, hi.w));
    }
  }

  // ---- the key list of this query ----
  const KeyList kl = build_key_list<kWgThreads>(p, t, S, split, s_idx, s_misc);
  const int tb = kl.tb, te = kl.te;

  wgmma::fence_proxy_async();  // q (generic stores) -> wgmma
  __syncthreads();             // q and the key list ready; the last CTA-wide barrier

  // ---- producer warpgroup: tile j -> K buffer (j - tb) & 1 ----
  if (wg == kWgConsumerThreads / 128) {
    wgmma::setmaxnreg_dec<kWgProducerRegs>();
    const int ptid = tid - kWgConsumerThreads;
    const int r_dq = ptid & 63, h_dq = ptid >> 6;  // decode share: row r_dq, quarters h_dq, 2 + h_dq
    for (int j = tb; j < te; ++j) {
      const int b = (j - tb) & 1;
      const uint32_t sK = sK0 + b * kKBytes;
      const uint32_t stage = sK + kWgStageOff;
      const uint32_t sSc = sScales0 + b * kWgScaleBytes;
      if (j - tb >= 2) ptx::bar_sync(kWgBarEmpty0 + b, kWgThreads);  // P V of tile j-2 is done with it
      const Tile tj = kl.tile(j);
      stage_tile(p, s_idx, tj, stage, sSc, ptid);
      ptx::cp_async_commit();
      ptx::cp_async_wait<0>();
      ptx::bar_sync(kWgBarProducer, kWgProducerThreads);  // every producer thread's copies landed
      RawShare raw;
      read_share(stage, sSc, tj.kv, r_dq, h_dq, raw);
      store_share(sK, tj.kv, r_dq, h_dq, raw);  // dims 0..255: blocks 0..3, below the stage
      read_share(stage, sSc, tj.kv, r_dq, 2 + h_dq, raw);
      ptx::bar_sync(kWgBarProducer, kWgProducerThreads);  // the whole stage is read: write over it
      store_share(sK, tj.kv, r_dq, 2 + h_dq, raw);  // dims 256..511: blocks 4..7, the stage
      wgmma::fence_proxy_async();
      ptx::bar_arrive(kWgBarFull0 + b, kWgThreads);
    }
    return;
  }

  // ---- consumer warpgroups ----
  wgmma::setmaxnreg_inc<kWgConsumerRegs>();
  const int g = lane >> 2, qd = lane & 3;
  const int srow0 = 16 * wl;   // this warp's 16 head rows (S and O alike)
  const int skey0 = 32 * wg;   // this warpgroup's keys in S
  float m_run[2] = {-INFINITY, -INFINITY};  // rows srow0+g, srow0+g+8
  float l_run[2] = {0.f, 0.f};              // this thread's share of the row sums
  float o_acc[128];                         // O[64 heads x dims 256wg..]: wgmma fragment
#pragma unroll
  for (int e = 0; e < 128; ++e) o_acc[e] = 0.f;

  for (int i = tb; i < te; ++i) {
    const int b = (i - tb) & 1;
    const uint32_t sK = sK0 + b * kKBytes;
    const Tile ti = kl.tile(i);
    ptx::bar_sync(kWgBarFull0 + b, kWgThreads);  // the producer decoded tile i into buffer b

    // ---- S = Q K^T: 64 heads x this warpgroup's 32 keys (the producer decodes meanwhile) ----
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
    wgmma::wait<0>();
    wgmma::fence_operands(s_acc);

    // ---- online softmax (log2 domain); s_acc[4j + 2h + e] = S[srow0 + g + 8h][skey0 + 8j + 2qd + e] ----
    const float c_tile = p.softmax_scale * kLog2e * (ti.kv ? 256.f : 1.f);
    const float pshift = ti.kv ? 8.f : 0.f;
    float mx[2];
    scale_mask_rowmax(s_acc, skey0, qd, ti.rows, c_tile, mx);
    if (qd == 0) {
      s_red[wg * 64 + srow0 + g] = mx[0];
      s_red[wg * 64 + srow0 + g + 8] = mx[1];
    }
    ptx::bar_sync(kWgBarConsumers, kWgConsumerThreads);  // B1
    float alpha[2], m_use[2];
    const float other[2] = {s_red[(wg ^ 1) * 64 + srow0 + g], s_red[(wg ^ 1) * 64 + srow0 + g + 8]};
    update_row_max(m_run, mx, other, alpha, m_use);
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
    ptx::bar_sync(kWgBarConsumers, kWgConsumerThreads);  // B2: P of both warpgroups written

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
    if (i + 2 < te) ptx::bar_arrive(kWgBarEmpty0 + b, kWgThreads);  // buffer b free for tile i+2
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
  ptx::bar_sync(kWgBarConsumers, kWgConsumerThreads);
  if (wg == 0 && qd == 0) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = srow0 + g + 8 * rr;
      float lse, scale;
      row_lse_scale<kSplit>(s_l[row] + s_l[64 + row], m_run[rr], p.sink[h0 + row], lse, scale);
      s_scale[row] = scale;
      *lse_slot<kSplit>(args, t, split, h0 + row) = lse;
    }
  }
  ptx::bar_sync(kWgBarConsumers, kWgConsumerThreads);
  // o_acc[4j + 2rr + e] = O[srow0 + g + 8rr][stored position 256wg + 8j + 2qd + e]: chunk
  // 32wg + j of the row (attention_cta.cuh's store_row_pair un-permutes it).
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = srow0 + g + 8 * rr;
    const float sc = s_scale[row];
    float* dst = out_row<kSplit>(args, t, split, h0 + row);
#pragma unroll
    for (int j = 0; j < 32; ++j)
      store_row_pair(dst, 8 * (32 * wg + j) + 2 * qd, qd, o_acc[4 * j + 2 * rr] * sc, o_acc[4 * j + 2 * rr + 1] * sc);
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

cudaError_t prepare_wgmma() {
  return prepare_tensor_core(&sparse_attention_wgmma_kernel<true>, &sparse_attention_wgmma_kernel<false>,
                             kWgSmemBytes, 6);
}

cudaError_t launch_wgmma(const KernelArgs& a, cudaStream_t stream) {
  return launch_tensor_core(&sparse_attention_wgmma_kernel<true>, &sparse_attention_wgmma_kernel<false>,
                            kWgThreads, kWgSmemBytes, 6, a, stream);
}

}  // namespace attn
}  // namespace dsv41
