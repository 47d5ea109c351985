// Sparse attention: the plan (the choice of kernel and split count, once per batch shape),
// the run (what only the tensors tell, then dispatch).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>

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

bool aligned(const void* ptr, int n) { return reinterpret_cast<uintptr_t>(ptr) % n == 0; }

using DeviceFacts = AttentionDevice;

// Device facts, queried once per device (plans only; a run of wgmma looks its flag up).
const DeviceFacts* device_facts(int device) {
  static DeviceFacts facts[64];
  static std::once_flag once[64];
  if (device < 0 || device >= 64) return nullptr;
  std::call_once(once[device], [device] {
    DeviceFacts f;
    if (cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      cudaGetLastError();
      f.sms = 0;  // unknown device: every plan on it fails
    }
    f.wgmma_unavailable = attn::wgmma_unavailable(device);
    facts[device] = f;
  });
  return facts[device].sms > 0 ? &facts[device] : nullptr;
}

// Why neither tensor-core kernel can take the shape ("" if mma.sync can).
const char* mma_shape_blocker(int D, int W, int K, const DeviceFacts& f) {
  if (f.major < 8) return "compute capability < 8.0";
  if (!attn::is_mma_head_dim(D)) return "no tensor-core kernel for this head dim (64, 128 and 512 have one)";
  if (static_cast<int64_t>(W) + K > attn::kMaxKeys) return "W + K > 4096 keys per query";
  return "";
}
const char* wgmma_shape_blocker(int H, int D, const DeviceFacts& f) {
  if (f.wgmma_unavailable[0]) return f.wgmma_unavailable;
  if (D != attn::kHeadDim) return "the wgmma kernel needs D = 512";
  if (H % attn::kHeadsPerCta) return "the wgmma kernel needs H % 64 == 0";
  return "";
}

// Why the tensor-core kernels cannot read these tensors ("" if they can): what a plan
// cannot know. Value/code rows are copied in 16-byte pieces, scale rows in pieces of
// min(16, row bytes) (FP8 scales at D = 64: 2 bytes).
const char* tensor_blocker(const attn::SparseAttentionParams& p) {
  if (static_cast<int64_t>(p.W) + p.K > attn::kMaxKeys) return "W + K > 4096 keys per query";
  if (!aligned(p.q, 16) || p.q_stride_t % 4 || p.q_stride_h % 4) return "q rows not 16-byte aligned";
  const int fp8_piece = std::min(16, p.D / 32), nvfp4_piece = std::min(16, p.D / 16);
  if (p.W && p.n_swa_rows &&
      (!aligned(p.swa_values, 16) || p.swa_values_stride % 16 || !aligned(p.swa_scales, fp8_piece) ||
       p.swa_scales_stride % fp8_piece))
    return "SWA pool rows not aligned (values: 16 bytes; scales: min(16, D/32) bytes)";
  if (p.K && p.n_kv_rows &&
      (!aligned(p.kv_codes, 16) || p.kv_codes_stride % 16 || !aligned(p.kv_scales, nvfp4_piece) ||
       p.kv_scales_stride % nvfp4_piece))
    return "global pool rows not aligned (codes: 16 bytes; scales: min(16, D/16) bytes)";
  return "";
}

int64_t workspace_need(int T, int H, int D, int splits) {
  return splits > 1 ? static_cast<int64_t>(T) * splits * H * (D + 1) : 0;
}

cudaError_t prepare(int kernel, int D) {
  if (kernel == kAttentionWgmma) return attn::prepare_wgmma();
  if (kernel != kAttentionMma) return cudaSuccess;
  return D == 512 ? attn::prepare_mma_d<512>() : D == 128 ? attn::prepare_mma_d<128>() : attn::prepare_mma_d<64>();
}

cudaError_t launch_mma(const attn::KernelArgs& a, cudaStream_t s) {
  return a.p.D == 512 ? attn::launch_mma_d<512>(a, s)
         : a.p.D == 128 ? attn::launch_mma_d<128>(a, s)
                        : attn::launch_mma_d<64>(a, s);
}

}  // namespace

int plan_for_device(int T, int H, int D, int W, int K, int requested_kernel, int requested_splits,
                    const AttentionDevice& dev, AttentionPlan* plan) {
  clear_launch_error();
  if (T < 0 || H <= 0 || W < 0 || K < 0 || D <= 0)
    return launch_fail("sparse_attention: bad shape (T=%d H=%d D=%d W=%d K=%d)", T, H, D, W, K);
  if (D % 32) return launch_fail("sparse_attention: D=%d is not a multiple of 32", D);
  if (static_cast<int64_t>(T) * H > (int64_t{1} << 31) - 1) return launch_fail("sparse_attention: T*H too large");
  if (requested_kernel < kAttentionAuto || requested_kernel > kAttentionWgmma)
    return launch_fail("sparse_attention: unknown kernel %d", requested_kernel);
  if (dev.sms <= 0) return launch_fail("sparse_attention: no device facts");
  AttentionPlan out;
  out.max_queries = T;
  out.H = H;
  out.D = D;
  const char* mma_no = mma_shape_blocker(D, W, K, dev);
  const char* wg_no = mma_no[0] ? mma_no : wgmma_shape_blocker(H, D, dev);
  const int64_t head_groups = (H + attn::kHeadsPerCta - 1) / attn::kHeadsPerCta;
  switch (requested_kernel) {
    case kAttentionGeneric:
      out.kernel = kAttentionGeneric;
      break;
    case kAttentionMma:
      if (mma_no[0]) return launch_fail("sparse_attention: the mma.sync kernel cannot take this shape: %s", mma_no);
      out.kernel = kAttentionMma;
      break;
    case kAttentionWgmma:
      if (wg_no[0]) return launch_fail("sparse_attention: the wgmma kernel cannot take this shape: %s", wg_no);
      out.kernel = kAttentionWgmma;
      break;
    default:  // auto: at one CTA (T = 1 at 64 heads) mma.sync measured faster, from two on wgmma
      if (mma_no[0]) {
        out.kernel = kAttentionGeneric;
        out.fallback = mma_no;
      } else {
        out.kernel = !wg_no[0] && static_cast<int64_t>(T) * head_groups >= 2 ? kAttentionWgmma : kAttentionMma;
      }
  }
  if (out.kernel == kAttentionGeneric && D > 32 * attn::kGenericMaxDimPerLane)
    return launch_fail("sparse_attention: D=%d: no kernel (%s; the generic kernel takes D <= %d)", D,
                       out.fallback[0] ? out.fallback : "generic kernel asked for", 32 * attn::kGenericMaxDimPerLane);
  out.num_splits = 1;
  if (out.kernel != kAttentionGeneric && T > 0) {
    const int tiles = (W + attn::kTileKeys - 1) / attn::kTileKeys + (K + attn::kTileKeys - 1) / attn::kTileKeys;
    int s;
    if (requested_splits > 0) {
      s = requested_splits;
    } else {
      const int64_t ctas = static_cast<int64_t>(T) * head_groups;
      s = ctas >= dev.sms ? 1 : static_cast<int>(dev.sms / ctas);
      s = std::min(s, (tiles + attn::kMinTilesPerSplit - 1) / attn::kMinTilesPerSplit);
    }
    s = std::max(1, std::min({s, std::max(tiles, 1), attn::kMaxSplits}));
    if (static_cast<int64_t>(T) * s > (int64_t{1} << 31) - 1) s = 1;
    out.num_splits = s;
    out.workspace_floats = workspace_need(T, H, D, s);
  }
  *plan = out;
  return 0;
}

int sparse_attention_plan(int T, int H, int D, int W, int K, int requested_kernel, int requested_splits, int device,
                          AttentionPlan* plan) {
  clear_launch_error();
  const DeviceFacts* f = device_facts(device);
  if (!f) return launch_fail("sparse_attention: cannot query CUDA device %d", device);
  AttentionPlan out;
  if (int e = plan_for_device(T, H, D, W, K, requested_kernel, requested_splits, *f, &out)) return e;
  int cur = 0;
  cudaError_t e = cudaGetDevice(&cur);
  if (e == cudaSuccess && cur != device) e = cudaSetDevice(device);
  if (e == cudaSuccess) e = prepare(out.kernel, D);
  if (cur != device) cudaSetDevice(cur);
  if (e != cudaSuccess) return static_cast<int>(e);
  *plan = out;
  return 0;
}

int sparse_attention(const attn::SparseAttentionParams& p, int kernel, int num_splits, float* workspace,
                     int64_t workspace_floats, void* stream, const char** fallback) {
  clear_launch_error();
  if (fallback) *fallback = "";
  if (p.T < 0 || p.H <= 0 || p.D <= 0 || p.D % 32 || p.W < 0 || p.K < 0 || p.n_swa_rows < 0 || p.n_kv_rows < 0)
    return launch_fail("sparse_attention: bad shape (T=%d H=%d D=%d W=%d K=%d)", p.T, p.H, p.D, p.W, p.K);
  if (static_cast<int64_t>(p.T) * p.H > (int64_t{1} << 31) - 1) return launch_fail("sparse_attention: T*H too large");
  if (kernel == kAttentionMma || kernel == kAttentionWgmma) {
    if (!attn::is_mma_head_dim(p.D) || num_splits < 1 || num_splits > attn::kMaxSplits)
      return launch_fail("sparse_attention: no tensor-core plan for D=%d with %d splits", p.D, num_splits);
    if (kernel == kAttentionWgmma) {
      int dev = 0;
      if (cudaGetDevice(&dev) != cudaSuccess) return launch_fail("sparse_attention: no current device");
      const DeviceFacts* f = device_facts(dev);
      const char* why = f ? wgmma_shape_blocker(p.H, p.D, *f) : "no device";
      if (why[0]) return launch_fail("sparse_attention: wgmma plan on a shape or device it cannot take: %s", why);
    }
  } else if (kernel != kAttentionGeneric) {
    return launch_fail("sparse_attention: kernel %d is not a planned kernel", kernel);
  }
  if (p.T == 0) return 0;
  if (!p.q || !p.out || !p.lse || !p.sink) return launch_fail("sparse_attention: null q/out/lse/sink");
  if ((p.W && !p.swa_idx) || (p.K && !p.kv_idx)) return launch_fail("sparse_attention: null index list");
  if ((p.W && p.n_swa_rows && (!p.swa_values || !p.swa_scales)) || (p.K && p.n_kv_rows && (!p.kv_codes || !p.kv_scales)))
    return launch_fail("sparse_attention: null pool");
  auto s = static_cast<cudaStream_t>(stream);
  if (kernel != kAttentionGeneric) {
    const char* why = tensor_blocker(p);
    if (why[0]) {
      kernel = kAttentionGeneric;
      if (fallback) *fallback = why;
    }
  }
  if (kernel == kAttentionGeneric) {
    if (p.D > 32 * attn::kGenericMaxDimPerLane)
      return launch_fail("sparse_attention: D=%d: the generic kernel takes D <= %d", p.D, 32 * attn::kGenericMaxDimPerLane);
    return static_cast<int>(attn::launch_generic(p, s));
  }
  attn::KernelArgs a;
  a.p = p;
  a.num_splits = num_splits;
  if (num_splits > 1) {
    const int64_t need = workspace_need(p.T, p.H, p.D, num_splits);
    if (!workspace || workspace_floats < need)
      return launch_fail("sparse_attention: %d splits need a workspace of %lld floats, got %lld", num_splits,
                         static_cast<long long>(need), static_cast<long long>(workspace ? workspace_floats : 0));
    a.ws_o = workspace;
    a.ws_lse = workspace + static_cast<int64_t>(p.T) * num_splits * p.H * p.D;
  }
  cudaError_t e = kernel == kAttentionWgmma ? attn::launch_wgmma(a, s) : launch_mma(a, s);
  if (e != cudaSuccess || num_splits == 1) return static_cast<int>(e);
  return static_cast<int>(attn::launch_combine(a, s));
}

}  // namespace cuda
}  // namespace dsv41
