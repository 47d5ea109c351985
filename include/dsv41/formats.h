// dsv41 KV-cache formats: the one truth for every element conversion and block codec.
//
// Framework-free and __host__ __device__: the C++ CPU ops, the CUDA kernels and the tests
// all run exactly this code, so "CPU == GPU bit for bit" holds by construction and the
// CPU build tests what the GPU runs. The float32 torch reference in
// python/dsv41/formats/reference.py implements the same algorithms independently.
//
// Formats (docs/design.md#formats):
//   NVFP4   (main global KV):  E2M1 codes, one E4M3 scale per 16 values, no global scale.
//   MXFP4   (indexer keys/q):  E2M1 codes, one UE8M0 scale per 32 values.
//   FP8 SWA (SWA KV):          E4M3 values, one UE8M0 scale per 32 values.
//   FP8 V4  (DeepSeek-V4 main KV, FlashMLA "MODEL1" FP8 sparse entry): one packed record
//            per entry, E4M3 no-RoPE dims with one UE8M0 scale per 64, bf16 RoPE dims
//            (rules in its section below).
// Packing: two E2M1 codes per byte, element 2k in the low nibble of byte k; sign is bit 3
// of each nibble. Scales are separate arrays, one per block, in element order.
//
// Rounding and special values (written once, here):
//   * Every rounding is round-to-nearest, ties to even (RNE), done on float32 inputs.
//   * E4M3 (the "fn" variant: no infinities, 0x7F/0xFF are NaN, max 448) saturates to
//     +-448; E2M1 saturates to +-6.
//   * Zero keeps its sign: a negative value that rounds to zero encodes as -0 (E2M1 0b1000,
//     E4M3 0x80), except in an NVFP4 block whose scale rounds to 0, which is all +0.
//   * NVFP4 scale: s = E4M3(min(amax / 6, 448)); if s == 0 every code is +0; otherwise
//     code_i = E2M1(x_i / s) with x_i / s computed in float32 with the rounded s.
//   * MXFP4 / FP8 SWA scale: s = the smallest power of two >= fl32(amax / 6) (resp.
//     amax / 448), stored as UE8M0 (biased exponent, 127 = 2^0). The smallest scale is
//     2^-127 (code 0), also used for an all-zero block. x_i / s is exact-by-construction
//     scaling by a power of two, computed here as x_i * 2^-e (the same real number, so
//     the same float32 result as a division).
//   * Non-finite input (NaN or +-Inf anywhere in a block) is outside the formats' domain.
//     Such a block is stored poisoned: its scale is the NaN code (E4M3 0x7F, UE8M0 0xFF)
//     and its codes are 0, so the whole block decodes to NaN. Every path does the same,
//     so even garbage in gives identical bits everywhere and is visible on decode.
//   * Every NaN a decoder writes is the canonical float32 NaN 0x7FC00000 (kF32NaN). IEEE
//     754 leaves a NaN result's sign and payload to the hardware: x86 returns the NaN
//     operand (a NaN scale code 0xFF of E4M3 decodes to -NaN, 0xFFC00000), NVIDIA GPUs
//     write 0x7FFFFFFF. Decoders therefore pass each product through scaled_value().
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__CUDACC__)
#define DSV41_HD __host__ __device__ __forceinline__
#define DSV41_UNROLL _Pragma("unroll")
#else
#define DSV41_HD inline
#define DSV41_UNROLL _Pragma("GCC unroll 32")
#endif

namespace dsv41 {
namespace fmt {

constexpr int kNvfp4Block = 16;
constexpr int kMxfp4Block = 32;
constexpr int kFp8SwaBlock = 32;

constexpr int kFp8V4Tile = 64;  // no-RoPE values per UE8M0 scale in the V4 entry

constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3NaN = 0x7F;
constexpr uint8_t kUE8M0NaN = 0xFF;
constexpr uint8_t kUE8M0Min = 0x00;  // 2^-127

DSV41_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

DSV41_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

DSV41_HD bool is_finite(float x) { return (float_bits(x) & 0x7F800000u) != 0x7F800000u; }

constexpr uint32_t kF32NaN = 0x7FC00000u;  // the one NaN every decoder writes

// x, or the canonical NaN if x is any NaN. A bit test, not x != x, so that no compiler
// flag (fast-math) can fold it away.
DSV41_HD float canonical_nan(float x) {
  return (float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u ? bits_float(kF32NaN) : x;
}

// A decoded element times its block's decoded scale: the product every decoder (CPU loop,
// CUDA kernel) writes, with its NaN bits fixed by the format rather than the hardware.
DSV41_HD float scaled_value(float v, float s) { return canonical_nan(v * s); }

// ---- bf16 -----------------------------------------------------------------------------

DSV41_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// Round-to-nearest-even float -> bf16 bits (NaN stays a quiet NaN of the same sign; a
// finite value past the largest bf16 rounds to +-Inf, as RNE does).
DSV41_HD uint16_t float_to_bf16_rne(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 2^(e - 127) for a UE8M0 code e in [0, 254]; e == 0 gives the subnormal 2^-127.
DSV41_HD float ue8m0_to_float(uint8_t e) {
  if (e == kUE8M0NaN) return bits_float(kF32NaN);
  if (e == 0) return bits_float(0x00400000u);
  return bits_float(static_cast<uint32_t>(e) << 23);
}

// 2^(127 - e): the exact reciprocal of the scale. Representable for e in [1, 254]
// (2^126 .. 2^-127); for e == 0 it is 2^127.
DSV41_HD float ue8m0_reciprocal(uint8_t e) {
  const int p = 127 - static_cast<int>(e);  // in [-127, 127]
  if (p >= -126) return bits_float(static_cast<uint32_t>(p + 127) << 23);
  return bits_float(0x00400000u);  // 2^-127 (subnormal)
}

// UE8M0 code of the smallest power of two >= v, for finite v >= 0; clamped below at
// 2^-127 (code 0). v < 2^128/6 in every caller, so the code never exceeds 254.
DSV41_HD uint8_t ue8m0_ceil_pow2(float v) {
  const uint32_t b = float_bits(v) & 0x7FFFFFFFu;
  const uint32_t exp = b >> 23;
  const uint32_t man = b & 0x7FFFFFu;
  if (exp == 0) {
    // Zero or subnormal: v <= 2^-127 -> 2^-127 (code 0); else 2^-126 (code 1).
    return man > 0x400000u ? 1 : 0;
  }
  const uint32_t code = man ? exp + 1 : exp;
  return static_cast<uint8_t>(code > 254u ? 254u : code);
}

// ---- E2M1 (FP4): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 -------------------------------

// RNE to the E2M1 grid with saturation at 6. Each threshold is a midpoint between two
// neighbours; '>' sends the tie down and '>=' up, whichever neighbour has the even code.
DSV41_HD uint8_t e2m1_encode(float x) {
  const float a = fabsf(x);
  uint8_t code = static_cast<uint8_t>((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) +
                                      (a > 2.5f) + (a >= 3.5f) + (a > 5.0f));
  const uint8_t sign = (float_bits(x) >> 31) ? 0x8 : 0x0;
  return static_cast<uint8_t>(code | sign);
}

DSV41_HD float e2m1_decode(uint8_t code) {
  // Bit form (no table): magnitude m = code & 7; exponent field e = m >> 1, mantissa m & 1.
  // e == 0 is the subnormal 0 / 0.5; otherwise (1 + mant/2) * 2^(e-1).
  const uint32_t m = code & 0x7u;
  const uint32_t e = m >> 1;
  float mag = e == 0 ? 0.5f * static_cast<float>(m & 1u)
                     : bits_float(((e + 126u) << 23) | ((m & 1u) << 22));
  return (code & 0x8u) ? -mag : mag;
}

// ---- E4M3 (fn): bias 7, max 448, subnormal step 2^-9, 0x7F/0xFF NaN -------------------

DSV41_HD uint8_t e4m3_encode(float x) {
  const uint32_t b = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  const uint32_t ab = b & 0x7FFFFFFFu;
  if (ab > 0x7F800000u) return static_cast<uint8_t>(sign | kE4M3NaN);  // NaN
  const float a = bits_float(ab);
  if (a >= kE4M3Max) return static_cast<uint8_t>(sign | 0x7E);  // saturate (also +-Inf)
  if (a < 0.015625f) {
    // Subnormal range (below 2^-6): multiples of 2^-9. a * 512 is exact; rintf is RNE.
    // A result of 8 is 2^-6, whose code 0x08 is the smallest normal: still correct.
    const uint32_t q = static_cast<uint32_t>(rintf(a * 512.0f));
    return static_cast<uint8_t>(sign | q);
  }
  // Normal: keep 3 of the 23 mantissa bits with RNE, then rebias 127 -> 7.
  const uint32_t rounded = (ab + 0x7FFFFu + ((ab >> 20) & 1u)) & ~0xFFFFFu;
  const uint32_t code = (((rounded >> 23) - 120u) << 3) | ((rounded >> 20) & 7u);
  return static_cast<uint8_t>(sign | (code > 0x7Eu ? 0x7Eu : code));
}

DSV41_HD float e4m3_decode(uint8_t code) {
  const uint32_t mag = code & 0x7Fu;
  float v;
  if (mag == 0x7Fu) {
    v = bits_float(kF32NaN);
  } else if ((mag >> 3) == 0) {
    v = static_cast<float>(mag) * 0.001953125f;  // m * 2^-9, exact
  } else {
    // Rebias 7 -> 127 and widen the 3-bit mantissa: an exact float32 bit pattern.
    v = bits_float((((mag >> 3) + 120u) << 23) | ((mag & 7u) << 20));
  }
  return (code & 0x80u) ? -v : v;
}

// ---- Scale rules ----------------------------------------------------------------------
// Given a block's amax and whether all its values were finite, the stored scale code.
// The CUDA kernels reduce amax across lanes and then call these, so the scale rule itself
// exists once.

DSV41_HD uint8_t nvfp4_scale_code(float amax, bool finite) {
  return finite ? e4m3_encode(fminf(amax / kE2M1Max, kE4M3Max)) : kE4M3NaN;
}

DSV41_HD uint8_t mxfp4_scale_code(float amax, bool finite) {
  return finite ? ue8m0_ceil_pow2(amax / kE2M1Max) : kUE8M0NaN;
}

DSV41_HD uint8_t fp8_swa_scale_code(float amax, bool finite) {
  return finite ? ue8m0_ceil_pow2(amax / kE4M3Max) : kUE8M0NaN;
}

// Element encoders given the stored scale code. A poisoned block (NaN scale) and an
// NVFP4 block with a zero scale encode every element as +0.
DSV41_HD uint8_t nvfp4_encode_elem(float x, uint8_t scale_code) {
  const float s = e4m3_decode(scale_code);
  if (scale_code == kE4M3NaN || s == 0.0f) return 0;
  return e2m1_encode(x / s);
}

DSV41_HD uint8_t mxfp4_encode_elem(float x, uint8_t scale_code) {
  if (scale_code == kUE8M0NaN) return 0;
  return e2m1_encode(x * ue8m0_reciprocal(scale_code));
}

DSV41_HD uint8_t fp8_swa_encode_elem(float x, uint8_t scale_code) {
  if (scale_code == kUE8M0NaN) return 0;
  return e4m3_encode(x * ue8m0_reciprocal(scale_code));
}

// ---- Block codecs ---------------------------------------------------------------------
// Each takes one block of float32 values and writes its codes and one scale: the unit
// the CPU loops call. The CUDA kernels spread a block over lanes but use the same scale
// rules and element encoders above.

// amax over a block, and whether every value is finite.
template <int N>
DSV41_HD float block_amax(const float* x, bool* finite) {
  float amax = 0.0f;
  bool ok = true;
  DSV41_UNROLL
  for (int i = 0; i < N; ++i) {
    ok = ok && is_finite(x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
  *finite = ok;
  return amax;
}

// Packs two E2M1 codes: element 2k in the low nibble.
DSV41_HD uint8_t pack_e2m1(uint8_t lo, uint8_t hi) { return static_cast<uint8_t>(lo | (hi << 4)); }

// N packed E2M1 codes times one decoded scale: both FP4 formats decode this way.
template <int N>
DSV41_HD void decode_e2m1_packed(const uint8_t* codes, float s, float* y) {
  DSV41_UNROLL
  for (int k = 0; k < N / 2; ++k) {
    y[2 * k] = scaled_value(e2m1_decode(codes[k] & 0xF), s);
    y[2 * k + 1] = scaled_value(e2m1_decode(codes[k] >> 4), s);
  }
}

// NVFP4: 16 values -> 8 code bytes + 1 E4M3 scale.
DSV41_HD void nvfp4_encode_block(const float* x, uint8_t* codes, uint8_t* scale) {
  bool finite;
  const float amax = block_amax<kNvfp4Block>(x, &finite);
  const uint8_t s = nvfp4_scale_code(amax, finite);
  *scale = s;
  DSV41_UNROLL
  for (int k = 0; k < kNvfp4Block / 2; ++k)
    codes[k] = pack_e2m1(nvfp4_encode_elem(x[2 * k], s), nvfp4_encode_elem(x[2 * k + 1], s));
}

DSV41_HD void nvfp4_decode_block(const uint8_t* codes, uint8_t scale, float* y) {
  decode_e2m1_packed<kNvfp4Block>(codes, e4m3_decode(scale), y);
}

// MXFP4: 32 values -> 16 code bytes + 1 UE8M0 scale.
DSV41_HD void mxfp4_encode_block(const float* x, uint8_t* codes, uint8_t* scale) {
  bool finite;
  const float amax = block_amax<kMxfp4Block>(x, &finite);
  const uint8_t s = mxfp4_scale_code(amax, finite);
  *scale = s;
  DSV41_UNROLL
  for (int k = 0; k < kMxfp4Block / 2; ++k)
    codes[k] = pack_e2m1(mxfp4_encode_elem(x[2 * k], s), mxfp4_encode_elem(x[2 * k + 1], s));
}

DSV41_HD void mxfp4_decode_block(const uint8_t* codes, uint8_t scale, float* y) {
  decode_e2m1_packed<kMxfp4Block>(codes, ue8m0_to_float(scale), y);
}

// FP8 SWA: 32 values -> 32 E4M3 bytes + 1 UE8M0 scale.
DSV41_HD void fp8_swa_encode_block(const float* x, uint8_t* values, uint8_t* scale) {
  bool finite;
  const float amax = block_amax<kFp8SwaBlock>(x, &finite);
  const uint8_t s = fp8_swa_scale_code(amax, finite);
  *scale = s;
  DSV41_UNROLL
  for (int i = 0; i < kFp8SwaBlock; ++i) values[i] = fp8_swa_encode_elem(x[i], s);
}

DSV41_HD void fp8_swa_decode_block(const uint8_t* values, uint8_t scale, float* y) {
  const float s = ue8m0_to_float(scale);
  DSV41_UNROLL
  for (int i = 0; i < kFp8SwaBlock; ++i) y[i] = scaled_value(e4m3_decode(values[i]), s);
}

// ---- FP8 V4 main KV ---------------------------------------------------------------------
// DeepSeek-V4's main-KV entry (FlashMLA's MODEL1_FP8Sparse, per token): an entry of
// head_dim = nope + rope float32 values (no-RoPE dims first, RoPE dims last) is stored as
// fp8_v4_entry_bytes(nope, rope) bytes, in this order:
//   [0, nope)                      E4M3 codes of the nope dims, tile t = dims [64t, 64t+64)
//   [nope, nope + 2 rope)          the rope dims as bf16, little-endian, RNE
//   [nope + 2 rope, + nope/64)     one UE8M0 scale per tile, tile order
//   then zero bytes up to a multiple of 8 (V4-Flash: 448 + 128 + 7 + 1 pad = 584).
// Scale of a tile (DeepSeek-V4 inference `act_quant(..., 64, scale_fmt="ue8m0")`):
//   s = the smallest power of two >= fl32(max(amax, floor) * fl32(1/448)); DeepSeek uses
//   floor = 1e-4 (dsv41's default, smallest scale 2^-22); floor = 0 removes the floor
//   (smallest scale 2^-127, as in FP8 SWA). For every normal amax, fl32(amax * fl32(1/448))
//   and fl32(amax / 448) have the same power-of-two ceiling (checked over all 2^23
//   significands), so the multiply only matters below 2^-126 * 448. Element: E4M3(x / s) saturated to +-448 (DeepSeek clamps to
//   +-448 then casts with RNE: the same code), computed as x * 2^-e like FP8 SWA.
// Non-finite input: a tile with NaN/Inf is poisoned like every other block (scale 0xFF,
// codes 0). A RoPE dim is its own value: +-Inf stays +-Inf and any NaN is stored as the
// canonical bf16 NaN 0x7FC0, so the bits never depend on a NaN's payload.

constexpr float kFp8V4AmaxFloor = 1e-4f;
constexpr float kE4M3MaxInv = 1.0f / 448.0f;  // fl32(1/448), as DeepSeek's kernel multiplies
constexpr uint16_t kBf16NaN = 0x7FC0;

DSV41_HD constexpr int fp8_v4_tiles(int nope) { return nope / kFp8V4Tile; }
DSV41_HD constexpr int fp8_v4_scale_offset(int nope, int rope) { return nope + 2 * rope; }
DSV41_HD constexpr int fp8_v4_entry_bytes(int nope, int rope) {
  return (fp8_v4_scale_offset(nope, rope) + fp8_v4_tiles(nope) + 7) / 8 * 8;
}

DSV41_HD uint8_t fp8_v4_scale_code(float amax, bool finite, float floor) {
  return finite ? ue8m0_ceil_pow2(fmaxf(amax, floor) * kE4M3MaxInv) : kUE8M0NaN;
}

// The element rule is FP8 SWA's (E4M3 of x times the exact reciprocal of the scale).
DSV41_HD uint8_t fp8_v4_encode_elem(float x, uint8_t scale_code) {
  return fp8_swa_encode_elem(x, scale_code);
}

DSV41_HD uint16_t fp8_v4_rope_encode(float x) {
  return (float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u ? kBf16NaN : float_to_bf16_rne(x);
}

// A stored RoPE dim (two little-endian bytes of bf16) widened to float32. The encoder only
// stores 0x7FC0 for NaN; any other NaN pattern (a foreign writer) decodes canonical too.
DSV41_HD float fp8_v4_rope_decode(const uint8_t* b) {
  return canonical_nan(bf16_to_float(static_cast<uint16_t>(b[0] | (b[1] << 8))));
}

// One tile: 64 values -> 64 E4M3 bytes + 1 UE8M0 scale.
DSV41_HD void fp8_v4_encode_tile(const float* x, float floor, uint8_t* values, uint8_t* scale) {
  bool finite;
  const float amax = block_amax<kFp8V4Tile>(x, &finite);
  const uint8_t s = fp8_v4_scale_code(amax, finite, floor);
  *scale = s;
  DSV41_UNROLL
  for (int i = 0; i < kFp8V4Tile; ++i) values[i] = fp8_v4_encode_elem(x[i], s);
}

// One entry: nope + rope values -> fp8_v4_entry_bytes(nope, rope) bytes (pad included).
DSV41_HD void fp8_v4_encode_entry(const float* x, int nope, int rope, float floor,
                                  uint8_t* out) {
  const int tiles = fp8_v4_tiles(nope), scale_off = fp8_v4_scale_offset(nope, rope);
  for (int t = 0; t < tiles; ++t)
    fp8_v4_encode_tile(x + t * kFp8V4Tile, floor, out + t * kFp8V4Tile, out + scale_off + t);
  for (int i = 0; i < rope; ++i) {
    const uint16_t h = fp8_v4_rope_encode(x[nope + i]);
    out[nope + 2 * i] = static_cast<uint8_t>(h & 0xFF);
    out[nope + 2 * i + 1] = static_cast<uint8_t>(h >> 8);
  }
  for (int b = scale_off + tiles; b < fp8_v4_entry_bytes(nope, rope); ++b) out[b] = 0;
}

// Decode: E4M3 value times the scale (exact: a 4-bit significand times a power of two,
// so a bf16 product as FlashMLA forms it has the same value), bf16 RoPE dims widened.
DSV41_HD void fp8_v4_decode_entry(const uint8_t* in, int nope, int rope, float* y) {
  const int tiles = fp8_v4_tiles(nope), scale_off = fp8_v4_scale_offset(nope, rope);
  for (int t = 0; t < tiles; ++t) {
    const float s = ue8m0_to_float(in[scale_off + t]);
    DSV41_UNROLL
    for (int i = 0; i < kFp8V4Tile; ++i)
      y[t * kFp8V4Tile + i] = scaled_value(e4m3_decode(in[t * kFp8V4Tile + i]), s);
  }
  for (int i = 0; i < rope; ++i) y[nope + i] = fp8_v4_rope_decode(in + nope + 2 * i);
}

}  // namespace fmt
}  // namespace dsv41
