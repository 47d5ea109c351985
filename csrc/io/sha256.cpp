// SHA-256: the compression function twice (x86 SHA extensions, portable C++) behind one
// padding routine (include/dsv41/sha256.h).
#include "dsv41/sha256.h"

#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DSV41_SHA_X86 1
#endif

namespace dsv41 {
namespace {

alignas(16) constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

constexpr uint32_t kInit[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

inline uint32_t rotr(uint32_t x, int r) { return (x >> r) | (x << (32 - r)); }

inline uint32_t load_be32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

void compress_portable(uint32_t st[8], const uint8_t* p, size_t blocks) {
  for (; blocks--; p += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) w[i] = load_be32(p + 4 * i);
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    st[0] += a, st[1] += b, st[2] += c, st[3] += d, st[4] += e, st[5] += f, st[6] += g, st[7] += h;
  }
}

#ifdef DSV41_SHA_X86
// The SHA-NI rounds keep the state as (ABEF, CDGH) and take 4 message words per step; the
// schedule extends the message 4 words at a time (sha256msg1/msg2).
__attribute__((target("sha,sse4.1"))) void compress_ni(uint32_t st[8], const uint8_t* p, size_t blocks) {
  const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(st)), 0xB1);  // CDAB
  __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(st + 4)), 0x1B);  // EFGH
  __m128i s0 = _mm_alignr_epi8(tmp, s1, 8);       // ABEF
  s1 = _mm_blend_epi16(s1, tmp, 0xF0);            // CDGH
  for (; blocks--; p += 64) {
    const __m128i abef = s0, cdgh = s1;
    __m128i m[4];
    for (int g = 0; g < 16; ++g) {
      __m128i& w = m[g & 3];
      if (g < 4) {
        w = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * g)), bswap);
      } else {  // w (= words g-4) becomes words g: msg1(g-4, g-3) + words g-1 shifted in, then msg2
        const __m128i prev = m[(g - 1) & 3], prev2 = m[(g - 2) & 3];
        w = _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32(w, m[(g - 3) & 3]),
                                               _mm_alignr_epi8(prev, prev2, 4)), prev);
      }
      __m128i k = _mm_add_epi32(w, _mm_load_si128(reinterpret_cast<const __m128i*>(kRound + 4 * g)));
      s1 = _mm_sha256rnds2_epu32(s1, s0, k);
      s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(k, 0x0E));
    }
    s0 = _mm_add_epi32(s0, abef);
    s1 = _mm_add_epi32(s1, cdgh);
  }
  tmp = _mm_shuffle_epi32(s0, 0x1B);              // FEBA
  s1 = _mm_shuffle_epi32(s1, 0xB1);               // DCHG
  _mm_storeu_si128(reinterpret_cast<__m128i*>(st), _mm_blend_epi16(tmp, s1, 0xF0));       // DCBA
  _mm_storeu_si128(reinterpret_cast<__m128i*>(st + 4), _mm_alignr_epi8(s1, tmp, 8));      // HGFE
}
#endif

using Compress = void (*)(uint32_t*, const uint8_t*, size_t);

void digest(Compress compress, const void* data, size_t n, uint8_t out[32]) {
  uint32_t st[8];
  std::memcpy(st, kInit, sizeof(st));
  const uint8_t* p = static_cast<const uint8_t*>(data);
  const size_t full = n / 64;
  compress(st, p, full);
  // The tail, 0x80, zeros, and the message length in bits (big-endian): one or two blocks.
  uint8_t last[128] = {};
  const size_t rest = n - 64 * full;
  std::memcpy(last, p + 64 * full, rest);
  last[rest] = 0x80;
  const size_t tail_blocks = rest + 9 <= 64 ? 1 : 2;
  const uint64_t bits = uint64_t(n) * 8;
  for (int i = 0; i < 8; ++i) last[64 * tail_blocks - 1 - i] = uint8_t(bits >> (8 * i));
  compress(st, last, tail_blocks);
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = uint8_t(st[i] >> 24);
    out[4 * i + 1] = uint8_t(st[i] >> 16);
    out[4 * i + 2] = uint8_t(st[i] >> 8);
    out[4 * i + 3] = uint8_t(st[i]);
  }
}

}  // namespace

bool sha256_hw_available() {
#ifdef DSV41_SHA_X86
  static const bool ok = __builtin_cpu_supports("sha") && __builtin_cpu_supports("sse4.1");
  return ok;
#else
  return false;
#endif
}

void sha256(const void* data, size_t n, uint8_t out[32]) {
#ifdef DSV41_SHA_X86
  if (sha256_hw_available()) return digest(compress_ni, data, n, out);
#endif
  digest(compress_portable, data, n, out);
}

void sha256_portable(const void* data, size_t n, uint8_t out[32]) { digest(compress_portable, data, n, out); }

}  // namespace dsv41
