// Device side of the I/O engine: pinned host registration, batched block copies between
// host and device (or device and device), and a CRC-32C kernel that checks records read
// straight into GPU memory (GPUDirect Storage) without bringing their payload to the host.
// No torch headers: the binding layer passes raw pointers and a stream.
//
// Never run on a GPU in the project's CI (it has none): the CRC kernel follows the
// chunk-and-combine schedule of dsv41::crc32c_chunked, which the CPU tests check.
#include <cuda_runtime.h>

#include "dsv41/crc32c.h"
#include "dsv41/io.h"

namespace dsv41 {
namespace io {
namespace {

constexpr int kCrcThreads = 256;

__global__ void crc32c_ranges_kernel(const uint8_t* base, const uint64_t* offsets,
                                     const uint64_t* lengths, uint32_t* crcs) {
  __shared__ uint32_t table[256];
  __shared__ uint32_t partial[kCrcThreads];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = crc::table_entry(i);
  __syncthreads();
  const uint64_t n = lengths[blockIdx.x];
  const uint8_t* p = base + offsets[blockIdx.x];
  const uint64_t per = (n + kCrcThreads - 1) / kCrcThreads;
  const uint64_t start = per * threadIdx.x;
  const uint64_t len = start < n ? (n - start < per ? n - start : per) : 0;
  partial[threadIdx.x] = crc::update_bytes(0, p + start, len, table);
  __syncthreads();
  if (threadIdx.x != 0) return;
  // Same order and operators as crc32c_chunked(data, n, kCrcThreads) on the host.
  uint32_t acc = partial[0];
  if (n > 0) {
    const uint32_t op = crc::x8nmodp(per);
    for (int t = 1; t < kCrcThreads; ++t) {
      const uint64_t s = per * t;
      if (s >= n) break;
      const uint64_t l = n - s < per ? n - s : per;
      acc = l == per ? crc::combine_with_op(acc, partial[t], op) : crc::combine(acc, partial[t], l);
    }
  }
  crcs[blockIdx.x] = acc;
}

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error for later callers
    return 0;
  }
  return n;
}

int cuda_host_register(void* ptr, size_t bytes) {
  const cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
  if (e != cudaSuccess) cudaGetLastError();
  return static_cast<int>(e);
}

int cuda_host_unregister(void* ptr) {
  const cudaError_t e = cudaHostUnregister(ptr);
  if (e != cudaSuccess) cudaGetLastError();
  return static_cast<int>(e);
}

int cuda_copy_blocks(uint8_t* dst, const int64_t* dst_idx, const uint8_t* src,
                     const int64_t* src_idx, size_t n, uint64_t block_bytes, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    while (j < n && dst_idx[j] == dst_idx[j - 1] + 1 && src_idx[j] == src_idx[j - 1] + 1) ++j;
    const cudaError_t e = cudaMemcpyAsync(dst + dst_idx[i] * block_bytes,
                                          src + src_idx[i] * block_bytes,
                                          (j - i) * block_bytes, cudaMemcpyDefault, s);
    if (e != cudaSuccess) return static_cast<int>(e);
    i = j;
  }
  return static_cast<int>(cudaSuccess);
}

int cuda_crc32c_ranges(const uint8_t* base, const uint64_t* offsets, const uint64_t* lengths,
                       uint32_t* crcs, size_t n, void* stream) {
  if (n == 0) return static_cast<int>(cudaSuccess);
  crc32c_ranges_kernel<<<static_cast<unsigned>(n), kCrcThreads, 0,
                         static_cast<cudaStream_t>(stream)>>>(base, offsets, lengths, crcs);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace io
}  // namespace dsv41
