// CRC-32C (Castagnoli), the checksum of every persistent-cache record.
//
// Standard parameters (iSCSI, ext4, RocksDB): reflected polynomial 0x82F63B78, initial value
// 0xFFFFFFFF, final xor 0xFFFFFFFF; crc32c("123456789") == 0xE3069283.
//
// What lives here is __host__ __device__ and framework-free: the byte-table update, and the
// GF(2) arithmetic that combines the CRCs of two adjacent pieces (the zlib crc32_combine
// construction). The GPU computes a record's CRC as many chunk CRCs plus one combine pass;
// the CPU tests run the same chunk-and-combine code against the plain CRC, so the device
// path is checked by the host build. The fast host entry points (slice-by-8, the SSE4.2
// instruction, and VPCLMULQDQ folding on AVX2 or AVX-512 registers, chosen at run time)
// are declared at the end and live in csrc/io/crc32c.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define DSV41_CRC_HD __host__ __device__ __forceinline__
#else
#define DSV41_CRC_HD inline
#endif

namespace dsv41 {
namespace crc {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// One table entry: the CRC of the single byte `b` with a zero register.
DSV41_CRC_HD uint32_t table_entry(uint32_t b) {
  uint32_t c = b;
  for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
  return c;
}

// Conditioned CRC of `n` bytes continuing from the conditioned CRC `crc` (0 to start),
// one table lookup per byte. `table` holds table_entry(0..255).
DSV41_CRC_HD uint32_t update_bytes(uint32_t crc, const uint8_t* p, size_t n,
                                   const uint32_t* table) {
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
  return ~c;
}

// a(x) * b(x) mod P(x), both in the reflected bit order (bit 31 is x^0).
DSV41_CRC_HD uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1u) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(8 n) mod P: the operator that moves a CRC register past n zero bytes.
DSV41_CRC_HD uint32_t x8nmodp(uint64_t n) {
  uint32_t result = 1u << 31;   // x^0
  uint32_t square = 1u << 23;   // x^8 (one byte)
  while (n) {
    if (n & 1u) result = multmodp(square, result);
    square = multmodp(square, square);
    n >>= 1;
  }
  return result;
}

// CRC of A||B from crc(A), crc(B) and len(B), for conditioned CRCs. `op` must be
// x8nmodp(len(B)); pieces of equal length share one op.
DSV41_CRC_HD uint32_t combine_with_op(uint32_t crc_a, uint32_t crc_b, uint32_t op) {
  return multmodp(op, crc_a) ^ crc_b;
}

DSV41_CRC_HD uint32_t combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return combine_with_op(crc_a, crc_b, x8nmodp(len_b));
}

}  // namespace crc

// Host entry points (csrc/io/crc32c.cpp). `crc` is the conditioned CRC of the bytes before
// (0 to start), so crc32c(crc32c(0, a, n), b, m) is the CRC of a||b.
uint32_t crc32c(uint32_t crc, const void* data, size_t n);     // fastest available
uint32_t crc32c_sw(uint32_t crc, const void* data, size_t n);  // slice-by-8, portable
// crc32c of src, copying its n bytes to dst in the same pass (dst must not overlap src).
uint32_t crc32c_copy(uint32_t crc, void* dst, const void* src, size_t n);
// The same with non-temporal stores where the path and dst's alignment allow them: for
// bytes bound for a device (a write's staging buffer), which the CPU does not read again.
uint32_t crc32c_copy_stream(uint32_t crc, void* dst, const void* src, size_t n);

// Each host path by name (the tests compare them with slice-by-8). Folding paths take
// inputs of 256 bytes and more; shorter ones go through the crc32 instruction.
enum class CrcPath {
  kSw,       // slice-by-8 tables, any CPU
  kHw,       // SSE4.2 crc32 instruction, three interleaved streams
  kFold256,  // VPCLMULQDQ folding on AVX2 registers (e.g. AMD Zen 3, Intel client cores)
  kFold512,  // VPCLMULQDQ folding on AVX-512 registers
};
bool crc32c_path_available(CrcPath path);
// crc of src by `path` (a path the CPU lacks falls back to kSw); dst != nullptr: also
// copies src to dst, with non-temporal stores when `stream` (as crc32c_copy_stream).
uint32_t crc32c_path(CrcPath path, uint32_t crc, void* dst, const void* src, size_t n, bool stream);
const char* crc32c_path_name(CrcPath path);  // "slice-by-8", "sse4.2", "avx2-vpclmulqdq", "avx512-vpclmulqdq"
const char* crc32c_backend();  // the name of the path crc32c() takes on this CPU
const uint32_t* crc32c_byte_table();  // table_entry(0..255), for the chunked device code

// The chunk-and-combine schedule the CUDA kernel uses, run on the host with the byte table:
// crc of [data, data + n) as `chunks` equal pieces (the last one shorter) combined in order.
uint32_t crc32c_chunked(const void* data, size_t n, int chunks);

}  // namespace dsv41
