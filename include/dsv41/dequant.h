// Fast decoders of the stored KV formats into bf16 pairs, for the kernels' hot loops.
//
// Hopper has no E2M1 convert instruction, so E2M1 and E4M3 codes are moved into bf16 bit
// patterns with shifts and masks: a code's exponent and mantissa bits land in the low
// exponent bits and the top mantissa bits of a bf16, which makes the pattern the code's
// value times a constant power of two (2^-126 for E2M1, 2^-120 for E4M3; subnormal codes
// land on bf16 subnormals with the same factor). That constant is folded into the block
// scale, so one bf16x2 multiply per pair both removes the exponent-bias offset and applies
// the scale. Every product here is exactly representable in bf16 (an E2M1 value has 2
// significant bits, an E4M3 value 4, a scale at most 4), so the decoded values are the
// codecs' values of formats.h, bit for bit, up to the documented constant factor:
//
//   NVFP4 (E2M1 x E4M3 scale):   decoded = value * 2^-kNvfp4Shift  (kNvfp4Shift = 8; the
//        E4M3 scale times 2^126 does not fit a bf16, times 2^118 does; the kernels fold
//        the remaining 2^8 into the softmax scale and the probabilities)
//   MXFP4 (E2M1 x UE8M0):        decoded = value
//   FP8 SWA (E4M3 x UE8M0):      decoded = value
//
// Element order. The pairs are not the natural neighbours: for 8 consecutive elements
// e0..e7 (one 32-bit word of E2M1 codes, or two words of E4M3 codes) the four bf16x2 words
// hold (e0,e4), (e1,e5), (e2,e6), (e3,e7), i.e. within every group of 8 dims the stored
// position 2i+j holds element i+4j. A dot product does not care about the order as long as
// both operands use it (the kernels store q the same way), and outputs are un-permuted on
// write (see perm8_dim). The order is what makes E2M1 cheap: nibbles i and i+4 sit 16 bits
// apart, so one shift serves both halves of a pair.
//
// Limits (documented, tested): E4M3 codes 0x7F/0xFF (NaN) are not decoded as NaN by the
// fast path; the dsv41 codecs never store them (a non-finite block is poisoned through its
// scale, which the fast path does propagate). A UE8M0 scale above 2^7 (FP8) or 2^1
// (MXFP4) takes a two-multiply path, still exact.
//
// Everything is __host__ __device__: tests/ops/test_dequant_tricks.py runs these very
// functions on the CPU (through a test op) against formats.h for every code and scale.
#pragma once

#include <cstdint>

#include "dsv41/formats.h"

namespace dsv41 {
namespace dq {

constexpr int kNvfp4Shift = 8;  // NVFP4 values decode as value * 2^-8

// Stored position p (0..7) within a group of 8 dims holds dim perm8_dim(p).
DSV41_HD constexpr int perm8_dim(int p) { return (p >> 1) + 4 * (p & 1); }
// And dim d (0..7) is stored at position perm8_pos(d).
DSV41_HD constexpr int perm8_pos(int d) { return 2 * (d & 3) + (d >> 2); }

// ---- bf16 helpers ----------------------------------------------------------------------

// The scalar conversions are the formats' own (formats.h), so one RNE rule exists.
using fmt::bf16_to_float;
using fmt::float_to_bf16_rne;

DSV41_HD uint32_t pack_bf16x2(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// Two floats -> bf16x2 (lo in the low half), RNE.
DSV41_HD uint32_t floats_to_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return pack_bf16x2(float_to_bf16_rne(lo), float_to_bf16_rne(hi));
#endif
}

// a * b per bf16 half, RNE. On the device one fma.rn.bf16x2 with a -0 addend (which
// leaves every product, signed zeros included, unchanged); on the host an emulation that
// is exact whenever the product is representable in bf16, which is every use here.
DSV41_HD uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  return r;
#else
  const float lo = bf16_to_float(static_cast<uint16_t>(a)) * bf16_to_float(static_cast<uint16_t>(b));
  const float hi = bf16_to_float(static_cast<uint16_t>(a >> 16)) *
                   bf16_to_float(static_cast<uint16_t>(b >> 16));
  return pack_bf16x2(float_to_bf16_rne(lo), float_to_bf16_rne(hi));
#endif
}

// Byte permute: result byte n = byte sel[n] (0..7) of {b:a} (a = bytes 0..3). Selectors
// here never set the sign-replicate bit.
DSV41_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t v = static_cast<uint64_t>(a) | (static_cast<uint64_t>(b) << 32);
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t s = (sel >> (4 * n)) & 7u;
    r |= static_cast<uint32_t>((v >> (8 * s)) & 0xFFu) << (8 * n);
  }
  return r;
#endif
}

// ---- E2M1 ------------------------------------------------------------------------------

// Pair i (0..3) of 8 E2M1 codes (element i in nibble i of w): elements (i, i+4) as a
// bf16x2 pattern, each half e2m1(code) * 2^-126 (sign bit 3 -> 15, magnitude bits 0..2 ->
// 6..8). Nibbles i and i+4 are 16 bits apart, so one shift serves both halves.
DSV41_HD uint32_t e2m1_pair_pattern(uint32_t w, int i) {
  const uint32_t x = w >> (4 * i);
  return ((x << 6) & 0x01C001C0u) | ((x << 12) & 0x80008000u);
}

// All four pairs (with a constant i the shifts fold into two per pair).
DSV41_HD void e2m1x8_patterns(uint32_t w, uint32_t out[4]) {
  DSV41_UNROLL
  for (int i = 0; i < 4; ++i) out[i] = e2m1_pair_pattern(w, i);
}

// bf16x2 factor of an NVFP4 block: e4m3(scale) * 2^118, so pattern * factor =
// value * 2^-kNvfp4Shift. 448 * 2^118 < 2^127 fits; the product has at most 5
// significant bits and lies in [2^-18, 2688 * 2^-8], normal in bf16. A NaN scale (0x7F,
// 0xFF) gives NaN, a zero scale zeros.
DSV41_HD uint32_t nvfp4_factor(uint8_t scale_code) {
  const float f = fmt::e4m3_decode(scale_code) * 0x1p118f;  // exact: 4 significant bits
  const uint16_t h = static_cast<uint16_t>(fmt::float_bits(f) >> 16);
  return pack_bf16x2(h, h);
}

// bf16x2 factors for a power-of-two UE8M0 scale 2^(e-127) applied to a pattern that is
// value * 2^-bias. One step (f1 = 2^(e-127+bias)) when that is a normal bf16, i.e.
// e + bias <= 254; otherwise two: f1 = 2^bias (exact: brings the pattern to the value),
// then f2 = the scale (exact unless the result is below 2^-126, where bf16 keeps fewer
// subnormal bits than float32). e == 255 is the NaN scale and always takes two steps.
struct Pow2Factor {
  uint32_t f1;
  uint32_t f2;
  bool two_steps;
};

DSV41_HD Pow2Factor ue8m0_factor(uint8_t e, int bias) {
  Pow2Factor r;
  const int combined = static_cast<int>(e) + bias;  // biased bf16 exponent of 2^(e-127+bias)
  if (e != fmt::kUE8M0NaN && combined <= 254) {
    const uint16_t h = static_cast<uint16_t>(combined << 7);  // combined >= bias >= 1: normal
    r.f1 = pack_bf16x2(h, h);
    r.f2 = 0x3F803F80u;  // 1.0
    r.two_steps = false;
  } else {
    const uint16_t b = static_cast<uint16_t>((127 + bias) << 7);
    const uint16_t s = e == fmt::kUE8M0NaN ? static_cast<uint16_t>(0x7FC0u)
                                           : static_cast<uint16_t>(static_cast<uint32_t>(e) << 7);
    r.f1 = pack_bf16x2(b, b);
    r.f2 = pack_bf16x2(s, s);
    r.two_steps = true;
  }
  return r;
}

DSV41_HD uint32_t apply_factor(uint32_t pattern, const Pow2Factor& f) {
  uint32_t v = bf16x2_mul(pattern, f.f1);
  if (f.two_steps) v = bf16x2_mul(v, f.f2);
  return v;
}

constexpr int kE2M1PatternBias = 126;
constexpr int kE4M3PatternBias = 120;

// ---- E4M3 ------------------------------------------------------------------------------

// Pair i (0..3) of two words of E4M3 codes (w0 = elements 0..3, w1 = 4..7): elements
// (i, i+4) as bf16x2 patterns equal to e4m3(code) * 2^-120 (sign bit 7 -> 15, bits 0..6
// -> 4..10). byte_perm duplicates each source byte so that a single right shift by 4
// places both halves, and the sign sits at bits 15 and 31 already.
DSV41_HD uint32_t e4m3_pair_pattern(uint32_t w0, uint32_t w1, int i) {
  const uint32_t sel = static_cast<uint32_t>(i) * 0x0011u + static_cast<uint32_t>(4 + i) * 0x1100u;
  const uint32_t x = byte_perm(w0, w1, sel);  // [b_i, b_i, b_{4+i}, b_{4+i}]
  return ((x >> 4) & 0x07F007F0u) | (x & 0x80008000u);
}

// ---- Whole groups of 8 (what the kernels call) -------------------------------------------

// NVFP4: one word of codes (8 elements) and the block's factor -> 4 bf16x2 words.
DSV41_HD void nvfp4_group8(uint32_t w, uint32_t factor, uint32_t out[4]) {
  e2m1x8_patterns(w, out);
  DSV41_UNROLL
  for (int i = 0; i < 4; ++i) out[i] = bf16x2_mul(out[i], factor);
}

// MXFP4: one word of codes (8 elements) and the block's factor -> 4 bf16x2 words.
DSV41_HD void mxfp4_group8(uint32_t w, const Pow2Factor& f, uint32_t out[4]) {
  e2m1x8_patterns(w, out);
  DSV41_UNROLL
  for (int i = 0; i < 4; ++i) out[i] = apply_factor(out[i], f);
}

// FP8 SWA: two words of E4M3 codes (8 elements) and the block's factor -> 4 bf16x2 words.
DSV41_HD void fp8_group8(uint32_t w0, uint32_t w1, const Pow2Factor& f, uint32_t out[4]) {
  DSV41_UNROLL
  for (int i = 0; i < 4; ++i) out[i] = apply_factor(e4m3_pair_pattern(w0, w1, i), f);
}

}  // namespace dq
}  // namespace dsv41

namespace dsv41 {
namespace dq {

// The decoder self-check's unit (CPU and GPU run this same function): group g (8 dims) of
// one stored row through the fast decoders, back to float32 in natural order, with the
// folded constant removed. A NaN comes out as the formats' canonical 0x7FC00000; the bf16
// NaN inside the fast path is whatever the bf16x2 multiply writes (hardware-defined). fmt: 0 NVFP4, 1 MXFP4, 2 FP8 SWA (dsv41::KvFormat values).
DSV41_HD void decode_group_natural(int fmt, const uint8_t* codes_row, const uint8_t* scales_row,
                                   int g, float y[8]) {
  uint32_t o[4];
  float mult = 1.0f;
  auto word = [](const uint8_t* b) {
    return static_cast<uint32_t>(b[0]) | (static_cast<uint32_t>(b[1]) << 8) |
           (static_cast<uint32_t>(b[2]) << 16) | (static_cast<uint32_t>(b[3]) << 24);
  };
  if (fmt == 0) {
    nvfp4_group8(word(codes_row + 4 * g), nvfp4_factor(scales_row[g / 2]), o);
    mult = static_cast<float>(1 << kNvfp4Shift);
  } else if (fmt == 1) {
    mxfp4_group8(word(codes_row + 4 * g), ue8m0_factor(scales_row[g / 4], kE2M1PatternBias), o);
  } else {
    fp8_group8(word(codes_row + 8 * g), word(codes_row + 8 * g + 4),
               ue8m0_factor(scales_row[g / 4], kE4M3PatternBias), o);
  }
  for (int p = 0; p < 8; ++p) {
    const uint16_t h = static_cast<uint16_t>(o[p >> 1] >> (16 * (p & 1)));
    y[perm8_dim(p)] = fmt::scaled_value(bf16_to_float(h), mult);
  }
}

}  // namespace dq
}  // namespace dsv41
