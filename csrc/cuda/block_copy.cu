// Batched block copy between pools: dst[dst_idx[i]] = src[src_idx[i]], i < n, in one
// kernel. Either pool may be pinned host memory (read or written by the SMs over PCIe
// through its mapped device address) or device memory. Each CTA moves a 16 KiB slice of
// one block pair per step (256 threads x 4 vectors of 16 bytes, all loads issued before
// the stores, so each thread keeps 64 bytes in flight); blockIdx.y strides over the pairs.
// A pair with a negative index is skipped. Pairs must not overlap (no dst block may be
// another pair's src or dst): they are copied concurrently.
// Why a kernel and not one cudaMemcpyAsync per pair: thousands of small blocks cost one
// launch instead of thousands of copy-engine commands; the copy engines stay free.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "dsv41/kernels.h"

namespace dsv41 {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename V>
__global__ void __launch_bounds__(kThreads)
    copy_blocks_kernel(const V* __restrict__ src, const int64_t* __restrict__ src_idx, V* __restrict__ dst,
                       const int64_t* __restrict__ dst_idx, int64_t n, int64_t vec_per_block) {
  constexpr int64_t kPerCta = static_cast<int64_t>(kThreads) * kUnroll;
  const int64_t v0 = static_cast<int64_t>(blockIdx.x) * kPerCta + threadIdx.x;
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    const int64_t si = src_idx[i], di = dst_idx[i];
    if (si < 0 || di < 0) continue;  // a pair the binding found out of range: no-op
    const V* s = src + si * vec_per_block;
    V* d = dst + di * vec_per_block;
    V buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * kThreads;
      if (v < vec_per_block) buf[u] = s[v];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * kThreads;
      if (v < vec_per_block) d[v] = buf[u];
    }
  }
}

// The device address of p (pinned host memory maps to a device address; device memory is
// its own); null if p is pageable host memory.
const void* device_view(const void* p, cudaError_t* err) {
  cudaPointerAttributes a{};
  *err = cudaPointerGetAttributes(&a, p);
  if (*err != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  switch (a.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
      return p;
    case cudaMemoryTypeHost:
      return a.devicePointer ? a.devicePointer : p;
    default:
      return nullptr;
  }
}

template <typename V>
int launch(const uint8_t* src, const int64_t* src_idx, uint8_t* dst, const int64_t* dst_idx, int64_t n,
           int64_t block_bytes, cudaStream_t s) {
  const int64_t vpb = block_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t per_cta = static_cast<int64_t>(kThreads) * kUnroll;
  const int64_t gx = (vpb + per_cta - 1) / per_cta;
  // Enough CTAs in flight to cover PCIe latency: ~4 per SM overall.
  const int64_t gy = std::max<int64_t>(1, std::min<int64_t>({n, 65535, std::max<int64_t>(1, 1056 / gx)}));
  copy_blocks_kernel<V><<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), kThreads, 0, s>>>(
      reinterpret_cast<const V*>(src), src_idx, reinterpret_cast<V*>(dst), dst_idx, n, vpb);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int copy_blocks(const uint8_t* src, const int64_t* src_idx, uint8_t* dst, const int64_t* dst_idx,
                int64_t n, int64_t block_bytes, void* stream) {
  clear_launch_error();
  if (n < 0 || block_bytes < 0) return launch_fail("copy_blocks: negative size");
  if (n == 0 || block_bytes == 0) return 0;
  if (block_bytes / 16 > (int64_t{1} << 40)) return launch_fail("copy_blocks: block too large");
  cudaError_t e;
  const void* s = device_view(src, &e);
  if (!s) return launch_fail("copy_blocks: src is neither device memory nor pinned host memory");
  void* d = const_cast<void*>(device_view(dst, &e));
  if (!d) return launch_fail("copy_blocks: dst is neither device memory nor pinned host memory");
  auto sp = static_cast<const uint8_t*>(s);
  auto dp = static_cast<uint8_t*>(d);
  auto st = static_cast<cudaStream_t>(stream);
  const uintptr_t align = reinterpret_cast<uintptr_t>(sp) | reinterpret_cast<uintptr_t>(dp) |
                          static_cast<uintptr_t>(block_bytes);
  if (align % 16 == 0) return launch<uint4>(sp, src_idx, dp, dst_idx, n, block_bytes, st);
  if (align % 4 == 0) return launch<uint32_t>(sp, src_idx, dp, dst_idx, n, block_bytes, st);
  return launch<uint8_t>(sp, src_idx, dp, dst_idx, n, block_bytes, st);
}

int copy_blocks_engine(const uint8_t* src, const int64_t* src_idx, uint8_t* dst, const int64_t* dst_idx,
                       int64_t n, int64_t block_bytes, void* stream) {
  clear_launch_error();
  if (n < 0 || block_bytes < 0) return launch_fail("copy_blocks: negative size");
  if (n == 0 || block_bytes == 0) return 0;
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  for (int64_t i = 0; i < n;) {
    int64_t j = i + 1;
    while (j < n && src_idx[j] == src_idx[j - 1] + 1 && dst_idx[j] == dst_idx[j - 1] + 1) ++j;
    dsts.push_back(dst + dst_idx[i] * block_bytes);
    srcs.push_back(src + src_idx[i] * block_bytes);
    sizes.push_back(static_cast<size_t>((j - i) * block_bytes));
    i = j;
  }
  auto st = static_cast<cudaStream_t>(stream);
  if (st != nullptr && st != cudaStreamLegacy) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attr_idx = 0;
    const cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), sizes.size(), &attr,
                                               &attr_idx, 1, st);
    if (e == cudaSuccess) return 0;
    cudaGetLastError();  // fall back to one copy per run
  }
  for (size_t k = 0; k < sizes.size(); ++k) {
    const cudaError_t e = cudaMemcpyAsync(dsts[k], srcs[k], sizes[k], cudaMemcpyDefault, st);
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  return 0;
}

}  // namespace cuda
}  // namespace dsv41
