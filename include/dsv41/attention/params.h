// Arguments of the sparse attention launchers: raw pointers, sizes and strides (elements
// for float tensors, bytes for the byte-coded pools), no framework types.
#pragma once

#include <cstdint>

namespace dsv41 {
namespace attn {

struct SparseAttentionParams {
  // q [T, H, D] float32, last dim contiguous.
  const float* q = nullptr;
  int64_t q_stride_t = 0, q_stride_h = 0;
  // SWA pool: values [Ns, D] E4M3 bytes, scales [Ns, D/32] UE8M0; rows contiguous.
  const uint8_t* swa_values = nullptr;
  const uint8_t* swa_scales = nullptr;
  int64_t swa_values_stride = 0, swa_scales_stride = 0;  // bytes per row
  int64_t n_swa_rows = 0;
  // swa_idx [T, W] int32 rows of the SWA pool, -1 (or anything outside [0, Ns)) = empty.
  const int32_t* swa_idx = nullptr;
  int64_t swa_idx_stride = 0;
  int W = 0;
  // Global pool: codes [Ng, D/2] packed E2M1, scales [Ng, D/16] E4M3; rows contiguous.
  const uint8_t* kv_codes = nullptr;
  const uint8_t* kv_scales = nullptr;
  int64_t kv_codes_stride = 0, kv_scales_stride = 0;  // bytes per row
  int64_t n_kv_rows = 0;
  // kv_idx [T, K] int32 rows of the global pool, -1 (or outside [0, Ng)) = empty.
  const int32_t* kv_idx = nullptr;
  int64_t kv_idx_stride = 0;
  int K = 0;
  const float* sink = nullptr;  // [H]
  float softmax_scale = 1.0f;
  int T = 0, H = 0, D = 0;
  // Outputs: out [T, H, D] float32 (last dim contiguous), lse [T, H].
  float* out = nullptr;
  int64_t out_stride_t = 0, out_stride_h = 0;
  float* lse = nullptr;
  int64_t lse_stride_t = 0;
};

}  // namespace attn
}  // namespace dsv41
