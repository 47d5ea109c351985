// Shared between the attention .cu files (not a public header).
#pragma once

#include <cuda_runtime.h>

#include "dsv41/attention/params.h"

namespace dsv41 {
namespace attn {

struct KernelArgs {
  SparseAttentionParams p;
  int num_splits = 1;
  float* ws_o = nullptr;    // [T, S, H, D] partial outputs (normalised, no sink)
  float* ws_lse = nullptr;  // [T, S, H] partial log-sum-exp
};

// attention_mma_d<D>.cu (attention_mma.cuh): the mma.sync kernel for head dim kD (writes
// the final output when num_splits == 1, the partials otherwise).
template <int kD>
cudaError_t launch_mma_d(const KernelArgs& a, cudaStream_t stream);
template <int kD>
cudaError_t prepare_mma_d();  // its shared-memory attributes on the current device
cudaError_t prepare_wgmma();
// attention_wgmma.cu: the wgmma kernel (sm_90a, D = 512), same contract as launch_mma_d.
cudaError_t launch_wgmma(const KernelArgs& a, cudaStream_t stream);
// Why the wgmma kernel cannot run on `device` ("" if it can): it needs compute capability
// 9.0 and sm_90a machine code in this build.
const char* wgmma_unavailable(int device);
// attention_combine.cu: merges the partials and applies the sink.
cudaError_t launch_combine(const KernelArgs& a, cudaStream_t stream);
// attention_generic.cu: fp32, one warp per (query, head), any H and D % 32 == 0.
cudaError_t launch_generic(const SparseAttentionParams& p, cudaStream_t stream);

// Sets the dynamic shared-memory limit of `func` once per device (slots: mma.sync 0-5, two
// per head dim; wgmma 6-7). Plans set them ahead, so launches only check a flag.
cudaError_t ensure_smem_attribute(const void* func, int bytes, int slot);

}  // namespace attn
}  // namespace dsv41
