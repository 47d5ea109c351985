// Host CRC-32C: slice-by-8 tables (portable), the SSE4.2 crc32 instruction, and carry-less
// multiply folding with AVX-512 VPCLMULQDQ (x86-64, picked at run time), all giving the
// standard conditioned CRC of include/dsv41/crc32c.h.
#include "dsv41/crc32c.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <nmmintrin.h>
#define DSV41_CRC_X86 1
#endif

namespace dsv41 {
namespace {

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t b = 0; b < 256; ++b) t[0][b] = crc::table_entry(b);
    for (uint32_t b = 0; b < 256; ++b)
      for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFFu];
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

uint64_t load_le64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

// How a CRC pass treats its bytes: only reads them, also copies them to dst, or copies them
// with non-temporal stores (for bytes bound for a device, which the CPU will not read
// again: no read-for-ownership of dst's lines and no eviction of the cache's other data).
enum CopyMode { kNoCopy, kCopy, kStream };

#ifdef DSV41_CRC_X86
template <int kMode>
__attribute__((target("sse4.2"))) uint32_t crc_sse42(uint32_t crc, uint8_t* dst, const uint8_t* p, size_t n) {
  uint64_t c = ~crc;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    if (kMode) *dst++ = *p;
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  // Three independent streams hide the instruction's 3-cycle latency; their CRCs are then
  // merged with the shift operator for one stream length.
  constexpr size_t kStream = 4096;
  if (n >= 3 * kStream) {
    static const uint32_t op = crc::x8nmodp(kStream);
    while (n >= 3 * kStream) {
      uint64_t c0 = c, c1 = 0xFFFFFFFFu, c2 = 0xFFFFFFFFu;
      const uint8_t* p1 = p + kStream;
      const uint8_t* p2 = p + 2 * kStream;
      for (size_t i = 0; i < kStream; i += 8) {
        const uint64_t v0 = load_le64(p + i), v1 = load_le64(p1 + i), v2 = load_le64(p2 + i);
        c0 = _mm_crc32_u64(c0, v0);
        c1 = _mm_crc32_u64(c1, v1);
        c2 = _mm_crc32_u64(c2, v2);
        if (kMode) {   // x86 is little-endian: the loaded words are the bytes as they were
          std::memcpy(dst + i, &v0, 8);
          std::memcpy(dst + kStream + i, &v1, 8);
          std::memcpy(dst + 2 * kStream + i, &v2, 8);
        }
      }
      // c0..c2 are raw registers; conditioned CRCs are their complements.
      uint32_t r = crc::combine_with_op(~static_cast<uint32_t>(c0), ~static_cast<uint32_t>(c1), op);
      r = crc::combine_with_op(r, ~static_cast<uint32_t>(c2), op);
      c = ~r;
      p += 3 * kStream;
      if (kMode) dst += 3 * kStream;
      n -= 3 * kStream;
    }
  }
  while (n >= 8) {
    const uint64_t v = load_le64(p);
    c = _mm_crc32_u64(c, v);
    if (kMode) {
      std::memcpy(dst, &v, 8);
      dst += 8;
    }
    p += 8;
    n -= 8;
  }
  while (n--) {
    if (kMode) *dst++ = *p;
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  }
  return ~static_cast<uint32_t>(c);
}

// Folding (the construction of Intel's "Fast CRC Computation for Generic Polynomials Using
// PCLMULQDQ", for the reflected Castagnoli polynomial). A 128-bit lane X = [lo, hi] of the
// message moved D bits further on keeps the CRC when replaced by clmul(lo, k_lo) ^
// clmul(hi, k_hi), with k_lo = reflect32(x^(D+31) mod P) and k_hi = reflect32(x^(D-33) mod P);
// the CRC of the one lane left at the end is then the crc32 instruction's over its 16 bytes.
// The constants below were computed that way for D = 2048 (sixteen lanes of accumulators),
// 512 (four lanes) and 128 (lane to lane); the tests check every length and alignment
// against slice-by-8. Why: the crc32 instruction peaks at ~10 GB/s on one core, and every
// record read and written is checksummed, so the CRC was a third of a verified read's CPU
// time; folding runs at several times that.
//
// Two widths, the same schedule: AVX-512 (four 512-bit accumulators) and AVX2 (eight
// 256-bit ones, for CPUs with VPCLMULQDQ but not AVX-512: AMD Zen 3, Intel client cores).
// Each step folds 256 bytes; the accumulators are then folded into four lanes (D = 512).
struct FoldK {
  uint64_t lo, hi;
};
constexpr FoldK kFold2048{0xdcb17aa4, 0xb9e02b86};
constexpr FoldK kFold512{0x740eef02, 0x9e4addf8};
constexpr FoldK kFold128{0xf20c0dfe, 0x493c7d27};
constexpr size_t kFoldMin = 256;  // shorter inputs take the crc32 instruction

#define DSV41_FOLD_COMMON "vpclmulqdq,pclmul,sse4.2"
#define DSV41_FOLD512 __attribute__((target("avx512f," DSV41_FOLD_COMMON)))
#define DSV41_FOLD256 __attribute__((target("avx2," DSV41_FOLD_COMMON)))

__attribute__((target("pclmul,sse4.2"))) inline __m128i fold128(__m128i x, __m128i k, __m128i data) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), data);
}

// The end of both widths: four lanes (64 bytes folded so far) and the bytes after `off`.
template <int kMode>
__attribute__((target("pclmul,sse4.2"))) uint32_t fold_finish(const __m128i lane[4], uint8_t* dst, const uint8_t* p,
                                                              size_t off, size_t n) {
  const __m128i k128 = _mm_set_epi64x(kFold128.hi, kFold128.lo);
  __m128i a = fold128(fold128(fold128(lane[0], k128, lane[1]), k128, lane[2]), k128, lane[3]);
  for (; off + 16 <= n; off += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + off));
    if (kMode) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + off), v);
    a = fold128(a, k128, v);
  }
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(a)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(a, 1)));
  for (; off < n; ++off) {
    if (kMode) dst[off] = p[off];
    c = _mm_crc32_u8(static_cast<uint32_t>(c), p[off]);
  }
  if (kMode == kStream) _mm_sfence();  // the streamed stores are visible before dst is handed on
  return ~static_cast<uint32_t>(c);
}

// k in every 128-bit lane of a 512-bit register (one constant for four lanes).
DSV41_FOLD512 inline __m512i lanes4(FoldK k) {
  return _mm512_set_epi64(k.hi, k.lo, k.hi, k.lo, k.hi, k.lo, k.hi, k.lo);
}

DSV41_FOLD512 inline __m512i fold512(__m512i x, __m512i k, __m512i data) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11),
                                   data, 0x96);  // a ^ b ^ c
}

// kStream needs dst 64-byte aligned (the caller checks).
template <int kMode>
DSV41_FOLD512 inline __m512i load64(const uint8_t* p, uint8_t* dst, size_t off) {
  const __m512i v = _mm512_loadu_si512(p + off);
  if (kMode == kCopy) _mm512_storeu_si512(dst + off, v);
  if (kMode == kStream) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + off), v);
  return v;
}

// n >= kFoldMin.
template <int kMode>
DSV41_FOLD512 uint32_t crc_fold512(uint32_t crc, uint8_t* dst, const uint8_t* p, size_t n) {
  const __m512i k2048 = lanes4(kFold2048), k512 = lanes4(kFold512);
  // The register state enters as the first 32 bits of the message (the CRC is linear).
  __m512i x0 = _mm512_xor_si512(load64<kMode>(p, dst, 0), _mm512_maskz_set1_epi32(1, static_cast<int>(~crc)));
  __m512i x1 = load64<kMode>(p, dst, 64), x2 = load64<kMode>(p, dst, 128), x3 = load64<kMode>(p, dst, 192);
  size_t off = 256;
  for (; off + 256 <= n; off += 256) {
    x0 = fold512(x0, k2048, load64<kMode>(p, dst, off));
    x1 = fold512(x1, k2048, load64<kMode>(p, dst, off + 64));
    x2 = fold512(x2, k2048, load64<kMode>(p, dst, off + 128));
    x3 = fold512(x3, k2048, load64<kMode>(p, dst, off + 192));
  }
  __m512i x = fold512(fold512(fold512(x0, k512, x1), k512, x2), k512, x3);
  for (; off + 64 <= n; off += 64) x = fold512(x, k512, load64<kMode>(p, dst, off));
  alignas(64) __m128i lane[4];
  _mm512_store_si512(lane, x);
  return fold_finish<kMode>(lane, dst, p, off, n);
}

DSV41_FOLD256 inline __m256i lanes2(FoldK k) { return _mm256_set_epi64x(k.hi, k.lo, k.hi, k.lo); }

DSV41_FOLD256 inline __m256i fold256(__m256i x, __m256i k, __m256i data) {
  return _mm256_xor_si256(
      _mm256_xor_si256(_mm256_clmulepi64_epi128(x, k, 0x00), _mm256_clmulepi64_epi128(x, k, 0x11)), data);
}

// kStream needs dst 32-byte aligned (the caller checks).
template <int kMode>
DSV41_FOLD256 inline __m256i load32(const uint8_t* p, uint8_t* dst, size_t off) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + off));
  if (kMode == kCopy) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + off), v);
  if (kMode == kStream) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + off), v);
  return v;
}

// n >= kFoldMin. Accumulator y[i] holds lanes 2i and 2i + 1 of each 256-byte step, as x[i/2]
// of crc_fold512 holds them; y[0..1] then end as that function's four lanes.
template <int kMode>
DSV41_FOLD256 uint32_t crc_fold256(uint32_t crc, uint8_t* dst, const uint8_t* p, size_t n) {
  const __m256i k2048 = lanes2(kFold2048), k512 = lanes2(kFold512);
  __m256i y[8];
  y[0] = _mm256_xor_si256(load32<kMode>(p, dst, 0), _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, static_cast<int>(~crc)));
  for (int i = 1; i < 8; ++i) y[i] = load32<kMode>(p, dst, 32 * i);
  size_t off = 256;
  for (; off + 256 <= n; off += 256)
    for (int i = 0; i < 8; ++i) y[i] = fold256(y[i], k2048, load32<kMode>(p, dst, off + 32 * i));
  __m256i a = y[0], b = y[1];  // lanes 0-1 and 2-3 of a 64-byte group
  for (int i = 2; i < 8; i += 2) {
    a = fold256(a, k512, y[i]);
    b = fold256(b, k512, y[i + 1]);
  }
  for (; off + 64 <= n; off += 64) {
    a = fold256(a, k512, load32<kMode>(p, dst, off));
    b = fold256(b, k512, load32<kMode>(p, dst, off + 32));
  }
  alignas(32) __m128i lane[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane), a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane + 2), b);
  return fold_finish<kMode>(lane, dst, p, off, n);
}
#endif

bool cpu_has(CrcPath path) {
#ifdef DSV41_CRC_X86
  static const bool sse42 = __builtin_cpu_supports("sse4.2");
  static const bool clmul = sse42 && __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("vpclmulqdq");
  static const bool avx2 = clmul && __builtin_cpu_supports("avx2");
  static const bool avx512 = clmul && __builtin_cpu_supports("avx512f");
  switch (path) {
    case CrcPath::kSw: return true;
    case CrcPath::kHw: return sse42;
    case CrcPath::kFold256: return avx2;
    case CrcPath::kFold512: return avx512;
  }
  return false;
#else
  return path == CrcPath::kSw;
#endif
}

CrcPath best() {
  static const CrcPath b = cpu_has(CrcPath::kFold512)   ? CrcPath::kFold512
                           : cpu_has(CrcPath::kFold256) ? CrcPath::kFold256
                           : cpu_has(CrcPath::kHw)      ? CrcPath::kHw
                                                        : CrcPath::kSw;
  return b;
}

template <int kMode>
uint32_t run_path(CrcPath path, uint32_t crc, uint8_t* dst, const uint8_t* src, size_t n) {
#ifdef DSV41_CRC_X86
  if (path == CrcPath::kFold512 && n >= kFoldMin) return crc_fold512<kMode>(crc, dst, src, n);
  if (path == CrcPath::kFold256 && n >= kFoldMin) return crc_fold256<kMode>(crc, dst, src, n);
  if (path != CrcPath::kSw) return crc_sse42<kMode == kNoCopy ? kNoCopy : kCopy>(crc, dst, src, n);
#endif
  if (kMode != kNoCopy) std::memcpy(dst, src, n);
  return crc32c_sw(crc, kMode != kNoCopy ? dst : src, n);
}

}  // namespace

uint32_t crc32c_sw(uint32_t crc, const void* data, size_t n) {
  const Tables& T = tables();
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = T.t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    --n;
  }
  while (n >= 8) {
    uint64_t v = load_le64(p) ^ c;
    c = T.t[7][v & 0xFF] ^ T.t[6][(v >> 8) & 0xFF] ^ T.t[5][(v >> 16) & 0xFF] ^
        T.t[4][(v >> 24) & 0xFF] ^ T.t[3][(v >> 32) & 0xFF] ^ T.t[2][(v >> 40) & 0xFF] ^
        T.t[1][(v >> 48) & 0xFF] ^ T.t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = T.t[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
  return ~c;
}

bool crc32c_path_available(CrcPath path) { return cpu_has(path); }

uint32_t crc32c_path(CrcPath path, uint32_t crc, void* dst, const void* src, size_t n, bool stream) {
  if (!cpu_has(path)) path = CrcPath::kSw;
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  if (d == nullptr) return run_path<kNoCopy>(path, crc, d, s, n);
  if (!stream || (path != CrcPath::kFold512 && path != CrcPath::kFold256))
    return run_path<kCopy>(path, crc, d, s, n);
  // Streamed stores need dst aligned to the register width: the bytes before the first
  // aligned address (a numpy array's rows are often only 16-byte aligned) take plain ones.
  const uintptr_t width = path == CrcPath::kFold512 ? 64 : 32;
  const size_t head = std::min<size_t>(n, (width - (reinterpret_cast<uintptr_t>(d) & (width - 1))) & (width - 1));
  if (head) crc = run_path<kCopy>(path, crc, d, s, head);
  return run_path<kStream>(path, crc, d + head, s + head, n - head);
}

uint32_t crc32c(uint32_t crc, const void* data, size_t n) { return crc32c_path(best(), crc, nullptr, data, n, false); }

uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t n) {
  return crc32c_path(best(), crc, dst, src, n, false);
}

uint32_t crc32c_copy_stream(uint32_t crc, void* dst, const void* src, size_t n) {
  return crc32c_path(best(), crc, dst, src, n, true);
}

const char* crc32c_path_name(CrcPath path) {
  switch (path) {
    case CrcPath::kSw: return "slice-by-8";
    case CrcPath::kHw: return "sse4.2";
    case CrcPath::kFold256: return "avx2-vpclmulqdq";
    case CrcPath::kFold512: return "avx512-vpclmulqdq";
  }
  return "?";
}

const char* crc32c_backend() { return crc32c_path_name(best()); }

const uint32_t* crc32c_byte_table() { return tables().t[0]; }

uint32_t crc32c_chunked(const void* data, size_t n, int chunks) {
  if (chunks < 1) chunks = 1;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  const uint32_t* table = crc32c_byte_table();
  const size_t per = (n + chunks - 1) / chunks;
  const uint32_t op = crc::x8nmodp(per);
  uint32_t acc = 0;
  bool first = true;
  for (int i = 0; i < chunks; ++i) {
    const size_t start = per * i;
    if (start >= n) break;
    const size_t len = n - start < per ? n - start : per;
    const uint32_t c = crc::update_bytes(0, p + start, len, table);
    if (first) {
      acc = c;
      first = false;
    } else {
      acc = len == per ? crc::combine_with_op(acc, c, op) : crc::combine(acc, c, len);
    }
  }
  return first ? 0u : acc;
}

}  // namespace dsv41
