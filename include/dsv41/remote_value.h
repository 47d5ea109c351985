// Remote values (python/dsv41/cache/remote/record.py is the reference): one record of the
// SSD store's format (include/dsv41/record.h) without the page padding, whose record_id /
// parent_id carry chain ids. Batches of them are encoded and checked here in one pass per
// value, so the remote tier's per-block cost is a copy and the CRCs, not Python.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dsv41/record.h"

namespace dsv41 {
namespace remote {

// Chain ids: the first 8 bytes (little-endian) of SHA-256 over "dsv41.remote.chain.v1",
// the parent's chain id (u64 LE), the block's token ids (u32 LE), the key's length (u64
// LE) and the key; 0 (which means "no parent") becomes 1. record.py's _chain_step.
class Chain {
 public:
  Chain(const uint8_t* key, size_t key_bytes, size_t tokens_per_block);
  uint64_t next(uint64_t parent, const uint32_t* tokens);

 private:
  std::vector<uint8_t> msg_;   // the message, with parent and tokens rewritten per block
  size_t tokens_at_ = 0, token_bytes_ = 0;
};

// One value: what it holds (encode) or must hold (check).
struct Value {
  uint64_t chain_id = 0, parent_chain = 0, created_ns = 0;
  uint32_t block_index = 0;
  const uint8_t* hash = nullptr;          // block hash, hash_bytes <= 32
  uint32_t hash_bytes = 0;
  const uint8_t* parent_hash = nullptr;   // parent hash, parent_hash_bytes <= 32
  uint32_t parent_hash_bytes = 0;
  const uint32_t* tokens = nullptr;
  uint32_t token_count = 0;
  const uint8_t* key = nullptr;
  uint32_t key_bytes = 0;
  uint32_t payload_offset = 0, payload_bytes = 0, record_bytes = 0;   // record_geometry's
};

// True when the n bytes at v are the record `e` describes, intact: record.py's
// verify_record says "ok" for exactly these (header CRC, magic, version, geometry, data
// CRC, key, block index, both hashes, chain ids, token ids). The payload is copied to dst
// (unless null) while its CRC is computed: dst holds garbage when the check fails.
bool check(const uint8_t* v, uint64_t n, const Value& e, uint8_t* dst);

// Writes the value's head (header, token ids, key, zeros up to payload_offset) at dst,
// and with `whole` the payload after it (copied in the pass that computes its CRC).
void encode(uint8_t* dst, bool whole, const Value& e, const uint8_t* payload);

}  // namespace remote
}  // namespace dsv41
