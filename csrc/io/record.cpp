// The per-record check of a verified read (include/dsv41/record.h), run by the I/O worker
// that read the record, right after the read.
#include "dsv41/record.h"

#include <cstring>

#include "dsv41/crc32c.h"

namespace dsv41 {
namespace record {

int check(const uint8_t* rec, uint64_t avail, const Expect& e) {
  if (avail < e.span || avail < kHeaderBytes) return kTruncated;
  HeaderV1 h;
  std::memcpy(&h, rec, sizeof(h));
  if (std::memcmp(h.magic, kMagic, 8) != 0 || h.version != kFormatVersion ||
      h.header_bytes != kHeaderBytes || crc32c(0, rec, 252) != h.header_crc)
    return kHeader;
  const uint64_t rb = h.record_bytes;
  const uint64_t min_payload_offset = kHeaderBytes + 4ull * h.token_count + h.key_bytes;
  if (h.record_id != e.record_id || h.parent_id != e.parent_id || h.block_index != e.block_index ||
      h.payload_bytes != e.payload_bytes || rb != uint64_t(h.payload_offset) + h.payload_bytes ||
      span(rb) != e.span || h.payload_offset < min_payload_offset ||
      h.hash_bytes != e.hash_bytes || h.hash_bytes > 32 ||
      (e.hash_bytes && std::memcmp(h.block_hash, e.hash, e.hash_bytes) != 0))
    return kHeader;
  // The payload is copied to e.dst by the pass that checksums it (one pass over bytes the
  // read just brought in, instead of a CRC pass and a copy pass), with non-temporal stores:
  // a load fills a prefix's rows (megabytes, bound for the GPU pool or the model), and
  // streaming them keeps the caches for the reads and checks still running.
  const bool copy = e.dst && !e.data_crc_known;
  const uint64_t po = h.payload_offset;
  uint32_t data_crc = e.data_crc;
  if (!e.data_crc_known) {
    data_crc = crc32c(0, rec + kHeaderBytes, po - kHeaderBytes);
    data_crc = copy ? crc32c_copy_stream(data_crc, e.dst, rec + po, h.payload_bytes)
                    : crc32c(data_crc, rec + po, h.payload_bytes);
  }
  int status = kOk;
  if (data_crc != h.data_crc) {
    status = kChecksum;
  } else if (e.tokens && (h.token_count != e.token_count ||
                          std::memcmp(rec + kHeaderBytes, e.tokens, 4ull * e.token_count) != 0)) {
    status = kCollision;
  } else if (e.key && (h.key_bytes != e.key_bytes ||
                       std::memcmp(rec + kHeaderBytes + 4ull * h.token_count, e.key, e.key_bytes) != 0)) {
    status = kCollision;
  } else if (e.check_parent && (e.parent_hash == nullptr || e.parent_hash_bytes != h.hash_bytes ||
                                std::memcmp(h.parent_hash, e.parent_hash, h.hash_bytes) != 0)) {
    status = kChain;
  }
  if (status != kOk && copy) std::memset(e.dst, 0, h.payload_bytes);
  return status;
}

uint64_t encode(uint8_t* rec, uint64_t room, const uint8_t* head, const uint32_t* tokens,
                const uint8_t* key, const uint8_t* payload) {
  HeaderV1 h;
  std::memcpy(&h, head, sizeof(h));
  const uint64_t T = h.token_count, K = h.key_bytes, po = h.payload_offset, P = h.payload_bytes;
  const uint64_t rb = h.record_bytes, sp = span(rb);
  if (po < kHeaderBytes + 4 * T + K || rb != po + P || sp > room) return 0;
  h.data_crc = 0;
  h.header_crc = 0;
  std::memcpy(rec + kHeaderBytes, tokens, 4 * T);
  std::memcpy(rec + kHeaderBytes + 4 * T, key, K);
  std::memset(rec + kHeaderBytes + 4 * T + K, 0, po - (kHeaderBytes + 4 * T + K));
  std::memset(rec + rb, 0, sp - rb);
  // The payload is copied by the pass that checksums it, with non-temporal stores: the
  // staging buffer goes to the disk, and the CPU does not read it again.
  h.data_crc = crc32c_copy_stream(crc32c(0, rec + kHeaderBytes, po - kHeaderBytes), rec + po, payload, P);
  std::memcpy(rec, &h, sizeof(h));
  h.header_crc = crc32c(0, rec, 252);
  std::memcpy(rec + 252, &h.header_crc, 4);
  return sp;
}

}  // namespace record
}  // namespace dsv41
