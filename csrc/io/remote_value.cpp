// Remote values: chain ids, the one-pass check and the encoder (include/dsv41/remote_value.h).
#include "dsv41/remote_value.h"

#include <cstring>

#include "dsv41/crc32c.h"
#include "dsv41/sha256.h"

namespace dsv41 {
namespace remote {
namespace {

constexpr char kChainDomain[] = "dsv41.remote.chain.v1";
constexpr size_t kDomainBytes = sizeof(kChainDomain) - 1;

// The header `e` describes, CRC fields 0.
record::HeaderV1 header_of(const Value& e) {
  record::HeaderV1 h;
  std::memset(&h, 0, sizeof(h));
  std::memcpy(h.magic, record::kMagic, 8);
  h.version = record::kFormatVersion;
  h.header_bytes = record::kHeaderBytes;
  h.record_id = e.chain_id;
  h.parent_id = e.parent_chain;
  h.created_ns = e.created_ns;
  h.block_index = e.block_index;
  h.token_count = e.token_count;
  h.key_bytes = e.key_bytes;
  h.payload_offset = e.payload_offset;
  h.payload_bytes = e.payload_bytes;
  h.record_bytes = e.record_bytes;
  h.hash_bytes = static_cast<uint8_t>(e.hash_bytes);
  std::memcpy(h.block_hash, e.hash, e.hash_bytes);
  std::memcpy(h.parent_hash, e.parent_hash, e.parent_hash_bytes);
  return h;
}

}  // namespace

Chain::Chain(const uint8_t* key, size_t key_bytes, size_t tokens_per_block)
    : msg_(kDomainBytes + 8 + 4 * tokens_per_block + 8 + key_bytes),
      tokens_at_(kDomainBytes + 8),
      token_bytes_(4 * tokens_per_block) {
  std::memcpy(msg_.data(), kChainDomain, kDomainBytes);
  const uint64_t kb = key_bytes;
  std::memcpy(msg_.data() + tokens_at_ + token_bytes_, &kb, 8);
  if (key_bytes) std::memcpy(msg_.data() + tokens_at_ + token_bytes_ + 8, key, key_bytes);
}

uint64_t Chain::next(uint64_t parent, const uint32_t* tokens) {
  std::memcpy(msg_.data() + kDomainBytes, &parent, 8);
  if (token_bytes_) std::memcpy(msg_.data() + tokens_at_, tokens, token_bytes_);
  uint8_t d[32];
  sha256(msg_.data(), msg_.size(), d);
  uint64_t id;
  std::memcpy(&id, d, 8);
  return id ? id : 1;
}

bool check(const uint8_t* v, uint64_t n, const Value& e, uint8_t* dst) {
  if (n != e.record_bytes || n < record::kHeaderBytes) return false;
  record::HeaderV1 h;
  std::memcpy(&h, v, sizeof(h));
  // Every field verify_record compares, at once against the header it must be; created_ns,
  // flags, reserved bytes, the hashes' unused tails and the CRCs are not part of that.
  record::HeaderV1 want = header_of(e);
  want.created_ns = h.created_ns;
  want.flags = h.flags;
  std::memcpy(want.reserved0, h.reserved0, sizeof(h.reserved0));
  std::memcpy(want.block_hash + e.hash_bytes, h.block_hash + e.hash_bytes, 32 - e.hash_bytes);
  std::memcpy(want.parent_hash + e.parent_hash_bytes, h.parent_hash + e.parent_hash_bytes,
              32 - e.parent_hash_bytes);
  std::memcpy(want.reserved1, h.reserved1, sizeof(h.reserved1));
  want.data_crc = h.data_crc;
  want.header_crc = h.header_crc;
  if (std::memcmp(&want, &h, sizeof(h)) != 0 || crc32c(0, v, 252) != h.header_crc) return false;
  // The data CRC: token ids and key, then the payload, copied to dst in the same pass
  // (non-temporal stores, as a store read's: record.cpp).
  const uint8_t* body = v + record::kHeaderBytes;
  uint32_t crc = crc32c(0, body, e.payload_offset - record::kHeaderBytes);
  crc = dst ? crc32c_copy_stream(crc, dst, v + e.payload_offset, e.payload_bytes)
            : crc32c(crc, v + e.payload_offset, e.payload_bytes);
  return crc == h.data_crc && std::memcmp(body, e.tokens, 4ull * e.token_count) == 0 &&
         std::memcmp(body + 4ull * e.token_count, e.key, e.key_bytes) == 0;
}

void encode(uint8_t* dst, bool whole, const Value& e, const uint8_t* payload) {
  record::HeaderV1 h = header_of(e);
  uint8_t* body = dst + record::kHeaderBytes;
  const uint64_t token_bytes = 4ull * e.token_count;
  std::memcpy(body, e.tokens, token_bytes);
  std::memcpy(body + token_bytes, e.key, e.key_bytes);
  std::memset(body + token_bytes + e.key_bytes, 0, e.payload_offset - record::kHeaderBytes - token_bytes - e.key_bytes);
  const uint32_t crc = crc32c(0, body, e.payload_offset - record::kHeaderBytes);
  h.data_crc = whole ? crc32c_copy_stream(crc, dst + e.payload_offset, payload, e.payload_bytes)
                     : crc32c(crc, payload, e.payload_bytes);
  std::memcpy(dst, &h, sizeof(h));
  h.header_crc = crc32c(0, dst, 252);
  std::memcpy(dst + 252, &h.header_crc, 4);
}

}  // namespace remote
}  // namespace dsv41
