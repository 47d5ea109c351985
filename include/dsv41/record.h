// Persistent-cache record format, version 1: the header layout and the check every read
// runs. Framework-free. python/dsv41/cache/store/format.py writes the same bytes (REC_HEADER)
// and docs/cache.md describes them; the three must agree.
//
//   [0, 256)                  RecordHeaderV1 (little-endian)
//   [256, 256 + 4 T)          token ids, uint32
//   [.., + K)                 cache key encoding
//   [payload_offset, + P)     payload; record_bytes = payload_offset + P
//   zero fill to the record's span (record_bytes rounded up to kRecordAlign)
// In a segment file records lie back to back, each at the previous one's offset + span.
// header_crc = CRC-32C of header bytes [0, 252); data_crc = CRC-32C of [256, record_bytes).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsv41 {
namespace record {

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the record format is little-endian; this reader assumes a little-endian host"
#endif

constexpr uint16_t kFormatVersion = 1;
constexpr uint32_t kHeaderBytes = 256;
constexpr char kMagic[8] = {'D', 'S', 'V', '4', '1', 'R', 'E', 'C'};

// A record's span: the bytes it takes in a segment file. Records are packed back to back
// at this alignment (not at 4 KiB pages: a v41-flash record of 57,664 bytes padded to
// 61,440 cost 6-8% more bytes written and read than the dense layout); reads and writes
// cover the 4 KiB-aligned range around them. The payload inside a record is 64-byte
// aligned too, so a record at a 64-byte offset keeps its payload 64-byte aligned.
constexpr uint64_t kRecordAlign = 64;
inline uint64_t span(uint64_t record_bytes) { return (record_bytes + kRecordAlign - 1) / kRecordAlign * kRecordAlign; }

#pragma pack(push, 1)
struct HeaderV1 {
  char magic[8];
  uint16_t version;
  uint16_t header_bytes;
  uint32_t flags;
  uint64_t record_id;
  uint64_t parent_id;
  uint64_t created_ns;
  uint32_t block_index;
  uint32_t token_count;
  uint32_t key_bytes;
  uint32_t payload_offset;
  uint32_t payload_bytes;
  uint32_t record_bytes;
  uint8_t hash_bytes;
  uint8_t reserved0[7];
  uint8_t block_hash[32];
  uint8_t parent_hash[32];
  uint8_t reserved1[112];
  uint32_t data_crc;
  uint32_t header_crc;
};
#pragma pack(pop)
static_assert(sizeof(HeaderV1) == kHeaderBytes, "record header must be 256 bytes");

// Outcome of a check, in the order the checks run.
enum Status : int {
  kOk = 0,
  kTruncated = 1,   // fewer bytes than the record's span were read
  kHeader = 2,      // bad magic/version/header CRC, or not the record the index expects
  kChecksum = 3,    // data CRC mismatch: tokens, key or payload damaged
  kCollision = 4,   // intact, but its token ids or key are not the request's
  kChain = 5,       // intact and the request's, but its parent hash is not its parent's
};

// What the index says a record is, and what the request expects of it. tokens/key may be
// null (not compared); dst may be null (payload not copied).
struct Expect {
  uint64_t span = 0;  // the index's span of the record (span(record_bytes))
  uint64_t record_id = 0;
  uint64_t parent_id = 0;
  uint32_t block_index = 0;
  uint32_t payload_bytes = 0;
  const uint8_t* hash = nullptr;
  uint32_t hash_bytes = 0;
  const uint32_t* tokens = nullptr;
  uint32_t token_count = 0;
  const uint8_t* key = nullptr;
  uint32_t key_bytes = 0;
  uint8_t* dst = nullptr;
  // The chain link (check_parent): the record's parent_hash must be the block hash of the
  // record the index holds under parent_id (parent_hash, parent_hash_bytes; null when the
  // index holds no such record, which fails the check). Two stores merged into one
  // directory reuse record ids: ids alone must never continue a chain.
  bool check_parent = false;
  const uint8_t* parent_hash = nullptr;
  uint32_t parent_hash_bytes = 0;
  // Records read into device memory: only the head (header, token ids, key) is on the host
  // at `rec`; the data CRC was computed on the device and the payload stays there.
  bool data_crc_known = false;
  uint32_t data_crc = 0;
};

// Checks the record at `rec` (`avail` bytes were read there) and, when it is the expected
// intact record, copies its payload to e.dst (in the same pass as its CRC; a record that
// fails a check after the copy leaves e.dst zeroed, never holding unverified bytes).
// Returns a Status. With e.data_crc_known the
// data CRC is taken from e.data_crc and only the head of the record is read from `rec`.
int check(const uint8_t* rec, uint64_t avail, const Expect& e);

// Writes one record at `rec` (`room` bytes there) in one pass (the payload is checksummed
// by the pass that copies it): the header `head` (256 bytes, its geometry
// fields filled, CRC fields ignored), the token ids, the key, zeros up to payload_offset,
// the payload, zeros up to its span; then data_crc and header_crc.
// Returns the span, or 0 (nothing written) when the header's geometry is
// inconsistent or the record does not fit `room`.
uint64_t encode(uint8_t* rec, uint64_t room, const uint8_t* head, const uint32_t* tokens,
                const uint8_t* key, const uint8_t* payload);

}  // namespace record
}  // namespace dsv41
