// Sparse attention: host-side checks, the choice of kernel and split count, and dispatch.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "attention_internal.h"
#include "dsv41/attention/config.h"
#include "dsv41/kernels.h"

static_assert(dsv41::kInvalidValue == static_cast<int>(cudaErrorInvalidValue),
              "kInvalidValue must be cudaErrorInvalidValue");

namespace dsv41 {
namespace attn {

cudaError_t ensure_smem_attribute(const void* func, int bytes, int slot) {
  static std::atomic<uint64_t> done[8];  // bit d: set on device d
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit && (done[slot].load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  e = cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess && bit) done[slot].fetch_or(bit, std::memory_order_relaxed);
  return e;
}

}  // namespace attn

namespace cuda {
namespace {

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

int sm_count(int device) {
  static std::atomic<int> cache[64];
  if (device >= 0 && device < 64) {
    const int c = cache[device].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    n = 132;
  }
  if (device >= 0 && device < 64) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

// Why the tensor-core kernel cannot take p ("" if it can).
const char* tensor_core_blocker(const attn::SparseAttentionParams& p, int device) {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return "no device";
  }
  if (major < 8) return "compute capability < 8.0";
  if (p.D != attn::kHeadDim) return "D != 512";
  if (p.H % attn::kHeadsPerCta) return "H is not a multiple of 64";
  if (p.W + p.K > attn::kMaxKeys) return "W + K > 4096";
  if (!aligned16(p.q) || p.q_stride_t % 4 || p.q_stride_h % 4) return "q rows not 16-byte aligned";
  if (p.W && p.n_swa_rows && (!aligned16(p.swa_values) || !aligned16(p.swa_scales) ||
                              p.swa_values_stride % 16 || p.swa_scales_stride % 16))
    return "SWA pool rows not 16-byte aligned";
  if (p.K && p.n_kv_rows && (!aligned16(p.kv_codes) || !aligned16(p.kv_scales) ||
                             p.kv_codes_stride % 16 || p.kv_scales_stride % 16))
    return "global pool rows not 16-byte aligned";
  return "";
}

}  // namespace

int sparse_attention_plan(const attn::SparseAttentionParams& p, int requested_splits,
                          int impl, int device, AttentionPlan* plan) {
  const bool force_generic = impl == kAttentionGeneric;
  clear_launch_error();
  if (p.T < 0 || p.H < 0 || p.W < 0 || p.K < 0 || p.D <= 0)
    return launch_fail("sparse_attention: negative size (T=%d H=%d W=%d K=%d D=%d)", p.T, p.H, p.W, p.K, p.D);
  if (p.D % 32) return launch_fail("sparse_attention: D=%d is not a multiple of 32", p.D);
  if (p.n_swa_rows < 0 || p.n_kv_rows < 0) return launch_fail("sparse_attention: negative pool size");
  if (p.T > 0 && p.H > 0) {
    if (!p.q || !p.out || !p.lse || !p.sink) return launch_fail("sparse_attention: null q/out/lse/sink");
    if (p.W && !p.swa_idx) return launch_fail("sparse_attention: null swa_idx with W=%d", p.W);
    if (p.K && !p.kv_idx) return launch_fail("sparse_attention: null kv_idx with K=%d", p.K);
    if (p.W && p.n_swa_rows && (!p.swa_values || !p.swa_scales))
      return launch_fail("sparse_attention: null SWA pool");
    if (p.K && p.n_kv_rows && (!p.kv_codes || !p.kv_scales))
      return launch_fail("sparse_attention: null global pool");
  }
  if (static_cast<int64_t>(p.T) * p.H > (int64_t{1} << 31) - 1)
    return launch_fail("sparse_attention: T*H too large");
  AttentionPlan out;
  const char* blocker = force_generic ? "forced" : tensor_core_blocker(p, device);
  out.tensor_cores = blocker[0] == '\0';
  if (!out.tensor_cores && p.D > 32 * attn::kGenericMaxDimPerLane)
    return launch_fail("sparse_attention: D=%d: the tensor-core kernel needs D == 512 (%s) and the "
                       "generic kernel D <= %d", p.D, blocker, 32 * attn::kGenericMaxDimPerLane);
  if (impl == kAttentionWgmma) {
    if (!out.tensor_cores)
      return launch_fail("sparse_attention: DSV41_ATTENTION_IMPL=wgmma but the tensor-core kernels cannot "
                         "take these inputs (%s)", blocker);
    const char* why = attn::wgmma_unavailable(device);
    if (why[0]) return launch_fail("sparse_attention: DSV41_ATTENTION_IMPL=wgmma: %s", why);
    out.wgmma = true;
  }
  out.num_splits = 1;
  if (out.tensor_cores && p.T > 0 && p.H > 0) {
    const int tiles = (p.W + attn::kTileKeys - 1) / attn::kTileKeys + (p.K + attn::kTileKeys - 1) / attn::kTileKeys;
    int s;
    if (requested_splits > 0) {
      s = requested_splits;
    } else {
      const int64_t ctas = static_cast<int64_t>(p.T) * (p.H / attn::kHeadsPerCta);
      const int sms = sm_count(device);
      s = ctas >= sms ? 1 : static_cast<int>(sms / ctas);
      s = std::min(s, (tiles + attn::kMinTilesPerSplit - 1) / attn::kMinTilesPerSplit);
    }
    s = std::max(1, std::min({s, std::max(tiles, 1), attn::kMaxSplits}));
    if (static_cast<int64_t>(p.T) * s > (int64_t{1} << 31) - 1) s = 1;
    out.num_splits = s;
    if (s > 1) out.workspace_floats = static_cast<int64_t>(p.T) * s * p.H * (p.D + 1);
  }
  *plan = out;
  return 0;
}

int sparse_attention(const attn::SparseAttentionParams& p, const AttentionPlan& plan, float* workspace,
                     void* stream) {
  if (p.T == 0 || p.H == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  if (!plan.tensor_cores) return static_cast<int>(attn::launch_generic(p, s));
  attn::KernelArgs a;
  a.p = p;
  a.num_splits = plan.num_splits;
  if (plan.num_splits > 1) {
    if (!workspace) return launch_fail("sparse_attention: %d splits need a workspace", plan.num_splits);
    a.ws_o = workspace;
    a.ws_lse = workspace + static_cast<int64_t>(p.T) * plan.num_splits * p.H * p.D;
  }
  cudaError_t e = plan.wgmma ? attn::launch_wgmma(a, s) : attn::launch_mma(a, s);
  if (e != cudaSuccess || plan.num_splits == 1) return static_cast<int>(e);
  return static_cast<int>(attn::launch_combine(a, s));
}

}  // namespace cuda
}  // namespace dsv41
