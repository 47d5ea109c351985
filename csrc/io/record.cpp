// The per-record check of a verified read (include/dsv41/record.h), run by the I/O worker
// that read the record, right after the read.
#include "dsv41/record.h"

#include <cstring>

#include "dsv41/crc32c.h"

namespace dsv41 {
namespace record {

int check(const uint8_t* rec, uint64_t avail, const Expect& e) {
  if (avail < e.padded || avail < kHeaderBytes) return kTruncated;
  HeaderV1 h;
  std::memcpy(&h, rec, sizeof(h));
  if (std::memcmp(h.magic, kMagic, 8) != 0 || h.version != kFormatVersion ||
      h.header_bytes != kHeaderBytes || crc32c(0, rec, 252) != h.header_crc)
    return kHeader;
  const uint64_t rb = h.record_bytes;
  const uint64_t min_payload_offset = kHeaderBytes + 4ull * h.token_count + h.key_bytes;
  if (h.record_id != e.record_id || h.parent_id != e.parent_id || h.block_index != e.block_index ||
      h.payload_bytes != e.payload_bytes || rb != uint64_t(h.payload_offset) + h.payload_bytes ||
      (rb + 4095) / 4096 * 4096 != e.padded || h.payload_offset < min_payload_offset ||
      h.hash_bytes != e.hash_bytes || h.hash_bytes > 32 ||
      (e.hash_bytes && std::memcmp(h.block_hash, e.hash, e.hash_bytes) != 0))
    return kHeader;
  const uint32_t data_crc = e.data_crc_known ? e.data_crc : crc32c(0, rec + kHeaderBytes, rb - kHeaderBytes);
  if (data_crc != h.data_crc) return kChecksum;
  if (e.tokens && (h.token_count != e.token_count ||
                   std::memcmp(rec + kHeaderBytes, e.tokens, 4ull * e.token_count) != 0))
    return kCollision;
  if (e.key && (h.key_bytes != e.key_bytes ||
                std::memcmp(rec + kHeaderBytes + 4ull * h.token_count, e.key, e.key_bytes) != 0))
    return kCollision;
  if (e.dst && !e.data_crc_known) std::memcpy(e.dst, rec + h.payload_offset, h.payload_bytes);
  return kOk;
}

uint64_t encode(uint8_t* rec, uint64_t room, const uint8_t* head, const uint32_t* tokens,
                const uint8_t* key, const uint8_t* payload) {
  HeaderV1 h;
  std::memcpy(&h, head, sizeof(h));
  const uint64_t T = h.token_count, K = h.key_bytes, po = h.payload_offset, P = h.payload_bytes;
  const uint64_t rb = h.record_bytes, padded = (rb + 4095) / 4096 * 4096;
  if (po < kHeaderBytes + 4 * T + K || rb != po + P || padded > room) return 0;
  h.data_crc = 0;
  h.header_crc = 0;
  std::memcpy(rec + kHeaderBytes, tokens, 4 * T);
  std::memcpy(rec + kHeaderBytes + 4 * T, key, K);
  std::memset(rec + kHeaderBytes + 4 * T + K, 0, po - (kHeaderBytes + 4 * T + K));
  std::memcpy(rec + po, payload, P);
  std::memset(rec + rb, 0, padded - rb);
  h.data_crc = crc32c(0, rec + kHeaderBytes, rb - kHeaderBytes);
  std::memcpy(rec, &h, sizeof(h));
  h.header_crc = crc32c(0, rec, 252);
  std::memcpy(rec + 252, &h.header_crc, 4);
  return padded;
}

}  // namespace record
}  // namespace dsv41
