// Sparse attention with dequantize-on-load, tensor cores (mma.sync m16n8k16 bf16 -> f32).
//
// One CTA = (query token t, 64 heads, key split s). Per query the valid SWA slots and the
// valid selected global entries are compacted (stable, so the order is the index order)
// into one key list in shared memory: SWA keys first, then global keys, in tiles of 64
// (a tile never mixes the two formats). For each tile:
//
//   raw codes --cp.async (2 tiles ahead)--> smem raw[2] --bit-trick dequant--> smem K (bf16)
//   S = Q K^T          8 warps, warp w: heads 16*(w%4).., keys 32*(w/4).., K = 512
//   online softmax     row max shared by the two warps of a head row through smem
//   P (bf16) -> smem   with NVFP4 tiles P is scaled by 2^8 (the folded dequant constant)
//   O += P V           warp w: all 64 heads x dims 64*w.. (O: 128 fp32 registers/thread)
//
// V is the K tile itself (MQA, values = keys). Dims live in the permuted pair order of
// dsv41/dequant.h inside shared memory (q is stored the same way); the epilogue writes
// natural order. With one split the epilogue applies 1/l and the sink factor
// sigmoid(lse - sink) and writes out/lse; with several it writes normalised partials and
// lse for attention_combine.cu.
//
// Barriers per tile: B0 (K tile ready), B1 (row maxima), B2 (P and alpha ready),
// B3 (PV done: K and P free; raw of the next tile landed). Dequantization of the next
// tile runs between B3 and the next B0, so it is not overlapped with the MMAs of this
// CTA (docs/kernels.md: the first optimisation to make once it can be measured).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_compact.cuh"
#include "attention_internal.h"
#include "dsv41/attention/config.h"
#include "dsv41/cuda/ptx.h"
#include "dsv41/dequant.h"
#include "dsv41/formats.h"

namespace dsv41 {
namespace attn {
namespace {

using ptx::cp_async_16;
using ptx::ld_shared_b32;
using ptx::ld_shared_v2;
using ptx::ld_shared_v4;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::mma_bf16_16816;
using ptx::st_shared_b32;
using ptx::st_shared_v4;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Byte offset of 16-byte chunk c of row r: [rows][64 chunks] tiles (Q, K) and the
// [64][8 chunks] P tile. XOR with the row's low 3 bits spreads the 8 rows that one
// ldmatrix phase reads over 8 distinct bank groups.
__device__ __forceinline__ uint32_t qk_off(int r, int c) {
  return static_cast<uint32_t>(r * 1024 + ((c ^ (r & 7)) << 4));
}
__device__ __forceinline__ uint32_t p_off(int r, int c) {
  return static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) << 4));
}

struct Tile {
  int first;  // position in the compacted key list
  int rows;   // valid rows (1..64)
  bool kv;    // NVFP4 global entries (else FP8 SWA)
};

template <bool kSplit>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_attention_mma_kernel(const __grid_constant__ KernelArgs args) {
  const SparseAttentionParams& p = args.p;
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int S = kSplit ? args.num_splits : 1;
  const int t = kSplit ? static_cast<int>(blockIdx.x) / S : static_cast<int>(blockIdx.x);
  const int split = kSplit ? static_cast<int>(blockIdx.x) % S : 0;
  const int h0 = static_cast<int>(blockIdx.y) * kHeadsPerCta;

  const uint32_t sQ = ptx::smem_addr(smem + kOffQ);
  const uint32_t sK = ptx::smem_addr(smem + kOffK);
  const uint32_t sRaw0 = ptx::smem_addr(smem + kOffRaw0);  // raw[b] = sRaw0 + b * kRawBytes
  static_assert(kOffRaw1 == kOffRaw0 + kRawBytes, "raw buffers are adjacent");
  const uint32_t sP = ptx::smem_addr(smem + kOffP);
  float* s_red = reinterpret_cast<float*>(smem + kOffStats);  // [2][64] row max per key half
  float* s_alpha = s_red + 2 * 64;                             // [64]
  float* s_l = s_alpha + 64;                                   // [2][64]
  float* s_scale = s_l + 2 * 64;                               // [64]
  float* s_lse = s_scale + 64;                                 // [64]
  int* s_idx = reinterpret_cast<int*>(smem + kOffIdx);
  int* s_misc = reinterpret_cast<int*>(smem + kOffMisc);

  // ---- q -> bf16, permuted pairs (position 2i+j of a group of 8 holds dim i+4j) ----
  {
    const float* qt = p.q + static_cast<int64_t>(t) * p.q_stride_t + static_cast<int64_t>(h0) * p.q_stride_h;
    for (int u = tid; u < kHeadsPerCta * (kHeadDim / 8); u += kThreads) {
      const int h = u >> 6, g = u & 63;
      const float4* src = reinterpret_cast<const float4*>(qt + h * p.q_stride_h + 8 * g);
      const float4 lo = __ldg(src), hi = __ldg(src + 1);
      st_shared_v4(sQ + qk_off(h, g), dq::floats_to_bf16x2(lo.x, hi.x),
                   dq::floats_to_bf16x2(lo.y, hi.y), dq::floats_to_bf16x2(lo.z, hi.z),
                   dq::floats_to_bf16x2(lo.w, hi.w));
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

  // Raw bytes of tile i -> raw buffer (one commit group, empty past the end). Rows past
  // the tile's valid count are zero-filled (zero codes decode to zeros, and they are
  // masked), so a V row never holds stale data.
  auto issue_raw = [&](int i, uint32_t raw) {
    if (i < te) {
      const Tile ti = tile(i);
      if (!ti.kv) {
        for (int u = tid; u < kTileKeys * 33; u += kThreads) {
          const int r = u / 33, c = u - r * 33;
          const bool ok = r < ti.rows;
          const int64_t row = ok ? s_idx[ti.first + r] : 0;
          const uint8_t* src;
          uint32_t dst;
          if (c < 32) {
            src = p.swa_values + row * p.swa_values_stride + 16 * c;
            dst = raw + r * 512 + ((c ^ (r & 7)) << 4);
          } else {
            src = p.swa_scales + row * p.swa_scales_stride;
            dst = raw + kRawFp8Values + r * 16;
          }
          cp_async_16(dst, src, ok ? 16u : 0u);
        }
      } else {
        for (int u = tid; u < kTileKeys * 18; u += kThreads) {
          const int r = u / 18, c = u - r * 18;
          const bool ok = r < ti.rows;
          const int64_t row = ok ? s_idx[ti.first + r] : 0;
          const uint8_t* src;
          uint32_t dst;
          if (c < 16) {
            src = p.kv_codes + row * p.kv_codes_stride + 16 * c;
            dst = raw + r * 256 + ((c ^ (r & 7)) << 4);
          } else {
            src = p.kv_scales + row * p.kv_scales_stride + 16 * (c - 16);
            dst = raw + kRawNvfp4Codes + r * 32 + 16 * (c - 16);
          }
          cp_async_16(dst, src, ok ? 16u : 0u);
        }
      }
    }
    ptx::cp_async_commit();
  };

  // Raw buffer -> bf16 K tile. Thread (row r = tid % 64, quarter qq = tid / 64) decodes the
  // 128 dims 128*qq.. of its row: a warp covers 32 rows at one quarter, so its 16-byte
  // shared loads and stores (row-XOR swizzled) hit 8 distinct bank groups per phase.
  auto dequant = [&](int i, uint32_t raw) {
    const Tile ti = tile(i);
    const int r = tid & 63, qq = tid >> 6;
    uint32_t o[4];
    if (!ti.kv) {
      const uint32_t sc = ld_shared_b32(raw + kRawFp8Values + r * 16 + 4 * qq);
#pragma unroll
      for (int jb = 0; jb < 4; ++jb) {  // 32-value block 4*qq + jb = chunks 2 of 16 values
        const dq::Pow2Factor f =
            dq::ue8m0_factor(static_cast<uint8_t>(sc >> (8 * jb)), dq::kE4M3PatternBias);
#pragma unroll
        for (int jc = 0; jc < 2; ++jc) {
          const int c = 8 * qq + 2 * jb + jc;
          const uint4 v = ld_shared_v4(raw + r * 512 + ((c ^ (r & 7)) << 4));
          dq::fp8_group8(v.x, v.y, f, o);
          st_shared_v4(sK + qk_off(r, 2 * c), o[0], o[1], o[2], o[3]);
          dq::fp8_group8(v.z, v.w, f, o);
          st_shared_v4(sK + qk_off(r, 2 * c + 1), o[0], o[1], o[2], o[3]);
        }
      }
    } else {
      const uint2 sc = ld_shared_v2(raw + kRawNvfp4Codes + r * 32 + 8 * qq);
#pragma unroll
      for (int jc = 0; jc < 4; ++jc) {  // 16-byte chunk = 32 values = blocks 2c, 2c+1
        const int c = 4 * qq + jc;
        const uint4 v = ld_shared_v4(raw + r * 256 + ((c ^ (r & 7)) << 4));
        const uint32_t sw = jc < 2 ? sc.x : sc.y;
        const uint32_t f0 = dq::nvfp4_factor(static_cast<uint8_t>(sw >> (16 * (jc & 1))));
        const uint32_t f1 = dq::nvfp4_factor(static_cast<uint8_t>(sw >> (16 * (jc & 1) + 8)));
        dq::nvfp4_group8(v.x, f0, o);
        st_shared_v4(sK + qk_off(r, 4 * c + 0), o[0], o[1], o[2], o[3]);
        dq::nvfp4_group8(v.y, f0, o);
        st_shared_v4(sK + qk_off(r, 4 * c + 1), o[0], o[1], o[2], o[3]);
        dq::nvfp4_group8(v.z, f1, o);
        st_shared_v4(sK + qk_off(r, 4 * c + 2), o[0], o[1], o[2], o[3]);
        dq::nvfp4_group8(v.w, f1, o);
        st_shared_v4(sK + qk_off(r, 4 * c + 3), o[0], o[1], o[2], o[3]);
      }
    }
  };

  // ---- per-thread state ----
  const int g = lane >> 2, qd = lane & 3;
  const int srow0 = kSRows * (warp & 3);  // S tile: head rows
  const int skey0 = kSKeys * (warp >> 2); // S tile: key columns
  const int khalf = warp >> 2;
  float m_run[2] = {-INFINITY, -INFINITY};  // rows srow0+g, srow0+g+8 (S warps)
  float l_run[2] = {0.f, 0.f};              // this thread's share of the row sums
  float o_acc[4][8][4];                     // O: m-tile (16 heads) x n-tile (8 dims)
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mt][nt][e] = 0.f;

  // ldmatrix lane addressing (see ptx.h for the fragment layouts).
  const int a_row = srow0 + (lane & 15);
  const uint32_t a_base = sQ + a_row * 1024;
  const int b_row = skey0 + (lane & 7) + ((lane >> 4) << 3);
  const uint32_t b_base = sK + b_row * 1024;
  uint32_t a_off[4], b_off[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    a_off[j] = static_cast<uint32_t>(((2 * j + (lane >> 4)) ^ (a_row & 7)) << 4);
    b_off[j] = static_cast<uint32_t>(((2 * j + ((lane >> 3) & 1)) ^ (b_row & 7)) << 4);
  }
  const int lx = lane & 7;  // row & 7 of every P / V row this lane addresses
  const uint32_t pa_base = sP + (lane & 15) * 128;
  const int v_key = (lane & 7) + (((lane >> 3) & 1) << 3);
  const uint32_t v_base = sK + v_key * 1024 + 128 * warp;

  // ---- prologue: tiles tb, tb+1 in flight; tile tb decoded ----
  issue_raw(tb, sRaw0);
  issue_raw(tb + 1, sRaw0 + kRawBytes);
  ptx::cp_async_wait<1>();
  __syncthreads();
  if (tb < te) dequant(tb, sRaw0);

  for (int i = tb; i < te; ++i) {
    const int buf = (i - tb) & 1;
    __syncthreads();  // B0: K holds tile i; raw[buf] is free
    issue_raw(i + 2, sRaw0 + buf * kRawBytes);
    const Tile ti = tile(i);

    // ---- S = Q K^T: 16 heads x 32 keys per warp ----
    float s_acc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s_acc[nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      const uint32_t kofs = 128 * (ks >> 2);
      uint32_t a[4], b0[4], b1[4];
      ldmatrix_x4(a, a_base + kofs + a_off[ks & 3]);
      ldmatrix_x4(b0, b_base + kofs + b_off[ks & 3]);
      ldmatrix_x4(b1, b_base + 16 * 1024 + kofs + b_off[ks & 3]);
      mma_bf16_16816(s_acc[0], a, b0[0], b0[1]);
      mma_bf16_16816(s_acc[1], a, b0[2], b0[3]);
      mma_bf16_16816(s_acc[2], a, b1[0], b1[1]);
      mma_bf16_16816(s_acc[3], a, b1[2], b1[3]);
    }

    // ---- online softmax (log2 domain) ----
    // NVFP4 keys were decoded as value * 2^-8: their logits need 2^8 more, and their
    // probabilities are stored as p * 2^8 so that P V' = p V.
    const float c_tile = p.softmax_scale * kLog2e * (ti.kv ? 256.f : 1.f);
    const float pshift = ti.kv ? 8.f : 0.f;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = skey0 + 8 * nt + 2 * qd + e < ti.rows;
        s_acc[nt][e] = valid ? s_acc[nt][e] * c_tile : -INFINITY;
        s_acc[nt][2 + e] = valid ? s_acc[nt][2 + e] * c_tile : -INFINITY;
        mx[0] = fmaxf(mx[0], s_acc[nt][e]);
        mx[1] = fmaxf(mx[1], s_acc[nt][2 + e]);
      }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xFFFFFFFFu, mx[rr], 1));
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xFFFFFFFFu, mx[rr], 2));
    }
    if (qd == 0) {
      s_red[khalf * 64 + srow0 + g] = mx[0];
      s_red[khalf * 64 + srow0 + g + 8] = mx[1];
    }
    __syncthreads();  // B1
    float alpha[2], m_use[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const float other = s_red[(khalf ^ 1) * 64 + srow0 + g + 8 * rr];
      const float m_new = fmaxf(m_run[rr], fmaxf(mx[rr], other));  // same in both halves
      m_use[rr] = m_new == -INFINITY ? 0.f : m_new;  // no valid key yet: p = 0, alpha = 0
      alpha[rr] = ptx::ex2(m_run[rr] - m_use[rr]);
      m_run[rr] = m_new;
    }
    float lsum[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const float p00 = ptx::ex2(s_acc[nt][0] - (m_use[0] - pshift));
      const float p01 = ptx::ex2(s_acc[nt][1] - (m_use[0] - pshift));
      const float p10 = ptx::ex2(s_acc[nt][2] - (m_use[1] - pshift));
      const float p11 = ptx::ex2(s_acc[nt][3] - (m_use[1] - pshift));
      lsum[0] += p00 + p01;
      lsum[1] += p10 + p11;
      const int chunk = (skey0 >> 3) + nt;
      st_shared_b32(sP + p_off(srow0 + g, chunk) + 4 * qd, dq::floats_to_bf16x2(p00, p01));
      st_shared_b32(sP + p_off(srow0 + g + 8, chunk) + 4 * qd, dq::floats_to_bf16x2(p10, p11));
    }
    const float lscale = ti.kv ? (1.f / 256.f) : 1.f;
    l_run[0] = l_run[0] * alpha[0] + lsum[0] * lscale;
    l_run[1] = l_run[1] * alpha[1] + lsum[1] * lscale;
    if (warp < 4 && qd == 0) {
      s_alpha[srow0 + g] = alpha[0];
      s_alpha[srow0 + g + 8] = alpha[1];
    }
    __syncthreads();  // B2

    // ---- O = O * alpha + P V: 64 heads x 64 dims per warp ----
    {
      bool all_one = true;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
        all_one = all_one && s_alpha[16 * mt + g] == 1.f && s_alpha[16 * mt + g + 8] == 1.f;
      if (!__all_sync(0xFFFFFFFFu, all_one)) {
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          const float a0 = s_alpha[16 * mt + g], a1 = s_alpha[16 * mt + g + 8];
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            o_acc[mt][nt][0] *= a0;
            o_acc[mt][nt][1] *= a0;
            o_acc[mt][nt][2] *= a1;
            o_acc[mt][nt][3] *= a1;
          }
        }
      }
    }
#pragma unroll
    for (int ks = 0; ks < kTileKeys / 16; ++ks) {
      uint32_t pa[4][4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
        ldmatrix_x4(pa[mt], pa_base + mt * 16 * 128 + (((2 * ks + (lane >> 4)) ^ lx) << 4));
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_base + ks * 16 * 1024 + (((2 * np + (lane >> 4)) ^ lx) << 4));
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          mma_bf16_16816(o_acc[mt][2 * np], pa[mt], vb[0], vb[1]);
          mma_bf16_16816(o_acc[mt][2 * np + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }

    ptx::cp_async_wait<1>();  // raw of tile i+1 (this thread's copies) landed
    __syncthreads();          // B3: K and P free, raw of tile i+1 visible to all
    if (i + 1 < te) dequant(i + 1, sRaw0 + (buf ^ 1) * kRawBytes);
  }
  ptx::cp_async_wait<0>();

  // ---- epilogue: l, lse, 1/l and the sink factor per head row ----
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l_run[rr] += __shfl_xor_sync(0xFFFFFFFFu, l_run[rr], 1);
    l_run[rr] += __shfl_xor_sync(0xFFFFFFFFu, l_run[rr], 2);
  }
  if (qd == 0) {
    s_l[khalf * 64 + srow0 + g] = l_run[0];
    s_l[khalf * 64 + srow0 + g + 8] = l_run[1];
  }
  __syncthreads();
  if (warp < 4 && qd == 0) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = srow0 + g + 8 * rr;
      const float lt = s_l[row] + s_l[64 + row];
      float lse, scale;
      if (lt == 0.f) {  // no valid key (m is -inf): out = 0, lse = -inf
        lse = -INFINITY;
        scale = 0.f;
      } else if (lt != lt) {  // a NaN key (poisoned block): out = NaN and, as the
        lse = kSplit ? NAN : -INFINITY;  // reference has it, lse = -inf (the combine step
        scale = NAN;                     // needs to see the NaN, so partials keep it)
      } else {
        lse = (m_run[rr] + log2f(lt)) * kLn2;
        scale = 1.f / lt;
        if (!kSplit) scale *= 1.f / (1.f + expf(p.sink[h0 + row] - lse));
      }
      s_scale[row] = scale;
      s_lse[row] = lse;
      if (kSplit)
        args.ws_lse[(static_cast<int64_t>(t) * S + split) * p.H + h0 + row] = lse;
      else
        p.lse[static_cast<int64_t>(t) * p.lse_stride_t + h0 + row] = lse;
    }
  }
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = 16 * mt + g + 8 * rr;
      const float sc = s_scale[row];
      float* dst = kSplit ? args.ws_o + ((static_cast<int64_t>(t) * S + split) * p.H + h0 + row) * kHeadDim
                          : p.out + static_cast<int64_t>(t) * p.out_stride_t +
                                static_cast<int64_t>(h0 + row) * p.out_stride_h;
      // Lane qd holds dims qd and qd+4 of each group of 8 (stored positions 2qd, 2qd+1). Four
      // shuffles among the row's 4 lanes give lane qd dims 2qd, 2qd+1: one 8-byte store per
      // lane, 32 contiguous bytes per row per instruction (not 4-byte scalar stores).
      const int src0 = (2 * qd) & 3, src1 = (2 * qd + 1) & 3, hi = qd >> 1;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float x0 = o_acc[mt][nt][2 * rr] * sc, x1 = o_acc[mt][nt][2 * rr + 1] * sc;
        const float a0 = __shfl_sync(0xFFFFFFFFu, x0, src0, 4), a1 = __shfl_sync(0xFFFFFFFFu, x1, src0, 4);
        const float b0 = __shfl_sync(0xFFFFFFFFu, x0, src1, 4), b1 = __shfl_sync(0xFFFFFFFFu, x1, src1, 4);
        const int dim = 8 * (8 * warp + nt) + 2 * qd;
        *reinterpret_cast<float2*>(dst + dim) = make_float2(hi ? a1 : a0, hi ? b1 : b0);
      }
    }
  }
  (void)s_lse;
}

}  // namespace

cudaError_t launch_mma(const KernelArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.p.T) * static_cast<unsigned>(a.num_splits),
                  static_cast<unsigned>(a.p.H / kHeadsPerCta));
  if (a.num_splits > 1) {
    const void* f = reinterpret_cast<const void*>(&sparse_attention_mma_kernel<true>);
    cudaError_t e = ensure_smem_attribute(f, kSmemBytes, 0);
    if (e != cudaSuccess) return e;
    sparse_attention_mma_kernel<true><<<grid, kThreads, kSmemBytes, stream>>>(a);
  } else {
    const void* f = reinterpret_cast<const void*>(&sparse_attention_mma_kernel<false>);
    cudaError_t e = ensure_smem_attribute(f, kSmemBytes, 1);
    if (e != cudaSuccess) return e;
    sparse_attention_mma_kernel<false><<<grid, kThreads, kSmemBytes, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace attn
}  // namespace dsv41
