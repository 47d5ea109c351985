// The device entry points of dsv41/io.h for a build without CUDA: no device, nothing to
// pin, and the copy and CRC launchers report that they cannot run (cudaErrorNoDevice's
// value, 100), so a caller never mistakes them for success.
#ifndef DSV41_WITH_CUDA
#include "dsv41/io.h"

namespace dsv41 {
namespace io {

constexpr int kNoDevice = 100;

int cuda_device_count() { return 0; }
int cuda_host_register(void*, size_t) { return kNoDevice; }
int cuda_host_unregister(void*) { return kNoDevice; }
int cuda_copy_blocks(uint8_t*, const int64_t*, const uint8_t*, const int64_t*, size_t, uint64_t,
                     void*) {
  return kNoDevice;
}
int cuda_crc32c_ranges(const uint8_t*, const uint64_t*, const uint64_t*, uint32_t*, size_t,
                       void*) {
  return kNoDevice;
}

}  // namespace io
}  // namespace dsv41
#endif  // DSV41_WITH_CUDA
