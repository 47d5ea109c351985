// SHA-256 (FIPS 180-4) of one contiguous message: the SHA extensions (x86-64, picked at run
// time) where the CPU has them, else portable code; both give the standard digest. Used
// for the remote tier's chain ids (include/dsv41/remote_value.h), which hash a few hundred
// bytes per block on every remote lookup.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dsv41 {

void sha256(const void* data, size_t n, uint8_t out[32]);
void sha256_portable(const void* data, size_t n, uint8_t out[32]);  // for tests: the fallback path
bool sha256_hw_available();

}  // namespace dsv41
