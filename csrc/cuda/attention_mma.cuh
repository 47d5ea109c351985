// Sparse attention with dequantize-on-load, tensor cores (mma.sync m16n8k16 bf16 -> f32),
// templated on the head dim D (config.h MmaTile<D>; one instantiation per
// attention_mma_d<D>.cu).
//
// One CTA = (query token t, 64 heads, key split s). Per query the valid SWA slots and the
// valid selected global entries are compacted (stable, so the order is the index order)
// into one key list in shared memory: SWA keys first, then global keys, in tiles of 64
// (a tile never mixes the two formats). For each tile:
//
//   raw codes --cp.async (2 tiles ahead)--> smem raw[2] --bit-trick dequant--> smem K (bf16)
//   S = Q K^T          8 warps, warp w: heads 16*(w%4).., keys 32*(w/4).., K = D
//   online softmax     row max shared by the two warps of a head row through smem
//   P (bf16) -> smem   with NVFP4 tiles P is scaled by 2^8 (the folded dequant constant)
//   O += P V           warp w: its heads x its kODims dims (MmaTile::kPv*)
//
// V is the K tile itself (MQA, values = keys). Dims live in the permuted pair order of
// dsv41/dequant.h inside shared memory (q is stored the same way); the epilogue writes
// natural order. With one split the epilogue applies 1/l and the sink factor
// sigmoid(lse - sink) and writes out/lse; with several it writes normalised partials and
// lse for attention_combine.cu.
//
// Heads: the CTA's group holds n_heads = min(64, H - h0) live rows. Rows past it hold zero
// queries; S warps whose 16 rows are all past it skip their MMAs, PV m-tiles past it are
// skipped, and nothing is written for them.
//
// Barriers per tile: B0 (K tile ready), B1 (row maxima), B2 (P and alpha ready),
// B3 (PV done: K and P free; raw of the next tile landed). Dequantization of the next
// tile runs between B3 and the next B0, so it is not overlapped with the MMAs of this
// CTA (the wgmma kernel overlaps it; docs/kernels.md).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_cta.cuh"
#include "attention_internal.h"
#include "dsv41/attention/config.h"
#include "dsv41/cuda/ptx.h"
#include "dsv41/dequant.h"

namespace dsv41 {
namespace attn {
namespace mma_detail {

using ptx::cp_async_16;
using ptx::ld_shared_b32;
using ptx::ld_shared_v2;
using ptx::ld_shared_v4;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::mma_bf16_16816;
using ptx::st_shared_b32;
using ptx::st_shared_v4;

// Byte offset of 16-byte chunk c of row r of a [rows][D] bf16 tile (Q, K). XOR with the
// row's low 3 bits spreads the 8 rows that one ldmatrix phase reads over 8 distinct bank
// groups.
template <int kD>
__device__ __forceinline__ uint32_t qk_off(int r, int c) {
  return static_cast<uint32_t>(r * MmaTile<kD>::kRowBytes + ((c ^ (r & 7)) << 4));
}
// The [64][8 chunks] P tile.
__device__ __forceinline__ uint32_t p_off(int r, int c) {
  return static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) << 4));
}

// A scale row of the pool -> shared memory: kBytes = 16 (cp.async.cg), 8 or 4 (cp.async.ca),
// or 2 (FP8 scales at D = 64: a plain load and store, zero when !ok).
template <int kBytes>
__device__ __forceinline__ void copy_scales(uint32_t dst, const uint8_t* src, bool ok) {
  if constexpr (kBytes == 16) {
    cp_async_16(dst, src, ok ? 16u : 0u);
  } else if constexpr (kBytes == 8 || kBytes == 4) {
    ptx::cp_async_ca<kBytes>(dst, src, ok ? static_cast<uint32_t>(kBytes) : 0u);
  } else {
    static_assert(kBytes == 2, "scale rows of 2, 4, 8 or 16 bytes");
    ptx::st_shared_u16(dst, ok ? __ldg(reinterpret_cast<const unsigned short*>(src)) : 0);
  }
}

template <int kD, bool kSplit>
__global__ void __launch_bounds__(kThreads, MmaTile<kD>::kMinCtasPerSm)
    sparse_attention_mma_kernel(const __grid_constant__ KernelArgs args) {
  using C = MmaTile<kD>;
  const SparseAttentionParams& p = args.p;
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int S = kSplit ? args.num_splits : 1;
  const int t = kSplit ? static_cast<int>(blockIdx.x) / S : static_cast<int>(blockIdx.x);
  const int split = kSplit ? static_cast<int>(blockIdx.x) % S : 0;
  const int h0 = static_cast<int>(blockIdx.y) * kHeadsPerCta;
  const int n_heads = min(kHeadsPerCta, p.H - h0);

  const uint32_t sQ = ptx::smem_addr(smem + C::kOffQ);
  const uint32_t sK = ptx::smem_addr(smem + C::kOffK);
  const uint32_t sRaw0 = ptx::smem_addr(smem + C::kOffRaw0);  // raw[b] = sRaw0 + b * kRawBytes
  static_assert(C::kOffRaw1 == C::kOffRaw0 + C::kRawBytes, "raw buffers are adjacent");
  const uint32_t sP = ptx::smem_addr(smem + C::kOffP);
  float* s_red = reinterpret_cast<float*>(smem + C::kOffStats);  // [2][64] row max per key half
  float* s_alpha = s_red + 2 * 64;                                // [64]
  float* s_l = s_alpha + 64;                                      // [2][64]
  float* s_scale = s_l + 2 * 64;                                  // [64]
  int* s_idx = reinterpret_cast<int*>(smem + C::kOffIdx);
  int* s_misc = reinterpret_cast<int*>(smem + C::kOffMisc);

  // ---- q -> bf16, permuted pairs (position 2i+j of a group of 8 holds dim i+4j); rows
  // past n_heads are zeros ----
  {
    const float* qt = p.q + static_cast<int64_t>(t) * p.q_stride_t + static_cast<int64_t>(h0) * p.q_stride_h;
    for (int u = tid; u < kHeadsPerCta * (kD / 8); u += kThreads) {
      const int h = u / (kD / 8), g = u % (kD / 8);
      float4 lo = make_float4(0.f, 0.f, 0.f, 0.f), hi = lo;
      if (h < n_heads) {
        const float4* src = reinterpret_cast<const float4*>(qt + h * p.q_stride_h + 8 * g);
        lo = __ldg(src);
        hi = __ldg(src + 1);
      }
      st_shared_v4(sQ + qk_off<kD>(h, g), dq::floats_to_bf16x2(lo.x, hi.x),
                   dq::floats_to_bf16x2(lo.y, hi.y), dq::floats_to_bf16x2(lo.z, hi.z),
                   dq::floats_to_bf16x2(lo.w, hi.w));
    }
  }

  // ---- the key list of this query ----
  const KeyList kl = build_key_list<kThreads>(p, t, S, split, s_idx, s_misc);
  const int tb = kl.tb, te = kl.te;

  // Raw bytes of tile i -> raw buffer (one commit group, empty past the end). Rows past
  // the tile's valid count are zero-filled (zero codes decode to zeros, and they are
  // masked), so a V row never holds stale data.
  auto issue_raw = [&](int i, uint32_t raw) {
    if (i < te) {
      const Tile ti = kl.tile(i);
      if (!ti.kv) {
        constexpr int kPer = C::kFp8Chunks + 1;  // value chunks + the scale row
        for (int u = tid; u < kTileKeys * kPer; u += kThreads) {
          const int r = u / kPer, c = u - r * kPer;
          const bool ok = r < ti.rows;
          const int64_t row = ok ? s_idx[ti.first + r] : 0;
          if (c < C::kFp8Chunks) {
            cp_async_16(raw + r * kD + ((c ^ (r & C::kFp8Swz)) << 4),
                        p.swa_values + row * p.swa_values_stride + 16 * c, ok ? 16u : 0u);
          } else {
            copy_scales<C::kFp8ScaleBytes>(raw + C::kRawFp8Values + r * C::kFp8ScaleStride,
                                           p.swa_scales + row * p.swa_scales_stride, ok);
          }
        }
      } else {
        constexpr int kPieces = C::kNvfp4ScaleBytes / C::kNvfp4ScalePiece;
        constexpr int kPer = C::kNvfp4Chunks + kPieces;  // code chunks + scale pieces
        for (int u = tid; u < kTileKeys * kPer; u += kThreads) {
          const int r = u / kPer, c = u - r * kPer;
          const bool ok = r < ti.rows;
          const int64_t row = ok ? s_idx[ti.first + r] : 0;
          if (c < C::kNvfp4Chunks) {
            cp_async_16(raw + r * (kD / 2) + ((c ^ (r & C::kNvfp4Swz)) << 4),
                        p.kv_codes + row * p.kv_codes_stride + 16 * c, ok ? 16u : 0u);
          } else {
            const int k = c - C::kNvfp4Chunks;
            copy_scales<C::kNvfp4ScalePiece>(
                raw + C::kRawNvfp4Codes + r * C::kNvfp4ScaleStride + C::kNvfp4ScalePiece * k,
                p.kv_scales + row * p.kv_scales_stride + C::kNvfp4ScalePiece * k, ok);
          }
        }
      }
    }
    ptx::cp_async_commit();
  };

  // Raw buffer -> bf16 K tile. Thread (row r = tid % 64, quarter qq = tid / 64) decodes the
  // kD/4 dims of its quarter of the row, kDqUnits units of 16 values: a warp covers 32 rows
  // at one quarter, so its shared loads and stores (row-XOR swizzled) spread over the banks.
  auto dequant = [&](int i, uint32_t raw) {
    const Tile ti = kl.tile(i);
    const int r = tid & 63, qq = tid >> 6;
    constexpr int kU = C::kDqUnits;
    const int u0 = kU * qq;  // first unit: FP8 raw chunk u (scale u / 2), NVFP4 block u (scale u)
    uint32_t o[4];
    if (!ti.kv) {
      const uint32_t sw = ld_shared_b32(raw + C::kRawFp8Values + r * C::kFp8ScaleStride + 4 * (u0 >> 3)) >>
                          (8 * ((u0 >> 1) & 3));
#pragma unroll
      for (int jb = 0; jb < (kU + 1) / 2; ++jb) {  // a 32-value scale block = units 2jb, 2jb+1
        const dq::Pow2Factor f = dq::ue8m0_factor(static_cast<uint8_t>(sw >> (8 * jb)), dq::kE4M3PatternBias);
#pragma unroll
        for (int jc = 0; jc < (kU < 2 ? kU : 2); ++jc) {
          const int c = u0 + 2 * jb + jc;
          const uint4 v = ld_shared_v4(raw + r * kD + ((c ^ (r & C::kFp8Swz)) << 4));
          dq::fp8_group8(v.x, v.y, f, o);
          st_shared_v4(sK + qk_off<kD>(r, 2 * c), o[0], o[1], o[2], o[3]);
          dq::fp8_group8(v.z, v.w, f, o);
          st_shared_v4(sK + qk_off<kD>(r, 2 * c + 1), o[0], o[1], o[2], o[3]);
        }
      }
    } else if constexpr (kU >= 2) {
      const uint2 sc = ld_shared_v2(raw + C::kRawNvfp4Codes + r * C::kNvfp4ScaleStride + 8 * (u0 >> 3));
      const uint64_t s64 = ((static_cast<uint64_t>(sc.y) << 32) | sc.x) >> (8 * (u0 & 7));
#pragma unroll
      for (int jc = 0; jc < kU / 2; ++jc) {  // 16-byte chunk = 32 values = blocks 2c, 2c+1
        const int c = (u0 >> 1) + jc;
        const uint4 v = ld_shared_v4(raw + r * (kD / 2) + ((c ^ (r & C::kNvfp4Swz)) << 4));
        const uint32_t f0 = dq::nvfp4_factor(static_cast<uint8_t>(s64 >> (16 * jc)));
        const uint32_t f1 = dq::nvfp4_factor(static_cast<uint8_t>(s64 >> (16 * jc + 8)));
        dq::nvfp4_group8(v.x, f0, o);
        st_shared_v4(sK + qk_off<kD>(r, 4 * c + 0), o[0], o[1], o[2], o[3]);
        dq::nvfp4_group8(v.y, f0, o);
        st_shared_v4(sK + qk_off<kD>(r, 4 * c + 1), o[0], o[1], o[2], o[3]);
        dq::nvfp4_group8(v.z, f1, o);
        st_shared_v4(sK + qk_off<kD>(r, 4 * c + 2), o[0], o[1], o[2], o[3]);
        dq::nvfp4_group8(v.w, f1, o);
        st_shared_v4(sK + qk_off<kD>(r, 4 * c + 3), o[0], o[1], o[2], o[3]);
      }
    } else {  // D = 64: one NVFP4 block per thread, the 8-byte half u0 & 1 of chunk u0 / 2
      const int c = u0 >> 1;
      const uint2 v = ld_shared_v2(raw + r * (kD / 2) + ((c ^ (r & C::kNvfp4Swz)) << 4) + 8 * (u0 & 1));
      const uint32_t f = dq::nvfp4_factor(static_cast<uint8_t>(
          ld_shared_b32(raw + C::kRawNvfp4Codes + r * C::kNvfp4ScaleStride + 4 * (u0 >> 2)) >> (8 * (u0 & 3))));
      dq::nvfp4_group8(v.x, f, o);
      st_shared_v4(sK + qk_off<kD>(r, 2 * u0), o[0], o[1], o[2], o[3]);
      dq::nvfp4_group8(v.y, f, o);
      st_shared_v4(sK + qk_off<kD>(r, 2 * u0 + 1), o[0], o[1], o[2], o[3]);
    }
  };

  // ---- per-thread state ----
  const int g = lane >> 2, qd = lane & 3;
  const int srow0 = kSRows * (warp & 3);  // S tile: head rows
  const int skey0 = kSKeys * (warp >> 2); // S tile: key columns
  const int khalf = warp >> 2;
  const bool s_live = srow0 < n_heads;    // warp-uniform: some of this warp's S rows are heads
  const int mt0 = (warp / C::kPvDimGroups) * C::kOMt;  // PV: first m-tile (16 heads) of this warp
  const int oc0 = (warp % C::kPvDimGroups) * C::kONt;  // PV: first 8-dim chunk of this warp
  float m_run[2] = {-INFINITY, -INFINITY};  // rows srow0+g, srow0+g+8 (S warps)
  float l_run[2] = {0.f, 0.f};              // this thread's share of the row sums
  float o_acc[C::kOMt][C::kONt][4];         // O: m-tile (16 heads) x n-tile (8 dims)
#pragma unroll
  for (int mt = 0; mt < C::kOMt; ++mt)
#pragma unroll
    for (int nt = 0; nt < C::kONt; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mt][nt][e] = 0.f;

  // ldmatrix lane addressing (see ptx.h for the fragment layouts).
  const int a_row = srow0 + (lane & 15);
  const uint32_t a_base = sQ + a_row * C::kRowBytes;
  const int b_row = skey0 + (lane & 7) + ((lane >> 4) << 3);
  const uint32_t b_base = sK + b_row * C::kRowBytes;
  uint32_t a_off[4], b_off[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    a_off[j] = static_cast<uint32_t>(((2 * j + (lane >> 4)) ^ (a_row & 7)) << 4);
    b_off[j] = static_cast<uint32_t>(((2 * j + ((lane >> 3) & 1)) ^ (b_row & 7)) << 4);
  }
  const int lx = lane & 7;  // row & 7 of every P / V row this lane addresses
  const uint32_t pa_base = sP + (lane & 15) * 128;
  const int v_key = (lane & 7) + (((lane >> 3) & 1) << 3);
  const uint32_t v_base = sK + v_key * C::kRowBytes;

  // ---- prologue: tiles tb, tb+1 in flight; tile tb decoded ----
  issue_raw(tb, sRaw0);
  issue_raw(tb + 1, sRaw0 + C::kRawBytes);
  ptx::cp_async_wait<1>();
  __syncthreads();
  if (tb < te) dequant(tb, sRaw0);

  for (int i = tb; i < te; ++i) {
    const int buf = (i - tb) & 1;
    __syncthreads();  // B0: K holds tile i; raw[buf] is free
    issue_raw(i + 2, sRaw0 + buf * C::kRawBytes);
    const Tile ti = kl.tile(i);

    // ---- S = Q K^T: 16 heads x 32 keys per warp ----
    float s_acc[16];  // s_acc[4 nt + e]: n-tile nt (8 keys) of the m16n8 accumulator
#pragma unroll
    for (int e = 0; e < 16; ++e) s_acc[e] = 0.f;
    if (s_live) {
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        const uint32_t kofs = 128 * (ks >> 2);
        uint32_t a[4], b0[4], b1[4];
        ldmatrix_x4(a, a_base + kofs + a_off[ks & 3]);
        ldmatrix_x4(b0, b_base + kofs + b_off[ks & 3]);
        ldmatrix_x4(b1, b_base + 16 * C::kRowBytes + kofs + b_off[ks & 3]);
        mma_bf16_16816(*reinterpret_cast<float(*)[4]>(s_acc + 0), a, b0[0], b0[1]);
        mma_bf16_16816(*reinterpret_cast<float(*)[4]>(s_acc + 4), a, b0[2], b0[3]);
        mma_bf16_16816(*reinterpret_cast<float(*)[4]>(s_acc + 8), a, b1[0], b1[1]);
        mma_bf16_16816(*reinterpret_cast<float(*)[4]>(s_acc + 12), a, b1[2], b1[3]);
      }
    }

    // ---- online softmax (log2 domain) ----
    // NVFP4 keys were decoded as value * 2^-8: their logits need 2^8 more, and their
    // probabilities are stored as p * 2^8 so that P V' = p V.
    const float c_tile = p.softmax_scale * kLog2e * (ti.kv ? 256.f : 1.f);
    const float pshift = ti.kv ? 8.f : 0.f;
    float mx[2];
    scale_mask_rowmax(s_acc, skey0, qd, ti.rows, c_tile, mx);
    if (qd == 0) {
      s_red[khalf * 64 + srow0 + g] = mx[0];
      s_red[khalf * 64 + srow0 + g + 8] = mx[1];
    }
    __syncthreads();  // B1
    float alpha[2], m_use[2];
    const float other[2] = {s_red[(khalf ^ 1) * 64 + srow0 + g], s_red[(khalf ^ 1) * 64 + srow0 + g + 8]};
    update_row_max(m_run, mx, other, alpha, m_use);
    float lsum[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const float p00 = ptx::ex2(s_acc[4 * nt + 0] - (m_use[0] - pshift));
      const float p01 = ptx::ex2(s_acc[4 * nt + 1] - (m_use[0] - pshift));
      const float p10 = ptx::ex2(s_acc[4 * nt + 2] - (m_use[1] - pshift));
      const float p11 = ptx::ex2(s_acc[4 * nt + 3] - (m_use[1] - pshift));
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

    // ---- O = O * alpha + P V: this warp's heads x its kODims dims ----
    {
      bool all_one = true;
#pragma unroll
      for (int mt = 0; mt < C::kOMt; ++mt)
        all_one = all_one && s_alpha[16 * (mt0 + mt) + g] == 1.f && s_alpha[16 * (mt0 + mt) + g + 8] == 1.f;
      if (!__all_sync(0xFFFFFFFFu, all_one)) {
#pragma unroll
        for (int mt = 0; mt < C::kOMt; ++mt) {
          const float a0 = s_alpha[16 * (mt0 + mt) + g], a1 = s_alpha[16 * (mt0 + mt) + g + 8];
#pragma unroll
          for (int nt = 0; nt < C::kONt; ++nt) {
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
      uint32_t pa[C::kOMt][4];
#pragma unroll
      for (int mt = 0; mt < C::kOMt; ++mt)
        if (16 * (mt0 + mt) < n_heads)
          ldmatrix_x4(pa[mt], pa_base + (mt0 + mt) * 16 * 128 + (((2 * ks + (lane >> 4)) ^ lx) << 4));
#pragma unroll
      for (int np = 0; np < C::kONt / 2; ++np) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_base + ks * 16 * C::kRowBytes + (((oc0 + 2 * np + (lane >> 4)) ^ lx) << 4));
#pragma unroll
        for (int mt = 0; mt < C::kOMt; ++mt) {
          if (16 * (mt0 + mt) >= n_heads) continue;  // warp-uniform: padding heads only
          mma_bf16_16816(o_acc[mt][2 * np], pa[mt], vb[0], vb[1]);
          mma_bf16_16816(o_acc[mt][2 * np + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }

    ptx::cp_async_wait<1>();  // raw of tile i+1 (this thread's copies) landed
    __syncthreads();          // B3: K and P free, raw of tile i+1 visible to all
    if (i + 1 < te) dequant(i + 1, sRaw0 + (buf ^ 1) * C::kRawBytes);
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
      if (row >= n_heads) continue;
      float lse, scale;
      row_lse_scale<kSplit>(s_l[row] + s_l[64 + row], m_run[rr], p.sink[h0 + row], lse, scale);
      s_scale[row] = scale;
      *lse_slot<kSplit>(args, t, split, h0 + row) = lse;
    }
  }
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < C::kOMt; ++mt) {
    if (16 * (mt0 + mt) >= n_heads) continue;  // warp-uniform
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = 16 * (mt0 + mt) + g + 8 * rr;
      const bool live = row < n_heads;  // the shuffles below need all 4 lanes of the row
      const float sc = live ? s_scale[row] : 0.f;
      float* dst = out_row<kSplit>(args, t, split, h0 + (live ? row : 0));
#pragma unroll
      for (int nt = 0; nt < C::kONt; ++nt) {
        store_row_pair(dst, 8 * (oc0 + nt) + 2 * qd, qd, o_acc[mt][nt][2 * rr] * sc,
                       o_acc[mt][nt][2 * rr + 1] * sc, live);
      }
    }
  }
}

}  // namespace mma_detail

// One instantiation per head dim (attention_mma_d<D>.cu); attention.cu picks.
template <int kD>
constexpr int kMmaSmemSlot = kD == 512 ? 0 : kD == 128 ? 2 : 4;

template <int kD>
cudaError_t prepare_mma_d() {
  return prepare_tensor_core(&mma_detail::sparse_attention_mma_kernel<kD, true>,
                             &mma_detail::sparse_attention_mma_kernel<kD, false>, MmaTile<kD>::kSmemBytes,
                             kMmaSmemSlot<kD>);
}

template <int kD>
cudaError_t launch_mma_d(const KernelArgs& a, cudaStream_t stream) {
  return launch_tensor_core(&mma_detail::sparse_attention_mma_kernel<kD, true>,
                            &mma_detail::sparse_attention_mma_kernel<kD, false>, kThreads,
                            MmaTile<kD>::kSmemBytes, kMmaSmemSlot<kD>, a, stream);
}

}  // namespace attn
}  // namespace dsv41
